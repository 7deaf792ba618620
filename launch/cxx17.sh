#!/bin/sh
# A C++ compiler that builds what asks for C++14 as C++17: Horovod 0.28.1's CMake pins -std=c++14 and
# torch >= 2.1's headers need C++17. Passed to Horovod's build as CXX (launch/install.sh,
# launch/gpu-horovod-build.sh), so Horovod's sources stay unpatched. HVDTRAIN_REAL_CXX: the compiler.
real="${HVDTRAIN_REAL_CXX:-g++}"
for a in "$@"; do
  [ "$a" = "-std=c++14" ] && a="-std=c++17"
  set -- "$@" "$a"; shift
done
exec "$real" "$@"
