#!/usr/bin/env bash
# Fills a folder (default .gpu-kit/, ignored by git) with everything a GPU machine without a network
# lacks to install hvdtrain and build Horovod against its own torch: Horovod 0.28.1's source, the
# wheels of the Python packages such an image does not have (Python 3.12, manylinux x86-64), and a
# wheel of hvdtrain built from this working tree. `make gpu-kit` runs it; launch/gpu-check.sh uses
# the folder there (README, "GPUs and precision").
#
#   launch/gpu-kit.sh [--out DIR]
#
# Environment: PYTHON (the pip to use, default python3), HVDTRAIN_CACHE (downloads are kept in its
# gpu-kit/ folder, default ~/.cache/hvdtrain, and fetched once).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out="$here/.gpu-kit"
python="${PYTHON:-python3}"
cache="${HVDTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain}/gpu-kit"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    *) echo "gpu-kit.sh: unknown option '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done

# The GPU image has torch (CUDA 13), nvidia-nccl-cu13, mpi4py, nvcc, cmake and ninja, and every one
# of hvdtrain's own dependencies (click, PyYAML, tqdm, numpy, scikit-learn, TensorBoard, safetensors,
# matplotlib, psutil, cloudpickle). What it may lack travels: Horovod's build needs setuptools < 81
# (its build and its runner use distutils, which Python 3.12 has only through setuptools) and at
# least 70 (older ones use pkgutil.ImpImporter, which Python 3.12 removed), and wheel,
# its runtime packaging; the gpu tests pytest and pytest-timeout (pyproject's `timeout`).
carried=("setuptools>=70,<81" wheel packaging cffi pycparser pytest pluggy iniconfig pytest-timeout)

say() { printf '[gpu-kit] %s\n' "$*"; }
pip() { "$python" -m pip --disable-pip-version-check -q "$@"; }

# NAME==the version this Python has when it meets SPEC (the kit then carries what the tests here run
# on), else SPEC itself for pip to choose.
pinned() {
  "$python" - "$1" <<'PY'
import sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
wanted = Requirement(sys.argv[1])
try:
    version = metadata.version(wanted.name)
except metadata.PackageNotFoundError:
    version = None
print(f"{wanted.name}=={version}" if version and wanted.specifier.contains(version) else sys.argv[1])
PY
}

mkdir -p "$cache" "$out"
rm -rf "$out/wheels" "$out/sdist"
mkdir -p "$out/wheels" "$out/sdist"

# 1. Horovod's source, fetched once into the cache.
horovod_version="0.28.1"
sdist="$cache/horovod-$horovod_version.tar.gz"
if [ ! -f "$sdist" ]; then
  say "downloading Horovod $horovod_version's source"
  pip download --no-binary :all: --no-deps -d "$cache" "horovod==$horovod_version"
fi
cp "$sdist" "$out/sdist/"

# 2. The carried wheels, for CPython 3.12 (the GPU image's) and this Python on manylinux x86-64: a
# binary wheel (cffi) is kept for each, so the kit also installs here, where its install is tested.
pythons=(3.12)
here_python=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$here_python" = 3.12 ] || pythons+=("$here_python")
fetch() {  # fetch PY DIR SPEC...: the wheels of SPEC... that CPython PY installs, into DIR
  local py="$1" dir="$2"
  shift 2
  pip download --only-binary=:all: --no-deps --python-version "$py" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$dir" "$@"
}
# The cached wheel of NAME VERSION that CPython PY (e.g. 3.12) installs, if any.
cached() {
  find "$cache" -maxdepth 1 \( -name "${1//-/_}-$2-py*-none-any.whl" -o -name "${1//-/_}-$2-cp${3/./}-*.whl" \) | head -n 1
}

specs=()
for spec in "${carried[@]}"; do
  spec=$(pinned "$spec")
  if [ "$spec" = "${spec#*==}" ]; then
    # Not here in a version that fits: the one pip chooses for 3.12, then that version for each Python.
    fresh=$(mktemp -d)
    say "choosing $spec"
    fetch 3.12 "$fresh" "$spec"
    wheel=$(find "$fresh" -name '*.whl' | head -n 1)
    [ -n "$wheel" ] || { echo "gpu-kit.sh: pip fetched no wheel for $spec" >&2; exit 1; }
    IFS=- read -r _ version _ <<<"$(basename "$wheel")"
    mv "$wheel" "$cache/"
    rm -rf "$fresh"
    spec="${spec%%[<>=]*}==$version"
  fi
  specs+=("$spec")
done
for py in "${pythons[@]}"; do
  wanted=()
  for spec in "${specs[@]}"; do
    [ -n "$(cached "${spec%%==*}" "${spec#*==}" "$py")" ] || wanted+=("$spec")
  done
  if [ ${#wanted[@]} -gt 0 ]; then
    say "downloading ${wanted[*]} for Python $py"
    fetch "$py" "$cache" "${wanted[@]}"
  fi
done
for spec in "${specs[@]}"; do
  for py in "${pythons[@]}"; do
    wheel=$(cached "${spec%%==*}" "${spec#*==}" "$py")
    [ -n "$wheel" ] || { echo "gpu-kit.sh: no wheel of $spec for Python $py in $cache" >&2; exit 1; }
    cp "$wheel" "$out/wheels/"
  done
done

# 3. hvdtrain itself, from this working tree.
say "building hvdtrain's wheel"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
# From a copy: setuptools' build/ folder in the tree would keep modules deleted since the last build.
mkdir "$build/src"
tar -C "$here" --exclude=__pycache__ -cf - pyproject.toml README.md hvdtrain | tar -C "$build/src" -xf -
pip wheel --no-deps -w "$build" "$build/src" >"$build/log" 2>&1 || { cat "$build/log" >&2; exit 1; }
cp "$build"/hvdtrain-*.whl "$out/wheels/"

# What gpu-kit-install.sh installs: each wheel by its exact name and version.
for wheel in "$out"/wheels/*.whl; do
  file=$(basename "$wheel")
  IFS=- read -r name version _ <<<"$file"
  echo "$name==$version"
done | sort -u >"$out/requirements.txt"

limit_mib=64  # what travels to the GPU machine beside the working tree
bytes=$(du -sb "$out" | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
say "$out: $(find "$out" -type f | wc -l) files, $mib MiB"
if [ "$bytes" -gt $((limit_mib * 1048576)) ]; then
  echo "gpu-kit.sh: the kit is $mib MiB, over the $limit_mib MiB that can travel to the GPU machine" >&2
  exit 1
fi
