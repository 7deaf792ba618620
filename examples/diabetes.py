"""Regression: scikit-learn's diabetes data (442 patients, 10 measurements each, a disease
progression score to predict; it ships inside scikit-learn's wheel, nothing is downloaded).

    PYTHONPATH=examples horovodrun -np 2 hvdtrain fit --task regression --data diabetes:data \
        --model mlp --set model.hidden=32 --optimizer adamw --lr 0.002 --batch-size 16 --epochs 20

A data factory is all a regression needs: float targets, the built-in MLP (it gets one
output per target value from the task), and `--task regression` for MSE training with
MSE, MAE and R² reported on the validation set. Features and targets are standardized
with the training part's statistics, so the MSE is in units of the target's variance.
"""

import numpy as np
import torch
from sklearn.datasets import load_diabetes
from torch.utils.data import TensorDataset

VALIDATION = 88  # patients held out (a fifth)


def data():
    """(train, val) TensorDatasets of (features, score); the same split on every rank."""
    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    val, train = order[:VALIDATION], order[VALIDATION:]
    x = (x - x[train].mean(axis=0)) / x[train].std(axis=0)
    y = (y - y[train].mean()) / y[train].std()

    def part(rows):
        return TensorDataset(torch.tensor(x[rows], dtype=torch.float32), torch.tensor(y[rows], dtype=torch.float32))

    return part(train), part(val)
