#!/bin/sh
# libspillway and its users need no zlib: the shared library's dynamic section names no libz and
# the pkg-config file asks for none. CONTROL, a binary that does link zlib (the CLI, for gzip
# traces), shows that the check sees libz where it is.
# usage: check_no_zlib.sh LIBSPILLWAY.so SPILLWAY.pc CONTROL
set -eu
so=$1 pc=$2 control=$3
needed() { readelf -d "$1" | awk '/\(NEEDED\)/ { print $NF }'; }
needed "$so" | grep -q 'libc\.so' || { echo "no_zlib: cannot read the NEEDED entries of $so" >&2; exit 2; }
needed "$control" | grep -q 'libz\.so' || { echo "no_zlib: control $control shows no libz: the check is blind" >&2; exit 2; }
if needed "$so" | grep 'libz\.so'; then
  echo "no_zlib: $so needs zlib"
  exit 1
fi
if grep -nE 'zlib|-lz\b' "$pc"; then
  echo "no_zlib: $pc asks for zlib"
  exit 1
fi
echo "no_zlib: $so needs: $(needed "$so" | tr '\n' ' ')"
