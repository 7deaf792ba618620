#!/usr/bin/env bash
# Host discovery for elastic training: prints the hosts usable now, one "host:slots" per
# line, as `horovodrun --host-discovery-script` wants. horovodrun runs it every second.
#
#   HOSTFILE=hosts.txt horovodrun --gloo -np 4 --min-np 2 --max-np 8 \
#       --host-discovery-script launch/discover-hosts.sh hvdtrain fit --elastic
#
# HOSTFILE has horovodrun's hostfile format ("gpu-node-1 slots=4"; # comments). Edit it
# while the job runs: a host added there gets workers, a host removed loses them.
# On a cluster, replace the file with what the scheduler knows (e.g. `scontrol show hostnames`).
set -euo pipefail
hostfile="${HOSTFILE:-launch/hostfile.example}"
awk '!/^[[:space:]]*(#|$)/ {
  slots = 1
  for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) { split($i, s, "="); slots = s[2] }
  print $1 ":" slots
}' "$hostfile"
