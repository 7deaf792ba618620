#!/usr/bin/env bash
# Installs hvdtrain from the GPU kit (launch/gpu-kit.sh), offline, into VENV: a virtual environment
# over the Python that already holds torch, which sees that Python's packages (its torch, CUDA and
# NCCL included) and adds the kit's, so that nothing of that Python's own is touched.
#
#   launch/gpu-kit-install.sh VENV [--kit DIR]
#
# Environment: PYTHON (the interpreter with torch, default python3). Ends with VENV/bin holding
# hvdtrain and the launcher entries (torchrun; horovodrun once Horovod is there:
# launch/gpu-horovod-build.sh).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python="${PYTHON:-python3}"
kit="$here/.gpu-kit"
venv="${1:-}"
[ -n "$venv" ] || { echo "usage: launch/gpu-kit-install.sh VENV [--kit DIR]" >&2; exit 2; }
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --kit) kit="$2"; shift 2 ;;
    *) echo "gpu-kit-install.sh: unknown option '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
[ -f "$kit/requirements.txt" ] || { echo "gpu-kit-install.sh: no kit at $kit: run make gpu-kit where there is a network" >&2; exit 2; }
"$python" -c 'import torch' 2>/dev/null \
  || { echo "gpu-kit-install.sh: $python has no torch: set PYTHON to the interpreter that holds the machine's torch" >&2; exit 2; }

# The folders that Python imports packages from; a venv made from a venv sees only the base
# interpreter's, so each is added back by a .pth line (site.addsitedir also reads their .pth files).
sites=$("$python" -c 'import os, sys; print("\n".join(dict.fromkeys(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p))))')
"$python" -m venv --without-pip --clear "$venv"  # pip is the base's: the venv imports it from there
py="$venv/bin/python"
own=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
while IFS= read -r site; do
  [ -n "$site" ] && printf 'import site; site.addsitedir(%s)\n' "'$site'"
done <<<"$sites" >"$own/hvdtrain-base-python.pth"

# --ignore-installed: the kit's copies go into the venv, in front of the base's, which stay as they are.
"$py" -m pip --disable-pip-version-check -q install --no-index --find-links "$kit/wheels" --no-deps \
  --ignore-installed -r "$kit/requirements.txt"
bash "$here/launch/launcher-entries.sh" "$py" torchrun

# Every dependency of hvdtrain must be met by the base or the kit.
"$py" - <<'PY'
import sys
from importlib import metadata

from packaging.requirements import Requirement

missing = []
for line in metadata.requires("hvdtrain") or []:
    need = Requirement(line)
    if need.marker is not None and not need.marker.evaluate({"extra": ""}):
        continue  # an extra's
    try:
        have = metadata.version(need.name)
    except metadata.PackageNotFoundError:
        missing.append(f"{need} (absent)")
        continue
    if not need.specifier.contains(have, prereleases=True):
        missing.append(f"{need} (found {have})")
if missing:
    sys.exit("gpu-kit-install.sh: this Python lacks what hvdtrain needs and the kit does not carry: "
             f"{', '.join(missing)}; add it to `carried` in launch/gpu-kit.sh")
PY
echo "[gpu-kit] installed into $venv: $("$py" -c 'import hvdtrain, torch; print(f"hvdtrain {hvdtrain.__version__} over torch {torch.__version__}")')"
