"""Optional: bundle libspillway.so into the package when built from the repository.

Everything else is in pyproject.toml. The package itself is pure Python; bundling only spares
a separate `make install`. Any failure here is reported and the install continues without the
library (the package then finds an installed one, or says where it looked).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


class BuildPyWithLib(build_py):
    def run(self) -> None:
        super().run()
        if os.environ.get("SPILLWAY_BUILD_LIB", "1") == "0":
            return
        if not (REPO / "CMakeLists.txt").is_file() or not (REPO / "include" / "spillway.h").is_file():
            return
        if not shutil.which("cmake") or not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
            print("spillway: no cmake or C compiler: libspillway.so not bundled", file=sys.stderr)
            return
        build = Path(self.build_temp if hasattr(self, "build_temp") else "build") / "libspillway"
        if not build.is_absolute():
            build = HERE / build
        try:
            subprocess.run(["cmake", "-S", str(REPO), "-B", str(build), "-DSPW_TESTS=OFF",
                            "-DSPW_INSTALL_PYTHON=OFF", "-DCMAKE_BUILD_TYPE=Release"], check=True)
            subprocess.run(["cmake", "--build", str(build), "--target", "spillway", "-j",
                            str(os.cpu_count() or 2)], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"spillway: building libspillway failed ({e}); not bundled", file=sys.stderr)
            return
        lib = build / "libspillway.so.0"
        if lib.exists():
            dest = Path(self.build_lib) / "spillway" / "libspillway.so.0"
            shutil.copy2(lib.resolve(), dest)
            print(f"spillway: bundled {dest}", file=sys.stderr)


setup(cmdclass={"build_py": BuildPyWithLib})
