#!/usr/bin/env bash
# Sets up everything hvdtrain needs, once, and is quick when it is already done.
# Used by `make demo`, `make test` (and so CI) and both Docker images, so the steps
# a user runs are the steps that are tested.
#
#   launch/install.sh [--venv DIR] [--extras test,bench] [--gpu] [--engine all|torch]
#
# --engine torch installs only what the torch.distributed engine needs (torchrun, Gloo
# and NCCL come with torch's wheel): no MPI, no Horovod build, nothing to compile.
#
# Environment: PYTHON (interpreter for the venv), TORCH_SPEC (default torch==2.13.0),
# HVDTRAIN_CACHE (wheel cache, default ~/.cache/hvdtrain), HVDTRAIN_WHEELHOUSE (prebuilt wheels).
#
# Steps: a virtual environment; torch; for the Horovod engine, OpenMPI from Debian when
# `mpicxx` is missing and we are root, and Horovod 0.28.1 built with PyTorch, Gloo and MPI
# (and NCCL with --gpu) into a wheel cache outside the repository, reused on the next
# run; the launcher entries; the hvdtrain package itself, editable.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${VENV:-$here/.venv}"
extras="${EXTRAS:-}"
gpu="${HVDTRAIN_GPU:-0}"
python="${PYTHON:-python3.11}"
engine="all"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
horovod_version="0.28.1"
cache="${HVDTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain}"

while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    --extras) extras="$2"; shift 2 ;;
    --gpu) gpu=1; shift ;;
    --engine) engine="$2"; shift 2 ;;
    *) echo "install.sh: unknown option '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done

say() { printf '[install] %s\n' "$*"; }
case "$engine" in all|torch) ;; *) echo "install.sh: --engine is all or torch, not '$engine'" >&2; exit 2 ;; esac

# An absolute path: the entries written below name their interpreter by it, and a
# relative one (`make` passes VENV=.venv) would only work from the repository's root.
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac

# 1. Python environment.
command -v "$python" >/dev/null || python=python3
if [ ! -x "$venv/bin/python" ]; then
  say "creating virtual environment $venv"
  "$python" -m venv "$venv"
fi
export PATH="$venv/bin:$PATH"
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }

# 2. torch (the CPU build is on this machine's disk; elsewhere pip fetches it).
if ! "$py" -c 'import torch' 2>/dev/null; then
  say "installing $torch_spec"
  pip install "$torch_spec" numpy
fi

with_mpi=0
if [ "$engine" = all ]; then
  # 3. OpenMPI. Without root we cannot install it: Horovod is then built with Gloo only.
  with_mpi=1
  if ! command -v mpicxx >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      say "installing OpenMPI from Debian"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev openssh-client >/dev/null
    else
      say "mpicxx not found and not root: building Horovod WITHOUT MPI (Gloo only)."
      say "To get MPI: sudo apt-get install openmpi-bin libopenmpi-dev, then run this again."
      with_mpi=0
    fi
  fi
  # SSH: horovodrun reaches other hosts through it (sshd runs on each worker host).
  if [ ! -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing OpenSSH from Debian"
    apt-get install -y -qq --no-install-recommends openssh-client openssh-server >/dev/null \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends openssh-client openssh-server >/dev/null; }
  fi
  if ! command -v cmake >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # Debian's cmake 3.25: the cmake 4.x wheel rejects Horovod's bundled gloo.
    apt-get install -y -qq --no-install-recommends cmake >/dev/null
  fi

  # 4. Horovod, built once per (Python, torch, MPI, GPU) and cached as a wheel.
  torch_version=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')
  py_tag=$("$py" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
  # -src1: built from launch/horovod-source.sh's source (its fix); a wheel built before it is not reused
  flavour="torch${torch_version}-${py_tag}-mpi${with_mpi}-gpu${gpu}-src1"
  [ "${HVDTRAIN_HOROVOD_DEBUG_INFO:-0}" = 1 ] && flavour="$flavour-debug"  # launch/cxx17.sh
  wheel_dir="$cache/wheels/horovod-$horovod_version-$flavour"
  # HVDTRAIN_WHEELHOUSE: read-only wheels laid out as this cache's wheels/ folder (an image
  # build lent the wheel its host built); used when it holds this flavour.
  lent="${HVDTRAIN_WHEELHOUSE:-}/horovod-$horovod_version-$flavour"
  if [ -n "${HVDTRAIN_WHEELHOUSE:-}" ] && ls "$lent"/horovod-*.whl >/dev/null 2>&1; then
    wheel_dir="$lent"
  fi

  # Which wheel the environment holds: one of an older flavour (say, without the source's fix) is replaced.
  installed_flavour="$venv/horovod-flavour"
  horovod_ok() {
    [ "$(cat "$installed_flavour" 2>/dev/null)" = "$flavour" ] || return 1
    "$py" - "$with_mpi" <<'PY' 2>/dev/null
import sys
import horovod.torch as hvd
need_mpi = sys.argv[1] == "1"
assert hvd.gloo_built() and (hvd.mpi_built() or not need_mpi)
PY
  }

  if ! horovod_ok; then
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
      say "building Horovod $horovod_version for $flavour (a few minutes, once)"
      mkdir -p "$wheel_dir" "$cache/build"
      # pip's own wheel cache is bypassed (--no-cache-dir): it keys builds by the sdist, not
      # by the torch they were compiled against; this cache is keyed by both.
      # Horovod 0.28.1 pins -std=c++14; torch >= 2.1 headers need C++17. A compiler
      # wrapper raises the standard; launch/horovod-source.sh makes one fix to the source.
      wrapper="$here/launch/cxx17.sh"
      pip install 'setuptools<81' wheel packaging cloudpickle psutil pyyaml cffi numpy
      source_dir=$(bash "$here/launch/horovod-source.sh" "$py" "$horovod_version" "$cache/build/horovod-source" \
        2>"$cache/build/horovod-source.log") || {
          cat "$cache/build/horovod-source.log" >&2
          echo "install.sh: could not get Horovod $horovod_version's source" >&2
          exit 1
        }
      build_env=(
        CXX="$wrapper"
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
        MAKEFLAGS="-j$(nproc)"
      )
      if [ "$with_mpi" = 1 ]; then build_env+=(HOROVOD_WITH_MPI=1); else build_env+=(HOROVOD_WITHOUT_MPI=1); fi
      if [ "$gpu" = 1 ]; then build_env+=(HOROVOD_GPU_OPERATIONS=NCCL); fi
      env "${build_env[@]}" "$py" -m pip --disable-pip-version-check wheel \
        --no-build-isolation --no-deps --no-binary horovod --no-cache-dir \
        -w "$wheel_dir" "$source_dir" >"$cache/build/horovod-build.log" 2>&1 || {
          tail -n 40 "$cache/build/horovod-build.log" >&2
          echo "install.sh: the Horovod build failed; full log: $cache/build/horovod-build.log" >&2
          exit 1
        }
    fi
    say "installing Horovod from $wheel_dir"
    pip install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
    pip install cloudpickle psutil pyyaml packaging cffi
    echo "$flavour" >"$installed_flavour"
    horovod_ok || { echo "install.sh: Horovod installed but does not import with Gloo${with_mpi:+/MPI}" >&2; exit 1; }
  fi

fi

# Horovod's Gloo launcher and torchrun print a traceback and a report of their own
# whenever a worker exits non-zero; these entries run the same launchers and report
# that in one line (hvdtrain/cli/launchers.py).
launchers=(torchrun)
[ "$engine" = all ] && launchers+=(horovodrun)
bash "$here/launch/launcher-entries.sh" "$py" "${launchers[@]}"

# 5. hvdtrain itself (editable) and mpi4py when MPI is there.
spec="$here"
[ -n "$extras" ] && spec="${here}[${extras}]"
packages=(-e "$spec")
[ "$with_mpi" = 1 ] && packages+=(mpi4py)
pip install "${packages[@]}"
# An editable install leaves the package's modules uncompiled; where PYTHONDONTWRITEBYTECODE is set
# (as on many CI machines and images), every process would compile them again at start (0.3 s a rank).
"$py" -m compileall -q "$here/hvdtrain"
if [ "$engine" = all ]; then
  say "ready: $("$py" -c 'import torch, horovod; print(f"torch {torch.__version__}, horovod {horovod.__version__}")')"
else
  say "ready: $("$py" -c 'import torch; print(f"torch {torch.__version__}, torch.distributed engine only (no Horovod)")')"
fi
