#!/usr/bin/env bash
# Plain Open MPI, with the flags Horovod recommends. Arguments go to `hvdtrain fit`.
#
#   NP=8 HOSTFILE=hosts.txt launch/run-mpirun.sh --config run.yaml
#
# hosts.txt in Open MPI's format: `gpu-node-1 slots=4` per line (hostfile.example fits).
# --bind-to none: each rank sets its own thread count; binding to one core would starve them.
# --map-by slot: consecutive ranks fill a host before the next, so local ranks match GPUs.
# -x: pass the environment the ranks need to every host.
set -euo pipefail
# shellcheck source=launch/require.sh
source "$(dirname "$0")/require.sh"
require mpirun hvdtrain
args=(-np "${NP:-2}" --bind-to none --map-by slot
      -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x NCCL_DEBUG -x CUDA_VISIBLE_DEVICES
      -mca pml ob1 -mca btl ^openib)
[ -n "${HOSTFILE:-}" ] && args+=(--hostfile "$HOSTFILE")
[ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
[ "${OVERSUBSCRIBE:-0}" = 1 ] && args+=(--oversubscribe)
exec mpirun "${args[@]}" hvdtrain fit "$@"
