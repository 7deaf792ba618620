"""The one job every contender in `make bench` trains: the same model, data and batch.

A small CNN (about 2.1 M parameters, most in its first linear layer) on synthetic
28x28 images, 64 samples per process per step.
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

BATCH = 64
TRAIN_SAMPLES = 64 * 2 * 40  # 40 steps per epoch at 2 processes
CLASSES = 10


def small_cnn(input_shape=(1, 28, 28), num_classes=CLASSES):
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (input_shape[1] // 4) * (input_shape[2] // 4), 640), nn.ReLU(),
        nn.Linear(640, num_classes),
    )


def synthetic():
    """(train, val) in memory; labels from a fixed rule so the loss can fall."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TRAIN_SAMPLES + 512, 1, 28, 28, generator=generator)
    y = (x[:, 0, :14].mean(dim=(1, 2)) * 40).long().clamp(-5, 4) + 5
    return TensorDataset(x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES]), TensorDataset(x[TRAIN_SAMPLES:], y[TRAIN_SAMPLES:])


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
