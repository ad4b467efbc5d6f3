"""The baseline every speed figure is measured against: PyTorch DataLoader + PIL + torchvision's
default transforms.

Real torchvision is used where it is installed; where it is not, an exact re-implementation of the
transforms below (same sampling code on torch's RNG, same PIL calls; a test compares the two bit for
bit wherever torchvision is installed). torchvision is never required.

    loader = baseline_loader("data/train", 256, workers=2)    # a torch DataLoader
    for images, labels in loader:    # images: float32 [B, 3, 224, 224], normalized
        ...
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .tvimport import import_torchvision
from .tvimport import status as tv_status

__all__ = ["baseline_loader", "baseline_transform", "list_image_folder"]


def _torchvision() -> Any | None:
    """torchvision.transforms, also from a torchvision built for another torch (`tvimport`), or None."""
    if import_torchvision() is None:  # optional: `pip install torchvision`
        return None
    from torchvision import transforms
    return transforms


class _TVRandomResizedCrop:
    """torchvision.transforms.RandomResizedCrop on PIL images, same sampling (torch's RNG, 10 tries,
    central-crop fallback) and PIL BILINEAR resize (PIL's resize is always antialiased)."""

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size, self.scale, self.ratio = (size, size), scale, ratio

    def get_params(self, width: int, height: int) -> tuple[int, int, int, int]:
        import torch

        area = height * width
        log_ratio = torch.log(torch.tensor(self.ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                i = int(torch.randint(0, height - h + 1, size=(1,)).item())
                j = int(torch.randint(0, width - w + 1, size=(1,)).item())
                return i, j, h, w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Any) -> Any:
        from PIL import Image

        i, j, h, w = self.get_params(*img.size)
        return img.crop((j, i, j + w, i + h)).resize((self.size[1], self.size[0]), Image.BILINEAR)


class _TVResize:
    """torchvision.transforms.Resize(int) on PIL: shorter side to `size`, longer side truncated."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: Any) -> Any:
        from PIL import Image

        w, h = img.size
        short, long_ = (w, h) if w <= h else (h, w)
        new_short, new_long = self.size, int(self.size * long_ / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        return img.resize((new_w, new_h), Image.BILINEAR)


class _TVCenterCrop:
    """torchvision.transforms.CenterCrop on PIL (images at least `size`; PIL pads with zeros otherwise)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: Any) -> Any:
        w, h = img.size
        top, left = int(round((h - self.size) / 2.0)), int(round((w - self.size) / 2.0))
        return img.crop((left, top, left + self.size, top + self.size))


def _tv_flip(img: Any) -> Any:
    """torchvision.transforms.RandomHorizontalFlip(0.5): torch's RNG decides."""
    import torch
    from PIL import Image

    return img.transpose(Image.FLIP_LEFT_RIGHT) if torch.rand(1).item() < 0.5 else img


def _tv_to_normalized_tensor(img: Any) -> Any:
    """ToTensor (HWC uint8 -> CHW float32 in [0, 1]) then Normalize with ImageNet mean/std."""
    import torch

    from .._tensors import IMAGENET_MEAN, IMAGENET_STD

    t = torch.from_numpy(np.array(img, np.uint8, copy=True)).view(img.size[1], img.size[0], 3)
    t = t.permute((2, 0, 1)).contiguous().to(dtype=torch.float32).div(255)
    mean = torch.as_tensor(IMAGENET_MEAN, dtype=t.dtype)[:, None, None]
    std = torch.as_tensor(IMAGENET_STD, dtype=t.dtype)[:, None, None]
    return t.sub_(mean).div_(std)


def baseline_transform(train: bool) -> tuple[Callable[[Any], Any], str]:
    """The baseline's transform on a PIL image and which implementation it is."""
    from .._tensors import IMAGENET_MEAN, IMAGENET_STD

    tv = _torchvision()
    if tv is not None:
        import torchvision
        norm = [tv.ToTensor(), tv.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        ops = [tv.RandomResizedCrop(224), tv.RandomHorizontalFlip()] if train else [tv.Resize(256), tv.CenterCrop(224)]
        return tv.Compose(ops + norm), f"torchvision {torchvision.__version__}"
    ops = [_TVRandomResizedCrop(224), _tv_flip] if train else [_TVResize(256), _TVCenterCrop(224)]

    def compose(img: Any) -> Any:
        for op in ops:
            img = op(img)
        return _tv_to_normalized_tensor(img)
    return compose, f"re-implementation of torchvision's transforms ({tv_status()})"


def _pil_loader(path: str) -> Any:
    """torchvision.datasets.folder.pil_loader."""
    from PIL import Image

    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def list_image_folder(root: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """(path, class index) pairs and class names of an ImageFolder tree, in torchvision's order."""
    exts = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    samples = [(os.path.join(dirpath, name), k)
               for k, c in enumerate(classes)
               for dirpath, _, files in sorted(os.walk(root / c, followlinks=True))
               for name in sorted(files) if name.lower().endswith(exts)]
    if not samples:
        raise ConfigError(f"{root}: expected an ImageFolder tree (root/<class>/<image>.jpg), found no images; "
                          "pass a folder of class subfolders, or leave data unset to generate images")
    return samples, classes


class _FolderDataset:
    """torchvision.datasets.ImageFolder's item: (transform(pil_loader(path)), class index)."""

    def __init__(self, samples: list[tuple[str, int]], transform: Callable[[Any], Any]) -> None:
        self.samples, self.transform = samples, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, label = self.samples[i]
        return self.transform(_pil_loader(path)), label


def baseline_loader(root: str | Path, batch_size: int, *, workers: int, train: bool = True, shuffle: bool = True,
                    seed: int = 0, pin_memory: bool = False, transform: Callable[[Any], Any] | None = None) -> Any:
    """torchvision's ImageFolder + default transforms in a torch DataLoader with `workers` processes.

    Batches are `(float32 [B, 3, 224, 224] normalized, int64 [B])`: torchvision's defaults, which
    convert and normalize on the CPU, in the workers. `transform` replaces the default transforms
    (a recipe's, from `baseline_recipes.recipe_transform`).
    """
    import torch
    from torch.utils.data import DataLoader

    if transform is None:
        transform, _ = baseline_transform(train)
    if _torchvision() is not None:
        from torchvision.datasets import ImageFolder
        dataset: Any = ImageFolder(str(root), transform=transform)
    else:
        dataset = _FolderDataset(list_image_folder(Path(root))[0], transform)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=workers,
                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed))
