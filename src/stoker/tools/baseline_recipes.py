"""The baseline's side of `stoker bench --recipe`: what a DataLoader + PIL user runs for each recipe.

- ``basic``: RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize (`baseline.py`).
- ``randaug``: the same plus RandAugment(num_ops=2, magnitude=9) before ToTensor.
- ``deit``: ``randaug`` plus RandomErasing(p=0.25) after Normalize in the workers and timm's
  Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1) on each batch in the main process.

With torchvision installed these are torchvision's own transforms; without it, a re-implementation of
its PIL path (torch's RNG for the draws, the same PIL calls: ImageEnhance, ImageOps, Image.transform)
so the cost measured is the cost a DataLoader user pays.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import ConfigError

RECIPES = ("basic", "randaug", "deit")


class _PILRandAugment:
    """torchvision RandAugment's PIL path: 2 ops of 14 at magnitude bin 9 of 31, torch's RNG."""

    def __init__(self, num_ops: int = 2, magnitude: int = 9, bins: int = 31) -> None:
        self.num_ops, self.magnitude, self.bins = num_ops, magnitude, bins

    def _op(self, img: Any, name: str, m: float) -> Any:
        from PIL import Image, ImageEnhance, ImageOps

        w, h = img.size
        if name == "ShearX":
            return img.transform(img.size, Image.AFFINE, (1, m, 0, 0, 1, 0), Image.NEAREST)
        if name == "ShearY":
            return img.transform(img.size, Image.AFFINE, (1, 0, 0, m, 1, 0), Image.NEAREST)
        if name == "TranslateX":
            return img.transform(img.size, Image.AFFINE, (1, 0, -int(m), 0, 1, 0), Image.NEAREST)
        if name == "TranslateY":
            return img.transform(img.size, Image.AFFINE, (1, 0, 0, 0, 1, -int(m)), Image.NEAREST)
        if name == "Rotate":
            return img.rotate(m, Image.NEAREST)
        enhance = {"Brightness": ImageEnhance.Brightness, "Color": ImageEnhance.Color,
                   "Contrast": ImageEnhance.Contrast, "Sharpness": ImageEnhance.Sharpness}
        if name in enhance:
            return enhance[name](img).enhance(1.0 + m)
        if name == "Posterize":
            return ImageOps.posterize(img, int(m))
        if name == "Solarize":
            return ImageOps.solarize(img, m)
        if name == "AutoContrast":
            return ImageOps.autocontrast(img)
        if name == "Equalize":
            return ImageOps.equalize(img)
        return img

    def __call__(self, img: Any) -> Any:
        import torch

        from ..transforms.policy import augmentation_space

        space = augmentation_space("randaugment", self.bins, img.size[1], img.size[0])
        names = list(space)
        for _ in range(self.num_ops):
            name = names[int(torch.randint(len(names), (1,)).item())]
            mags, signed = space[name]
            m = float(mags[self.magnitude]) if mags is not None else 0.0
            if signed and torch.randint(2, (1,)):
                m = -m
            img = self._op(img, name, m)
        return img


def _tensor_random_erasing(t: Any, p: float = 0.25, scale: tuple[float, float] = (0.02, 0.33),
                           ratio: tuple[float, float] = (0.3, 3.3)) -> Any:
    """torchvision RandomErasing (value=0) on a normalized CHW tensor, torch's RNG."""
    import torch

    if torch.rand(1) >= p:
        return t
    _, h, w = t.shape
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        area = h * w * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        eh, ew = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if eh < h and ew < w:
            i = int(torch.randint(0, h - eh + 1, (1,)).item())
            j = int(torch.randint(0, w - ew + 1, (1,)).item())
            t[:, i:i + eh, j:j + ew] = 0
            return t
    return t


def recipe_transform(recipe: str) -> tuple[Callable[[Any], Any], str]:
    """The baseline's per-image transform for `recipe` (PIL in, normalized CHW float out) and what it is."""
    from .._tensors import IMAGENET_MEAN, IMAGENET_STD
    from .baseline import _torchvision, baseline_transform

    if recipe not in RECIPES:
        raise ConfigError(f"unknown recipe {recipe!r}; expected one of {', '.join(RECIPES)}")
    if recipe == "basic":
        return baseline_transform(True)
    tv = _torchvision()
    if tv is not None:
        import torchvision

        ops = [tv.RandomResizedCrop(224), tv.RandomHorizontalFlip(), tv.RandAugment(), tv.ToTensor(),
               tv.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        if recipe == "deit":
            ops.append(tv.RandomErasing(p=0.25))
        return tv.Compose(ops), f"torchvision {torchvision.__version__}"
    from .baseline import _tv_flip, _tv_to_normalized_tensor, _TVRandomResizedCrop

    crop, randaug = _TVRandomResizedCrop(224), _PILRandAugment()

    def compose(img: Any) -> Any:
        t = _tv_to_normalized_tensor(randaug(_tv_flip(crop(img))))
        return _tensor_random_erasing(t) if recipe == "deit" else t
    from .tvimport import status

    return compose, f"re-implementation of torchvision's PIL path ({status()})"


def deit_mixup(num_classes: int) -> Any:
    """The DeiT batch mixing both sides run: timm's Mixup(0.8, 1.0, label_smoothing=0.1)."""
    from ..transforms.mixing import Mixup

    return Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=num_classes)
