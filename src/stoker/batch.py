"""The batched augmentations, by the names users know: `stoker.batch.ColorJitter` is the op that runs
on whole batches (on the device thread, or on the CPU batch as it is handed out), `stoker.ColorJitter`
the per-sample one that runs on the worker threads. One name, one meaning:

    transforms=[RandomResizedCrop(224), stoker.batch.RandAugment(), stoker.Normalize("imagenet"),
                stoker.batch.RandomErasing(0.25)]

Each batched op draws the same parameters as its per-sample twin, vectorised (docs/transforms.md).
`stoker.Normalize` and `stoker.RandomErasing` are batch ops already and are the same classes here.
"""

from __future__ import annotations

from .transforms.batch_ops import BatchAugment as Augment
from .transforms.batch_ops import BatchAutoAugment as AutoAugment
from .transforms.batch_ops import BatchColorJitter as ColorJitter
from .transforms.batch_ops import BatchGaussianBlur as GaussianBlur
from .transforms.batch_ops import BatchRandAugment as RandAugment
from .transforms.batch_ops import BatchRandomGrayscale as RandomGrayscale
from .transforms.batch_ops import BatchTrivialAugmentWide as TrivialAugmentWide
from .transforms.batch_ops import Normalize, RandomErasing
from .transforms.mixing import CutMix, MixUp, Mixup

__all__ = ["Augment", "AutoAugment", "ColorJitter", "CutMix", "GaussianBlur", "MixUp", "Mixup", "Normalize",
           "RandAugment", "RandomErasing", "RandomGrayscale", "TrivialAugmentWide"]
