#!/usr/bin/env bash
# Writes hvdtrain's entries for the launchers beside PYTHON (its environment's bin/): Horovod's
# `horovodrun` and torch's `torchrun`, which run the launchers unchanged but report a failed worker
# in one line (hvdtrain/cli/launchers.py). Used by launch/install.sh and launch/gpu-kit-install.sh.
#
#   launch/launcher-entries.sh PYTHON torchrun [horovodrun]
set -euo pipefail

py="$1"
shift
bin_dir=$(dirname "$py")
for launcher in "$@"; do
  case "$launcher" in torchrun|horovodrun) ;; *) echo "launcher-entries.sh: no entry for '$launcher'" >&2; exit 2 ;; esac
  cat >"$bin_dir/$launcher" <<SH
#!$py
from hvdtrain.cli.launchers import $launcher
if __name__ == "__main__":  # Horovod's runner spawns processes that re-import this file
    $launcher()
SH
  chmod +x "$bin_dir/$launcher"
done
