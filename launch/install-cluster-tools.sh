#!/usr/bin/env bash
# The tools the system tests run for real: a one-node Slurm cluster (slurmd, slurmctld,
# munge) and container image builds (buildah, podman, debootstrap for a local base
# image). Debian packages, installed when we are root and they are missing; quick when
# they are there. Without root or apt the system tests are skipped and say why.
#
#   launch/install-cluster-tools.sh
set -euo pipefail

say() { printf '[cluster-tools] %s\n' "$*"; }
slurm=(slurmd slurmctld munge slurm-client)
containers=(buildah podman debootstrap fuse-overlayfs uidmap slirp4netns runc)
needed=()
command -v slurmctld >/dev/null || [ -x /usr/sbin/slurmctld ] || needed+=("${slurm[@]}")
command -v buildah >/dev/null && command -v podman >/dev/null && command -v runc >/dev/null \
  && { command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ]; } || needed+=("${containers[@]}")
if [ ${#needed[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  say "not installing ${needed[*]} (needs root and apt-get): the Slurm and image tests will be skipped"
  exit 0
fi
say "installing ${needed[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends "${needed[@]}" >/dev/null \
  || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${needed[@]}" >/dev/null; }
