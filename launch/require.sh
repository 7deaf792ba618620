# Sourced by the launch scripts: `require CMD...` stops with one line when a command is missing.
# shellcheck shell=bash
require() {
  local command
  for command in "$@"; do
    if ! command -v "$command" >/dev/null 2>&1; then
      echo "$(basename "$0"): error: '$command' is not on PATH: run 'make install' (or launch/install.sh)" \
           "and 'source .venv/bin/activate', or use the Docker image" >&2
      exit 2
    fi
  done
}
