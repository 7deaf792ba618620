#!/usr/bin/env bash
# Several hosts through horovodrun and SSH. Arguments go to `hvdtrain fit`.
#
#   HOSTFILE=launch/hostfile.example launch/run-hosts.sh --config run.yaml
#   HOSTS=host1:4,host2:4 launch/run-hosts.sh --config run.yaml
#
# Needs passwordless SSH from this host to every host, and hvdtrain installed at the
# same path on each (the Docker image gives both). NP defaults to the sum of the slots.
set -euo pipefail
# shellcheck source=launch/require.sh
source "$(dirname "$0")/require.sh"
require horovodrun hvdtrain
if [ -n "${HOSTS:-}" ]; then
  hosts=(-H "$HOSTS")
  slots=$(tr ',' '\n' <<<"$HOSTS" | awk -F: '{ n += ($2 == "" ? 1 : $2) } END { print n }')
else
  hostfile="${HOSTFILE:-launch/hostfile.example}"
  hosts=(--hostfile "$hostfile")
  slots=$(awk '/slots=/ { split($2, s, "="); n += s[2] } END { print n }' "$hostfile")
fi
exec horovodrun -np "${NP:-$slots}" "${hosts[@]}" ${SSH_PORT:+--ssh-port "$SSH_PORT"} hvdtrain fit "$@"
