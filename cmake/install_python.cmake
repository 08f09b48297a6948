# Installs the Python package at install time, where the prefix is final (cmake --install
# --prefix, make install PREFIX=...): into the site directory under the prefix that the Python
# named by $SPW_PYTHON (else the configured SPW_PYTHON) searches, unless SPW_PYTHON_PKGDIR fixes
# it. Writes _install.py, the library's place relative to the package, so the tree stays
# relocatable like spillway.pc. Set before this script: SPW_PYTHON, SPW_PYTHON_PKGDIR, SPW_SOURCE_DIR,
# SPW_BINARY_DIR, SPW_LIBDIR.
set(prefix "${CMAKE_INSTALL_PREFIX}")
if(DEFINED ENV{SPW_PYTHON} AND NOT "$ENV{SPW_PYTHON}" STREQUAL "")
  set(SPW_PYTHON "$ENV{SPW_PYTHON}")
endif()
if(SPW_PYTHON_PKGDIR)
  set(pydir "${SPW_PYTHON_PKGDIR}")
  set(searched "as configured (SPW_PYTHON_PKGDIR)")
else()
  execute_process(COMMAND "${SPW_PYTHON}" "${SPW_SOURCE_DIR}/cmake/python_dir.py" "${prefix}"
                  OUTPUT_VARIABLE out RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0 OR out STREQUAL "")
    set(pydir "lib/python3/dist-packages")
    set(searched "not-searched")
    message(WARNING "spillway: cannot run ${SPW_PYTHON}; the Python package goes to ${prefix}/${pydir}")
  else()
    string(REPLACE "\t" ";" out "${out}")
    list(GET out 0 pydir)
    list(GET out 1 searched)
  endif()
endif()
file(INSTALL "${SPW_SOURCE_DIR}/python/spillway" DESTINATION "$ENV{DESTDIR}${prefix}/${pydir}"
     PATTERN __pycache__ EXCLUDE PATTERN "*.pyc" EXCLUDE PATTERN "*.so*" EXCLUDE)
file(RELATIVE_PATH SPW_PY_TO_LIBDIR "${prefix}/${pydir}/spillway" "${prefix}/${SPW_LIBDIR}")
configure_file("${SPW_SOURCE_DIR}/python/_install.py.in" "${SPW_BINARY_DIR}/python/_install.py" @ONLY)
file(INSTALL "${SPW_BINARY_DIR}/python/_install.py" DESTINATION "$ENV{DESTDIR}${prefix}/${pydir}/spillway")
if(searched STREQUAL "not-searched")
  message(STATUS "spillway: ${SPW_PYTHON} does not search ${prefix}/${pydir}: "
                 "add it to PYTHONPATH, or pass PYTHON=... for the interpreter you use")
else()
  message(STATUS "spillway: Python package in ${prefix}/${pydir} (${SPW_PYTHON} finds it)")
endif()
