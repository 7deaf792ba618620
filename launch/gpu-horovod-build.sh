#!/usr/bin/env bash
# Builds Horovod 0.28.1 from the GPU kit's source against the torch that VENV sees (a venv made by
# launch/gpu-kit-install.sh), offline, and installs it there. With CUDA: NCCL operations, from
# the NCCL of the nvidia-nccl pip package that torch itself loads, for this GPU's architecture only;
# without: Gloo alone (so the build is proven on a CPU machine too). Always the Gloo controller, no MPI.
#
#   launch/gpu-horovod-build.sh VENV [--kit DIR] [--log FILE]
#
# A failed build ends with the tail of its log and the line that names the failure. The wheel is kept
# in HVDTRAIN_CACHE (default ~/.cache/hvdtrain) per torch, Python and GPU, as launch/install.sh keeps its.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kit="$here/.gpu-kit"
venv="${1:-}"
[ -n "$venv" ] || { echo "usage: launch/gpu-horovod-build.sh VENV [--kit DIR] [--log FILE]" >&2; exit 2; }
shift
log=""
while [ $# -gt 0 ]; do
  case "$1" in
    --kit) kit="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    *) echo "gpu-horovod-build.sh: unknown option '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
py="$venv/bin/python"
sdist=$(find "$kit/sdist" -maxdepth 1 -name 'horovod-*.tar.gz' | head -n 1)
[ -n "$sdist" ] || { echo "gpu-horovod-build.sh: no Horovod source in $kit/sdist: run make gpu-kit" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log="${log:-$work/horovod-build.log}"
say() { printf '[horovod-build] %s\n' "$*"; }

build_env=(
  CXX="$here/launch/cxx17.sh"
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  MAKEFLAGS="-j$(nproc)"
  CMAKE_POLICY_VERSION_MINIMUM=3.5  # CMake 4 (the pip wheel) rejects the bundled Gloo's old minimum
)
# An image with ninja but no make: CMake's default generator needs make.
if ! command -v make >/dev/null && command -v ninja >/dev/null; then build_env+=(CMAKE_GENERATOR=Ninja); fi

# torch's CUDA, this GPU's compute capability ("90" on an H100 or H200), and where the NCCL that torch
# loads keeps its header and library (the nvidia-nccl pip package: include/nccl.h, lib/libnccl.so.2).
facts=$("$py" - <<'PY'
import glob
import os
import sys

import torch

cuda = torch.cuda.is_available() and torch.version.cuda is not None
capability = "{}{}".format(*torch.cuda.get_device_capability(0)) if cuda else "-"
include = lib = "-"
for site in sys.path:
    headers = sorted(glob.glob(os.path.join(site, "nvidia", "**", "include", "nccl.h"), recursive=True))
    if headers and cuda:
        include = os.path.dirname(headers[0])
        libraries = sorted(glob.glob(os.path.join(os.path.dirname(include), "lib", "libnccl.so*")))
        lib = libraries[0] if libraries else "-"
        break
print(int(cuda), capability, include, lib, torch.__version__.split("+")[0], "cp{}{}".format(*sys.version_info[:2]))
PY
)
read -r cuda capability nccl_include nccl_lib torch_version py_tag <<<"$facts"
flavour="torch$torch_version-$py_tag-mpi0-gpu$cuda-src1"  # -src1: launch/horovod-source.sh's fix
[ "$cuda" = 1 ] && flavour+="-cc$capability"
wheel_dir="${HVDTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain}/wheels/$(basename "$sdist" .tar.gz)-$flavour"

if [ "$cuda" = 1 ]; then
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  [ -x "$nvcc" ] || { echo "gpu-horovod-build.sh: torch sees a GPU but nvcc is not on PATH nor in /usr/local/cuda/bin" >&2; exit 1; }
  include="${HOROVOD_NCCL_INCLUDE:-$nccl_include}"
  lib_dir="${HOROVOD_NCCL_LIB:-}"
  if [ "$include" = "-" ] || { [ -z "$lib_dir" ] && [ "$nccl_lib" = "-" ]; }; then
    echo "gpu-horovod-build.sh: NCCL's nccl.h and libnccl.so were not found under nvidia/ in site-packages" \
      "(the nvidia-nccl pip package): set HOROVOD_NCCL_INCLUDE and HOROVOD_NCCL_LIB" >&2
    exit 1
  fi
  if [ -z "$lib_dir" ]; then
    # The package ships libnccl.so.2 alone; CMake's find_library looks for libnccl.so.
    lib_dir="$work/nccl-lib"
    mkdir -p "$lib_dir"
    ln -s "$nccl_lib" "$lib_dir/libnccl.so"
  fi
  build_env+=(
    HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED
    HOROVOD_NCCL_INCLUDE="$include" HOROVOD_NCCL_LIB="$lib_dir"
    HOROVOD_CUDA_HOME="$(dirname "$(dirname "$nvcc")")"
    HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-$capability}"
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${capability:0:-1}.${capability: -1}}"
  )
  say "building Horovod with NCCL $include for compute capability $capability (nvcc $nvcc)"
else
  say "no GPU visible to torch: building Horovod with Gloo alone (no NCCL operations)"
fi

started=$SECONDS
if find "$wheel_dir" -name 'horovod-*.whl' 2>/dev/null | grep -q .; then
  say "reusing the wheel built before in $wheel_dir"
elif ! source_dir=$(bash "$here/launch/horovod-source.sh" "$py" "" "$work/source" "$sdist"); then
  echo "gpu-horovod-build.sh: could not unpack and fix $sdist" >&2
  exit 1
elif ! env "${build_env[@]}" "$py" -m pip --disable-pip-version-check wheel -v --no-build-isolation --no-deps \
    --no-index --no-cache-dir -w "$wheel_dir" "$source_dir" >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  failure=$(grep -m 1 -E '(error|Error|ERROR)[: ]' "$log" || echo "see the log")
  echo "gpu-horovod-build.sh: the Horovod build failed after $((SECONDS - started)) s: $failure (log: $log)" >&2
  exit 1
else
  say "built in $((SECONDS - started)) s"
fi
"$py" -m pip --disable-pip-version-check -q install --no-index --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
# Horovod's wheel brings a horovodrun of its own: the entries go back on top.
bash "$here/launch/launcher-entries.sh" "$py" torchrun horovodrun
"$py" - "$cuda" <<'PY'
import sys

import horovod.torch as hvd

if not hvd.gloo_built():
    sys.exit("gpu-horovod-build.sh: Horovod installed without Gloo")
if sys.argv[1] == "1" and not hvd.nccl_built():
    sys.exit("gpu-horovod-build.sh: Horovod installed without NCCL operations")
print(f"[horovod-build] installed: Gloo, NCCL operations {'yes' if hvd.nccl_built() else 'no'}")
PY
