#!/bin/sh
# A C++ compiler that builds what asks for C++14 as C++17: Horovod 0.28.1's CMake pins -std=c++14 and
# torch >= 2.1's headers need C++17. Passed to Horovod's build as CXX (launch/install.sh,
# launch/gpu-horovod-build.sh), so Horovod's sources stay unpatched. Each compile step also includes
# launch/cxx-std-headers.h first (by its full path: nothing of the build's own folders can stand in
# for it), for GCC 13. HVDTRAIN_REAL_CXX: the compiler.
#
# Without debug information (-g0 last, over the -g of Horovod's RelWithDebInfo build): the build is
# the longest step of a first install, and its library would be 65 MB instead of a few. Set
# HVDTRAIN_HOROVOD_DEBUG_INFO=1 to keep it (for gdb in Horovod's C++).
real="${HVDTRAIN_REAL_CXX:-g++}"
headers="$(cd "$(dirname "$0")" && pwd)/cxx-std-headers.h"
compiles=""
for a in "$@"; do
  [ "$a" = "-std=c++14" ] && a="-std=c++17"
  [ "$a" = "-c" ] && compiles=1
  set -- "$@" "$a"; shift
done
[ -n "$compiles" ] && set -- -include "$headers" "$@"
[ "${HVDTRAIN_HOROVOD_DEBUG_INFO:-0}" = 1 ] || set -- "$@" -g0
exec "$real" "$@"
