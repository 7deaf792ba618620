#!/usr/bin/env bash
# The GPU check, on a GPU machine without a network: installs hvdtrain from the kit that
# `make gpu-kit` made (.gpu-kit/, brought along with the working tree) over the machine's own
# torch, builds Horovod with NCCL, runs every GPU step with a time bound, and writes
# OUT_DIR/gpu-report.json, OUT_DIR/gpu-report.md and OUT_DIR/gpu-logs.tar.gz (launch/gpu_check.py).
# Without a GPU each GPU step is skipped with a line. Exit 1 when a step failed.
#
#   launch/gpu-check.sh OUT_DIR
#
# Environment: PYTHON (the interpreter that holds the machine's torch, default python3),
# HVDTRAIN_GPU_KIT (default .gpu-kit), HVDTRAIN_CHECK_SECONDS (the whole check's budget, default
# 560: it ends within 10 minutes), HVDTRAIN_CHECK_WORK (its scratch folder, default
# /tmp/hvdtrain-gpu-check), HVDTRAIN_CHECK_ONLY (comma-separated steps, e.g. throughput: those the
# report shows skipped for lack of time, in a second call).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -eq 1 ] || { echo "usage: launch/gpu-check.sh OUT_DIR" >&2; exit 2; }
python="${PYTHON:-python3}"
exec "$python" "$here/launch/gpu_check.py" --out "$1" --python "$python" \
  --kit "${HVDTRAIN_GPU_KIT:-$here/.gpu-kit}" --seconds "${HVDTRAIN_CHECK_SECONDS:-560}" \
  --work "${HVDTRAIN_CHECK_WORK:-/tmp/hvdtrain-gpu-check}" --only "${HVDTRAIN_CHECK_ONLY:-}"
