#!/usr/bin/env bash
# The tools the system tests run for real: a one-node Slurm cluster (slurmd, slurmctld,
# munge), container image builds (buildah, podman, debootstrap for a local base
# image, the CNI plugins for podman's networks) and two hosts joined by a throttled link
# (iproute2: network namespaces, a veth pair, tc). Debian packages, installed when we are
# root and one is missing; quick when all are there. Each package is checked on its own
# (dpkg), not by one command standing for the rest: a machine with podman but without,
# say, its network plugins gets them. Without root or apt the system tests are skipped
# and say why.
#
#   launch/install-cluster-tools.sh
set -euo pipefail

say() { printf '[cluster-tools] %s\n' "$*"; }
packages=(
  slurmd slurmctld munge slurm-client
  buildah podman runc debootstrap fuse-overlayfs uidmap slirp4netns containernetworking-plugins
  iproute2
)
installed() { [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ]; }
needed=()
for package in "${packages[@]}"; do
  installed "$package" || needed+=("$package")
done
if [ ${#needed[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  say "not installing ${needed[*]} (needs root and apt-get): the Slurm, image and two-host tests will be skipped"
  exit 0
fi
say "installing ${needed[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends "${needed[@]}" >/dev/null \
  || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${needed[@]}" >/dev/null; }
for package in "${needed[@]}"; do
  installed "$package" || { echo "install-cluster-tools.sh: $package did not install" >&2; exit 1; }
done
