"""The jobs every contender in `make bench` trains: the same model, data and batch.

- `linear`: a small CNN (about 2.1 M parameters, most in its first linear layer) on
  synthetic 1x28x28 images. Little compute per parameter: the gradient allreduce
  (8 MB per step) weighs on it.
- `conv`: a convolution-heavy net (0.13 M parameters) on synthetic 3x32x32 images.
  Much compute per parameter: the allreduce (0.5 MB per step) hardly shows.

64 samples per process per step; `BENCH_STEPS` (steps per epoch at 2 processes) shrinks
an epoch for tests.
"""

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

BATCH = 64
VAL_SAMPLES = 512
CLASSES = 10


def small_cnn(input_shape=(1, 28, 28), num_classes=CLASSES):
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (input_shape[1] // 4) * (input_shape[2] // 4), 640), nn.ReLU(),
        nn.Linear(640, num_classes),
    )


def conv_net(input_shape=(3, 32, 32), num_classes=CLASSES):
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(128, num_classes),
    )


def _images(shape, steps):
    """(train, val) in memory, `steps` steps per epoch at 2 processes; labels from a fixed
    rule so the loss can fall."""
    train_samples = BATCH * 2 * int(os.environ.get("BENCH_STEPS", steps))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(train_samples + VAL_SAMPLES, *shape, generator=generator)
    y = (x[:, 0, : shape[1] // 2].mean(dim=(1, 2)) * 40).long().clamp(-5, 4) + 5
    return TensorDataset(x[:train_samples], y[:train_samples]), TensorDataset(x[train_samples:], y[train_samples:])


def synthetic():
    return _images((1, 28, 28), steps=40)


def synthetic_rgb():
    return _images((3, 32, 32), steps=20)  # a step takes about twice the linear job's


# job name -> (model factory, data factory), as `hvdtrain fit --model/--data` name them
JOBS = {
    "linear": ("small_cnn", "synthetic"),
    "conv": ("conv_net", "synthetic_rgb"),
}


def build(job: str):
    """(model, train set) of a job, for the hand-written contenders."""
    model_name, data_name = JOBS[job]
    return globals()[model_name](), globals()[data_name]()[0]


def timed_epochs(model, optimizer, loader, epochs, samples_per_epoch, sampler=None):
    """The peers' common loop: samples/s over every epoch but the first (warm-up)."""
    import time

    import torch.nn.functional as F

    timed_samples, timed_seconds = 0, 0.0
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        start = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        if epoch > 0:
            timed_seconds += time.perf_counter() - start
            timed_samples += samples_per_epoch
    return timed_samples / timed_seconds


def token_bigram(input_shape=None, num_classes=64):
    """A bigram language model for benchmarks/large_data.py: token ids in, next-token logits out."""
    return nn.Sequential(nn.Embedding(num_classes, 32), nn.Linear(32, num_classes))
