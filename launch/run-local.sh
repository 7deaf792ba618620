#!/usr/bin/env bash
# One host, one process per GPU (or NP processes on the CPU). Arguments go to `hvdtrain fit`.
#
#   launch/run-local.sh --config run.yaml            # NP defaults to the GPU count, else 2
#   NP=4 launch/run-local.sh --epochs 30
set -euo pipefail
# shellcheck source=launch/require.sh
source "$(dirname "$0")/require.sh"
require horovodrun hvdtrain
if [ -z "${NP:-}" ]; then
  NP=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  [ "${NP:-0}" -gt 0 ] || NP=2
fi
exec horovodrun -np "$NP" hvdtrain fit "$@"
