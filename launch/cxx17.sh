#!/bin/sh
# A C++ compiler that builds what asks for C++14 as C++17: Horovod 0.28.1's CMake pins -std=c++14 and
# torch >= 2.1's headers need C++17. Passed to Horovod's build as CXX (launch/install.sh,
# launch/gpu-horovod-build.sh), so Horovod's sources stay unpatched. Each compile step also includes
# launch/cxx-std-headers.h first (by its full path: nothing of the build's own folders can stand in
# for it), for GCC 13. HVDTRAIN_REAL_CXX: the compiler.
real="${HVDTRAIN_REAL_CXX:-g++}"
headers="$(cd "$(dirname "$0")" && pwd)/cxx-std-headers.h"
compiles=""
for a in "$@"; do
  [ "$a" = "-std=c++14" ] && a="-std=c++17"
  [ "$a" = "-c" ] && compiles=1
  set -- "$@" "$a"; shift
done
[ -n "$compiles" ] && set -- -include "$headers" "$@"
exec "$real" "$@"
