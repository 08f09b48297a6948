#!/usr/bin/env python3
"""Runs README.md's install instructions as written, into a temporary HOME, and checks the result
from another directory: `make install PREFIX=~/.local` (the CLI and its interposer, the library,
the header and .pc file, the Python package where python3 finds it), the C example built with
pkg-config, and the venv + pip install of the Python package on a copy of the source tree.
The README's blocks are found by their markers (<!-- check:NAME --> before a fenced block).
Usage: install_check.py SOURCE_DIR BUILD_DIR. Exits 1 naming the step that failed."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

SRC, BUILD = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])


def block(text, name):
    m = re.search(r"<!-- check:" + re.escape(name) + r" -->\s*\n```[a-z]*\n(.*?)\n```", text, re.S)
    if not m:
        sys.exit(f"install_check: README.md has no block marked <!-- check:{name} -->")
    return m.group(1)


def run(what, cmd, cwd, env, shell=False):
    print(f"install_check: {what}: {cmd if shell else ' '.join(cmd)}", flush=True)
    p = subprocess.run(["bash", "-e", "-c", cmd] if shell else cmd, cwd=cwd, env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-6000:] + p.stderr[-6000:])
        sys.exit(f"install_check: {what} failed with status {p.returncode}")
    return p.stdout


def check(cond, msg):
    if not cond:
        sys.exit(f"install_check: {msg}")


def main():
    readme = open(os.path.join(SRC, "README.md"), encoding="utf-8").read()
    tmp = tempfile.mkdtemp(prefix="spw-install-")
    try:
        home = os.path.join(tmp, "home")
        elsewhere = os.path.join(tmp, "elsewhere")
        os.makedirs(home)
        os.makedirs(elsewhere)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "SPILLWAY_LIBRARY", "SPILLWAY_CONF",
                            "VIRTUAL_ENV", "PKG_CONFIG_PATH", "LD_LIBRARY_PATH", "MAKEFLAGS", "MFLAGS",
                            "MAKELEVEL")}
        # Debian's python3 (the one `make test` installs torch for) first on PATH, as on a user's
        # Debian 12; BUILD is the Makefile's build directory (the one this test belongs to).
        env.update(HOME=home, PATH="/usr/bin:/bin:" + os.environ.get("PATH", ""), BUILD=BUILD)
        prefix = os.path.join(home, ".local")

        # 1. make install PREFIX=~/.local
        run("make install", block(readme, "install"), SRC, env, shell=True)
        cli = os.path.join(prefix, "bin", "spillway")
        out = run("spillway --help", [cli, "--help"], elsewhere, env)
        check(out.startswith("usage: spillway"), f"{cli} --help printed {out[:200]!r}")
        run("spillway run (the interposer is found from the prefix)",
            [cli, "run", "--budget", "1GiB", "--", "true"], elsewhere, env)
        out = run("import from another directory",
                  ["python3", "-c", "import spillway, spillway.torch; print(spillway.__file__); "
                   "print(spillway.library_path)"], elsewhere, env)
        pkg, lib = out.split("\n")[:2]
        check(pkg.startswith(prefix + os.sep), f"spillway imported from {pkg}, not from under {prefix}")
        check(os.path.realpath(lib).startswith(os.path.realpath(prefix) + os.sep),
              f"libspillway loaded from {lib}, not from under {prefix}")

        # 2. the C example, built with pkg-config against the installed prefix
        cdir = os.path.join(tmp, "c")
        os.makedirs(cdir)
        with open(os.path.join(cdir, "app.c"), "w") as f:
            f.write(block(readme, "c-source") + "\n")
        out = run("the C example", block(readme, "c-build"), cdir, env, shell=True)
        check("budget" in out, f"the C example printed no summary: {out[:400]!r}")

        # 3. venv + pip on a copy of the source tree (the build there bundles its own library)
        tree = os.path.join(tmp, "spillway")
        shutil.copytree(SRC, tree, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", "build", "build-*", ".venv", ".debs", "__pycache__", "*.egg-info"))
        run("venv + pip install", block(readme, "venv"), tree, env, shell=True)
        py = os.path.join(tree, ".venv", "bin", "python")
        out = run("import from the venv, in another directory",
                  [py, "-c", "import spillway, spillway.torch; print(spillway.__file__); "
                   "print(spillway.library_path)"], elsewhere, env)
        pkg, lib = out.split("\n")[:2]
        venv = os.path.join(tree, ".venv") + os.sep
        check(pkg.startswith(venv), f"the venv imported spillway from {pkg}")
        check(lib.startswith(venv), f"the venv loaded libspillway from {lib}, not its bundled copy")
        print("install_check: README's install instructions work as written")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
