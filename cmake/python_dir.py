"""Print where the Python package goes under a prefix: the site directory under PREFIX that this
interpreter searches (its user site for PREFIX=~/.local, a venv's or conda env's own), relative
to PREFIX, and 'searched' or 'not-searched'. Used by `make install` (cmake/install_python.cmake)."""
import os
import site
import sys
import sysconfig

prefix = os.path.realpath(sys.argv[1])
candidates = []
if site.ENABLE_USER_SITE:
    candidates.append(site.getusersitepackages())
candidates += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
for c in candidates:
    c = os.path.realpath(c)
    if c.startswith(prefix + os.sep):
        print(os.path.relpath(c, prefix) + "\tsearched")
        break
else:
    pure = sysconfig.get_path("purelib", "posix_prefix", vars={"base": prefix, "platbase": prefix})
    print(os.path.relpath(pure, prefix) + "\tnot-searched")
