#!/bin/sh
# A C++ compiler that builds what asks for C++14 as C++17: Horovod 0.28.1's CMake pins -std=c++14 and
# torch >= 2.1's headers need C++17. Passed to Horovod's build as CXX (launch/install.sh,
# launch/gpu-horovod-build.sh), so Horovod's sources stay unpatched. Each compile step also gets the
# standard headers below included first: Horovod's own use std::string, uint8_t, std::logic_error and
# more without including them, which GCC 12's headers happened to pull in and GCC 13's no longer do.
# HVDTRAIN_REAL_CXX: the compiler.
real="${HVDTRAIN_REAL_CXX:-g++}"
compiles=""
for a in "$@"; do
  [ "$a" = "-std=c++14" ] && a="-std=c++17"
  [ "$a" = "-c" ] && compiles=1
  set -- "$@" "$a"; shift
done
[ -n "$compiles" ] && set -- -include string -include cstdint -include stdexcept -include limits -include memory \
  -include algorithm -include functional -include cstring "$@"
exec "$real" "$@"
