"""Factories with the exact signatures of what users name most with --model and --data: torchvision's
model functions, timm's `create_model`, and the random data set of PyTorch's DataParallel tutorial,
`RandomDataset(size, length)`. Neither library is needed: the signatures are what is tested."""

import torch
from torch import nn
from torch.utils.data import Dataset


class ResNetLike(nn.Module):
    """Made as torchvision's ResNet is: `num_classes` in __init__, nothing about the input (pooled)."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


def resnet50(*, weights=None, progress=True, **kwargs):
    """torchvision.models.resnet50's signature: its keyword arguments go to the model class."""
    if weights is not None:
        raise ValueError("no pretrained weights in this test")
    return ResNetLike(**kwargs)


class TinyConv(nn.Module):
    """Made as timm's models are: num_classes and in_chans among the class's own arguments."""

    def __init__(self, num_classes: int = 1000, in_chans: int = 3, width: int = 8):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_chans, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.body(x)


MODELS = {"tiny_conv": TinyConv}


def create_model(model_name, pretrained=False, **kwargs):
    """timm.create_model's signature: a model by name, the other keyword arguments to its class."""
    if pretrained:
        raise ValueError("no pretrained weights in this test")
    return MODELS[model_name](**kwargs)


class RandomDataset(Dataset):
    """The tutorial's random vectors of `size` features, `length` of them, with the label its users add
    to train on them (whether the features sum above 0)."""

    classes = ["negative", "positive"]

    def __init__(self, size, length):
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(0))
        self.labels = (self.data.sum(dim=1) > 0).long()

    def __getitem__(self, index):
        return self.data[index], self.labels[index]

    def __len__(self):
        return len(self.data)


def net(input_shape, num_classes, depth):
    """A factory that declares every name it takes, `depth` its own."""
    inner = [module for _ in range(depth - 1) for module in (nn.Linear(16, 16), nn.Tanh())]
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 16), nn.Tanh(), *inner,
                         nn.Linear(16, num_classes))
