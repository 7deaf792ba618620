"""`hvdtrain bench data` on each kind of data source, side by side on one machine: the input
pipeline's samples/s with 0 and 2 data-loader workers beside the training step's, for the same
256 000 samples of 64 float32 features (a 10-class linear teacher's labels) as an `.npz` file, a
memory-mapped `.npy` directory, a Hugging Face `save_to_disk` directory, tar shards of `.npy`
members and a user's IterableDataset; the same number of 64-token windows as a token file; and
32 000 PNG images (32x32 RGB) in tar shards, where decoding is the work.

    python benchmarks/data_sources.py [--dir /tmp]

The tables go to benchmarks/data_sources.json and BENCHMARKS.md states them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.run import environment, machine  # noqa: E402

SAMPLES, FEATURES, CONTEXT, IMAGES, PER_SHARD = 256_000, 64, 64, 32_000, 8_000


def _features() -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(0)
    x = generator.standard_normal((SAMPLES, FEATURES), dtype=np.float32)
    return x, (x @ generator.standard_normal((FEATURES, 10), dtype=np.float32)).argmax(axis=1)


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def write_sources(top: Path) -> dict[str, tuple[str, list[str]]]:
    """Each source: (the --data value, further flags)."""
    import datasets
    from PIL import Image

    x, y = _features()
    np.savez(top / "data.npz", x=x, y=y)
    (top / "arrays").mkdir()
    np.save(top / "arrays" / "x.npy", x)
    np.save(top / "arrays" / "y.npy", y)
    datasets.Dataset.from_dict({"x": x, "label": y}).save_to_disk(str(top / "hf"))
    (top / "shards").mkdir()
    for shard in range(SAMPLES // (PER_SHARD * 4)):
        with tarfile.open(top / "shards" / f"part-{shard:03d}.tar", "w") as tar:
            for i in range(shard * PER_SHARD * 4, (shard + 1) * PER_SHARD * 4):
                _member(tar, f"{i:07d}.npy", _npy_bytes(x[i]))
                _member(tar, f"{i:07d}.cls", str(int(y[i])).encode())
    (((np.arange(SAMPLES * CONTEXT) * 7) % 64).astype(np.uint16)).tofile(top / "tokens.bin")
    (top / "images").mkdir()
    generator = np.random.default_rng(1)
    for shard in range(IMAGES // PER_SHARD):
        with tarfile.open(top / "images" / f"part-{shard:03d}.tar", "w") as tar:
            for i in range(shard * PER_SHARD, (shard + 1) * PER_SHARD):
                png = io.BytesIO()
                Image.fromarray(generator.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(png, format="PNG")
                _member(tar, f"{i:07d}.png", png.getvalue())
                _member(tar, f"{i:07d}.cls", str(i % 10).encode())
    (top / "stream_source.py").write_text(
        "import numpy as np, torch\n"
        "class Rows(torch.utils.data.IterableDataset):\n"
        "    classes = list(range(10))\n"
        f"    def __init__(self): self.x, self.y = np.load('{top}/arrays/x.npy', mmap_mode='r'), "
        f"np.load('{top}/arrays/y.npy')\n"
        "    def __len__(self): return len(self.y)\n"
        "    def __iter__(self):\n"
        "        for i in range(len(self.y)): yield torch.from_numpy(np.array(self.x[i])), int(self.y[i])\n"
        "def rows(): return Rows()\n")
    return {
        ".npz file (in memory)": (str(top / "data.npz"), []),
        ".npy directory (memory-mapped)": (str(top / "arrays"), []),
        "Hugging Face save_to_disk": (str(top / "hf"), ["--set", "data.input_columns=x"]),
        "tar shards of .npy": (str(top / "shards"), []),
        "IterableDataset (yields rows of the .npy)": ("stream_source:rows", []),
        "token file, 64-token windows": (str(top / "tokens.bin"), [
            "--task", "language-model", "--set", f"data.context={CONTEXT}", "--set", "data.num_classes=64",
            "--model", "benchmarks.jobs:token_bigram"]),
        "tar shards of 32x32 PNG images": (str(top / "images"), ["--model", "cnn"]),
    }


def bench(data: str, flags: list[str], top: Path) -> dict:
    env = {**environment({}), "PYTHONPATH": f"{ROOT}{os.pathsep}{top}"}
    done = subprocess.run([sys.executable, "-m", "hvdtrain", "bench", "data", "--data", data, "--batch-size", "256",
                           "--workers", "0,2", "--threads", "1", *flags, "--json", str(top / "out.json")],
                          env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"bench data on {data} failed:\n{done.stderr[-3000:]}")
    print(done.stdout, flush=True)
    return json.loads((top / "out.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write the data (deleted after)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        top = Path(folder)
        results = {name: bench(data, flags, top) for name, (data, flags) in write_sources(top).items()}
    (ROOT / "benchmarks" / "data_sources.json").write_text(
        json.dumps({"machine": machine("none"), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
