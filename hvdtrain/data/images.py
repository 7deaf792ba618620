"""Images in class folders, laid out as torchvision's `ImageFolder` reads them: `DIR/train/<class>/*`
and `DIR/val/<class>/*`, or `DIR/<class>/*` with a held-out part. The classes are the folder names
sorted, and each folder's images are taken in sorted order, so that a model trained here and one
trained with torchvision agree on what label 3 means.

An image is decoded with Pillow where it is loaded (in a data-loader worker), to a fixed size when
`data.image_size` asks for one, and stays uint8 (channels, height, width): batches reach the device
in a quarter of float32's bytes, and hvdtrain.data.augment converts them there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hvdtrain.data.mapped import split as strided_split
from hvdtrain.errors import UserError

EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision ImageFolder's (its IMG_EXTENSIONS), any case: a folder it reads is read whole here too."""
OTHER_KINDS = ("x.npy", "dataset_info.json", "dataset_dict.json")
"""Files that make a directory another kind of data set (memory-mapped arrays, Hugging Face data)."""


def is_image_folder(name: str) -> bool:
    """A directory of class folders (or of `train/` and `val/` holding them), or one with nothing in
    it: the error for an empty one then speaks of images. Asked before the other directory kinds."""
    path = Path(name)
    if not path.is_dir() or any((path / marker).exists() or (path / "train" / marker).exists()
                                for marker in OTHER_KINDS):
        return False
    root = path / "train" if (path / "train").is_dir() else path
    with os.scandir(root) as entries:
        names = [(entry.name, entry.is_dir()) for entry in entries]
    if any(name.endswith(".tar") for name, _ in names):
        return False
    return any(is_dir for _, is_dir in names) or not names


class PathTable:
    """File names as one byte buffer and offsets: a million of them cost no Python objects, which a
    data-loader worker would copy page by page as it touched their reference counts."""

    def __init__(self, names: list[str]):
        encoded = [name.encode() for name in names]
        self.offsets = np.cumsum([0] + [len(item) for item in encoded], dtype=np.int64)
        self.buffer = np.frombuffer(b"".join(encoded), dtype=np.uint8) if encoded else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> str:
        return self.buffer[self.offsets[index]:self.offsets[index + 1]].tobytes().decode()


def class_folders(root: Path) -> list[str]:
    """The class folders' names, sorted as torchvision sorts them; one line when there are none."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise UserError(f"data directory '{root}' holds no class folders: put each class's images in a folder of "
                        f"its own ({root}/<class>/*.jpg), with train/ and val/ above them or a held-out part")
    return classes


def list_images(root: Path, classes: list[str], part: str) -> tuple[list[str], np.ndarray]:
    """Every image under each class folder of `root/part` (sub-folders too), relative to `root`, and
    its label."""
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        found = [os.path.relpath(os.path.join(folder, file), root)
                 for folder, _, names in sorted(os.walk(root / part / name, followlinks=True))
                 for file in sorted(names) if file.lower().endswith(EXTENSIONS)]
        if not found:
            raise UserError(f"class folder '{root / part / name}' holds no images ({', '.join(EXTENSIONS)}): add "
                            "its images or remove the folder (every folder is a class)")
        files += found
        labels += [label] * len(found)
    return files, np.asarray(labels, dtype=np.int64)


def decode(path: str, size: int | None, expected: tuple[int, int] | None = None) -> torch.Tensor:
    """One image as uint8 (3, height, width): RGB whatever it was stored as; with `size`, its shorter
    side scaled to `size` and the centre square cut (JPEGs decoded at a reduced scale first, which
    Pillow does in the decoder); without, as stored, and then it must be `expected` (height, width)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            if size is not None:
                image.draft("RGB", (size, size))  # JPEG: decode at the smallest scale still >= size
            image = image.convert("RGB")
            if size is not None:
                width, height = image.size
                side = min(width, height)
                box = ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)
                image = image.resize((size, size), Image.BILINEAR, box=box)
            pixels = np.array(image)
    except (OSError, ValueError, SyntaxError) as err:  # Pillow's errors for unreadable and truncated files
        raise UserError(f"image '{path}' does not decode ({err}): replace it or remove it") from err
    if expected is not None and pixels.shape[:2] != expected:
        raise UserError(f"image '{path}' is {pixels.shape[1]}x{pixels.shape[0]}, the first image "
                        f"{expected[1]}x{expected[0]}: images of several sizes need a size to decode them to: "
                        "set data.image_size (--set data.image_size=224)")
    return torch.from_numpy(pixels).permute(2, 0, 1)


class ImageFiles(Dataset):
    """Samples (uint8 image, label) of one part of a class-folder tree: the images at `indices` of
    the tree's listing. `on_device` is what the batches need on the device before the model sees them
    (hvdtrain.data.augment), set by the source."""

    def __init__(self, tree: "ImageTree", indices: np.ndarray, size: int | None):
        self.tree, self.indices, self.size = tree, indices, size
        self.classes = tree.classes
        self.on_device: Any = None
        self.image_shape = tree.image_shape(size)
        """(channels, height, width) of every image: the tree's first image's."""

    def __len__(self) -> int:
        return len(self.indices)

    def file(self, index: int) -> str:
        """The sample's file, relative to the data directory (what predictions name)."""
        return self.tree.files[int(self.indices[index])]

    def path(self, index: int) -> str:
        return os.path.join(self.tree.root, self.file(index))

    @property
    def targets(self) -> torch.Tensor:
        """Every label of the part, for the label checks."""
        return torch.from_numpy(self.tree.labels[self.indices])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        expected = None if self.size is not None else self.image_shape[1:]
        return decode(self.path(index), self.size, expected), int(self.tree.labels[self.indices[index]])


class ImageTree:
    """The listing of a class-folder tree: its classes, every image (train/'s before val/'s) with its
    label, and how many of them are val/'s (None: no val/ folder, a part is held out)."""

    def __init__(self, directory: Path):
        if not directory.is_dir():
            raise UserError(f"data directory '{directory}' does not exist: check data.name (--data)")
        if not any(directory.iterdir()):
            raise UserError(f"data directory '{directory}' is empty: give class folders of images "
                            f"({directory}/train/<class>/*.jpg and val/, or {directory}/<class>/*.jpg)")
        self.root = str(directory)
        has_train, has_val = (directory / "train").is_dir(), (directory / "val").is_dir()
        if has_val and not has_train:
            raise UserError(f"data directory '{directory}' has a val/ folder but no train/: give train/ and val/ of "
                            "class folders, or the class folders themselves (a part of them is held out)")
        self.classes = class_folders(directory / "train" if has_train else directory)
        self.val_count: int | None = None
        if has_val and (found := class_folders(directory / "val")) != self.classes:
            missing, extra = sorted(set(self.classes) - set(found)), sorted(set(found) - set(self.classes))
            raise UserError(f"data directory '{directory}': val/ holds other classes than train/ (missing from val/: "
                            f"{', '.join(missing[:5]) or 'none'}; only in val/: {', '.join(extra[:5]) or 'none'}): "
                            "both must hold the same class folders, or their labels would differ")
        files, labels = list_images(directory, self.classes, "train" if has_train else "")
        if has_val:
            val_files, val_labels = list_images(directory, self.classes, "val")
            files, labels, self.val_count = files + val_files, np.concatenate([labels, val_labels]), len(val_files)
        self.files, self.labels = PathTable(files), labels
        self._shapes: dict[int | None, tuple[int, ...]] = {}

    def image_shape(self, size: int | None) -> tuple[int, ...]:
        if size not in self._shapes:
            self._shapes[size] = tuple(decode(os.path.join(self.root, self.files[0]), size).shape)
        return self._shapes[size]

    def parts(self, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """The train and val images' indices: val/'s own, or every `1/val_fraction`-th image held out
        (which keeps the classes' shares, the images being listed class by class)."""
        every = np.arange(len(self.files))
        if self.val_count is not None:
            return every[:len(every) - self.val_count], every[len(every) - self.val_count:]
        step = strided_split(len(every), val_fraction)[1].every  # its checks: enough images, a fraction it can hold
        held = every % step == step - 1
        return every[~held], every[held]


def image_parts(directory: Path, val_fraction: float, size: int | None) -> tuple[ImageFiles, ImageFiles]:
    tree = ImageTree(directory)
    train, val = tree.parts(val_fraction)
    return ImageFiles(tree, train, size), ImageFiles(tree, val, size)


def whole(directory: Path, size: int | None) -> ImageFiles:
    """Every image, train/'s before val/'s, each in its sorted order."""
    tree = ImageTree(directory)
    return ImageFiles(tree, np.arange(len(tree.files)), size)
