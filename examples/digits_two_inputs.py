"""A model with two named inputs and a task of one's own: dict samples, a custom loss,
and a metric that is a vector of sums (per-class recall, averaged: balanced accuracy).

    PYTHONPATH=examples horovodrun -np 2 hvdtrain fit --data digits_two_inputs:data \
        --model digits_two_inputs:model --task digits_two_inputs:BalancedDigits --epochs 15

Each sample is {"image": 1x8x8, "profile": the 16 row and column ink totals, "labels"}.
The model's forward takes `image` and `profile` by name; hvdtrain passes every key of a
dict batch but the target key. The task weighs each sample by how rare its class is in
the training set (Horovod's TorchEstimator calls this a sample weight) and reports
accuracy and balanced accuracy as (sum, count) pairs, which every rank sums exactly.
"""

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

CLASSES = 10


class TwoViews(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels
        self.profiles = torch.cat([images.sum(dim=3).flatten(1), images.sum(dim=2).flatten(1)], dim=1) / 8

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"image": self.images[index], "profile": self.profiles[index], "labels": self.labels[index]}


def data():
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(labels)))
    val, train = order[:360], order[360:]
    return TwoViews(images[train], labels[train]), TwoViews(images[val], labels[val])


class TwoInputNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                   nn.Linear(16 * 4 * 4, 64), nn.ReLU())
        self.profile = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(64 + 32, CLASSES)

    def forward(self, image, profile):
        return self.head(torch.cat([self.image(image), self.profile(profile)], dim=1))


def model():
    return TwoInputNet()


class BalancedDigits:
    """Class-weighted cross-entropy; accuracy and balanced accuracy."""

    maximize = ("acc", "balanced_acc")  # better when higher; any other metric when lower
    primary = "balanced_acc"  # what run.best_metric auto keeps best.pt by

    def __init__(self):
        counts = torch.bincount(data()[0].labels, minlength=CLASSES).float()
        self.weights = counts.sum() / (CLASSES * counts)  # rare classes weigh more

    def loss(self, output, target):
        return F.cross_entropy(output, target, weight=self.weights.to(output.device))

    def metrics(self, output, target):
        correct = (output.argmax(dim=1) == target).float()
        per_class = F.one_hot(target, CLASSES).float()  # (batch, classes)
        return {
            "acc": (correct.sum(), len(target)),
            # Vectors of sums: per-class correct over per-class count, averaged over classes.
            "balanced_acc": (per_class.T @ correct, per_class.sum(dim=0)),
        }
