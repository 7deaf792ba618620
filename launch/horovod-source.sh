#!/usr/bin/env bash
# Horovod's source as hvdtrain builds it: the sdist (SDIST, or downloaded by pip), unpacked into
# DEST, with the one fix below; prints the source folder. launch/install.sh and
# launch/gpu-horovod-build.sh build their wheels from it.
#
#   launch/horovod-source.sh PYTHON VERSION DEST [SDIST]     (VERSION is not used with SDIST)
#
# The fix: in Horovod 0.28.1 the Gloo context of a process set (the global one included, made at
# every hvd.init) does not take the network interface horovodrun chose (HOROVOD_GLOO_IFACE, from
# --network-interface or its own probe) but binds to the address the host's name resolves to. Where
# that is a loopback address (Debian's and Ubuntu's /etc/hosts give the host's name 127.0.1.1), a job
# across hosts under horovodrun --gloo aborts at start: "connect [127.0.0.1]:PORT: Connection refused".
set -euo pipefail

py="$1" version="$2" dest="$3" sdist="${4:-}"
rm -rf "$dest"
mkdir -p "$dest"
if [ -z "$sdist" ]; then
  "$py" -m pip --disable-pip-version-check download -q --no-deps --no-binary horovod --no-build-isolation \
    -d "$dest" "horovod==$version" >&2
  sdist=$(find "$dest" -maxdepth 1 -name "horovod-$version.tar.gz" | head -n 1)
  [ -n "$sdist" ] || { echo "horovod-source.sh: pip did not download horovod-$version.tar.gz" >&2; exit 1; }
fi
tar -xzf "$sdist" -C "$dest"
src=$(find "$dest" -mindepth 1 -maxdepth 1 -type d -name 'horovod-*' | head -n 1)
[ -n "$src" ] || { echo "horovod-source.sh: $sdist holds no horovod-* folder" >&2; exit 1; }
"$py" - "$src/horovod/common/gloo/gloo_context.cc" <<'PY'
import sys
from pathlib import Path

path = Path(sys.argv[1])
text = path.read_text()
# InitializeForProcessSet: its own gloo_iface_ was never set; the global context's is horovodrun's choice.
unfixed = "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n" \
          "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;"
if text.count(unfixed) != 1:
    sys.exit(f"horovod-source.sh: {path} is not the source this fix was written for")
path.write_text(text.replace(unfixed, "  gloo_iface_ = global_context.gloo_iface_;\n" + unfixed))
PY
echo "$src"
