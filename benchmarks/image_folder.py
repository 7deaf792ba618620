"""A generated class-folder image set, and `hvdtrain bench data` on it (part of `make bench`).

Ten classes that a small CNN tells apart: each image a disc or a square of its class's hue (with
some spread) at a random place and size, on a noisy background of a darker, paler tint of it (so
that a random crop still shows the class); JPEG files in
`train/<class>/` and `val/<class>/`, as torchvision's ImageFolder reads them.

    python benchmarks/image_folder.py [--dir /tmp] [--images 4000] [--size 64]

The input pipeline's images/s per worker count, decoding and the device-side augmentation timed
apart; the anchor's way (each image decoded and augmented alone with Pillow in a worker, handed over
as float32) beside it; and a short fit under horovodrun -np 2. They go to benchmarks/image_folder.json;
BENCHMARKS.md states them.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 10


def write_image_folder(top: Path, images: int, size: int, val_share: float = 0.2, seed: int = 0,
                       suffix: str = ".jpg") -> Path:
    """`images` images of `size` x `size` in top/train/<class>/ and top/val/<class>/; returns `top`."""
    from PIL import Image

    generator = np.random.default_rng(seed)
    rows, cols = np.mgrid[0:size, 0:size]
    for index in range(images):
        label = index % CLASSES
        part = "val" if (index // CLASSES) % round(1 / val_share) == 0 else "train"
        folder = top / part / f"class_{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        hue = (label + generator.uniform(-0.2, 0.2)) / CLASSES
        colour = np.array(colorsys.hsv_to_rgb(hue, generator.uniform(0.7, 1), generator.uniform(0.7, 1))) * 255
        tint = np.array(colorsys.hsv_to_rgb(hue, 0.5, generator.uniform(0.2, 0.5))) * 255  # so that any crop shows it
        pixels = tint + generator.normal(0, 25, (size, size, 3))
        radius = generator.uniform(0.3, 0.5) * size
        centre = generator.uniform(radius, size - radius, 2)
        if generator.random() < 0.5:
            inside = (rows - centre[0]) ** 2 + (cols - centre[1]) ** 2 <= radius ** 2
        else:
            inside = (abs(rows - centre[0]) <= radius * 0.8) & (abs(cols - centre[1]) <= radius * 0.8)
        pixels[inside] = colour + generator.normal(0, 12, (int(inside.sum()), 3))
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{index:06d}{suffix}", quality=90)
    return top


MODELS = {"cnn, 16 channels": ["--model", "cnn", "--set", "model.hidden=16"], "resnet18": ["--model", "resnet18"]}


def bench_data(folder: Path, model: list[str], out: Path) -> dict:
    """`hvdtrain bench data` on the folder with `model`: images/s per worker count, augmentation apart."""
    done = subprocess.run([sys.executable, "-m", "hvdtrain", "bench", "data", "--data", str(folder), *model,
                           "--batch-size", "128", "--workers", "0,1,2", "--threads", "1", "--json", str(out)],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"bench data with {model} failed:\n{done.stderr[-3000:]}")
    print(done.stdout, flush=True)
    return json.loads(out.read_text())


class _TransformedOneByOne:
    """The anchor's pipeline (Horovod's pytorch_imagenet_resnet50.py with torchvision's transforms,
    which work on Pillow images): each image decoded, given a random resized crop, a flip and colour
    jitter with Pillow, turned into float32 and normalised on its own in a data-loader worker."""

    def __init__(self, files: list[str], labels: list[int], size: int):
        self.files, self.labels, self.size = files, labels, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple:
        import random

        import torch
        from PIL import Image, ImageEnhance

        with Image.open(self.files[index]) as image:
            image = image.convert("RGB")
        width, height = image.size
        area, ratio = width * height * random.uniform(0.08, 1), math.exp(random.uniform(-0.2877, 0.2877))
        w, h = min(width, round(math.sqrt(area * ratio))), min(height, round(math.sqrt(area / ratio)))
        left, top = random.randint(0, width - w), random.randint(0, height - h)
        image = image.resize((self.size, self.size), Image.BILINEAR, box=(left, top, left + w, top + h))
        if random.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
            image = enhance(image).enhance(random.uniform(0.6, 1.4))
        x = torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div(255)
        mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
        return (x - mean[:, None, None]) / std[:, None, None], self.labels[index]


def one_by_one(folder: Path, workers: list[int], batches: int = 12) -> list[dict]:
    """Images/s of the anchor's way per worker count, for the comparison with hvdtrain's."""
    import time

    import torch
    from torch.utils.data import DataLoader

    from hvdtrain.config import DataConfig
    from hvdtrain.data.sources import build_data

    torch.set_num_threads(1)
    train = build_data(DataConfig(name=str(folder)), 0).train
    one_by_one = _TransformedOneByOne([train.path(i) for i in range(len(train))], train.targets.tolist(),
                                      train.image_shape[-1])
    rows = []
    for count in workers:
        loader = iter(DataLoader(one_by_one, batch_size=128, shuffle=True,
                                 num_workers=count, generator=torch.Generator().manual_seed(0)))
        next(loader)
        started = time.perf_counter()
        for _ in range(batches):
            next(loader)
        rows.append({"workers": count, "samples_per_s": batches * 128 / (time.perf_counter() - started)})
        del loader
    return rows


def fit_np2(folder: Path, run_dir: Path, epochs: int) -> dict:
    """The small CNN on the folder under horovodrun -np 2, one data-loader worker per rank, augmentation
    on: its last epoch's record."""
    launcher = Path(sys.executable).parent / "horovodrun"
    done = subprocess.run([str(launcher), "--gloo", "-np", "2", "hvdtrain", "fit", "--data", str(folder),
                           *MODELS["cnn, 16 channels"], "--optimizer", "adamw", "--lr", "0.003", "--epochs",
                           str(epochs), "--batch-size", "64", "--num-workers", "1", "--threads", "1", "--progress",
                           "off", "--run-dir", str(run_dir)],
                          env={**os.environ, "PATH": f"{launcher.parent}{os.pathsep}{os.environ['PATH']}"},
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"fit on the image folder failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write the images (deleted after)")
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=5, help="epochs of the horovodrun -np 2 fit")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.run import machine

    with tempfile.TemporaryDirectory(dir=args.dir) as top:
        folder = write_image_folder(Path(top) / "images", args.images, args.size)
        results = {name: bench_data(folder, flags, Path(top) / "out.json") for name, flags in MODELS.items()}
        anchor = one_by_one(folder, [0, 1, 2])
        print(f"decoded and augmented one image at a time in the workers, float32: {anchor}", flush=True)
        record = fit_np2(folder, Path(top) / "run", args.epochs)
    fit = {key: record[key] for key in ("epoch", "val_acc", "val_loss", "train_loss", "train_samples_per_s")}
    (ROOT / "benchmarks" / "image_folder.json").write_text(json.dumps(
        {"machine": machine("none"), "images": args.images, "size": args.size, "bench_data": results,
         "one_by_one_in_workers": anchor, "fit_horovodrun_np2_cnn": fit}, indent=2) + "\n")
    print(f"fit, horovodrun --gloo -np 2, cnn, {args.epochs} epochs: {fit}")


if __name__ == "__main__":
    main()
