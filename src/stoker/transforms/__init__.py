"""Transforms: torchvision's names and semantics, planned before any pixel is touched.

    Loader(src, 256, transforms=[RandomResizedCrop(224), RandomHorizontalFlip(), my_callable])

Where each kind of op runs. Every op declares its kind with two class attributes (`kinds.py`):
`stage` ("plan", "sample" or "batch") and `moves_pixels` (False when boxes and masks stay valid), so
the pipeline never lists classes and a new op is one class:

- **Geometry, planned per batch and fused with decode** (`geometry.py`, `stage = "plan"`): a frozen
  dataclass with `draws` (how many uniform draws it reads per sample), `plan(state, u)` updating the
  batch's `PlanState` (crop box, output size and flip) from those draws, vectorised in numpy, and
  `fixed_size(size)`. The worker then decodes only the resolution the box needs and resizes once into
  the batch.
- **Per-sample ops on worker threads** (`stage = "sample"`, `user.py`): a callable on a uint8 HWC
  numpy array, optionally taking `rng=` (a numpy Generator seeded from the sample's key); it runs after
  the planned geometry, on the sample's row. Colour and policy ops (ColorJitter, RandAugment) belong
  here, so their randomness stays keyed by (seed, epoch, sample index) and never depends on thread
  scheduling. The built-in ones: `colour.py` (ColorJitter, GaussianBlur, RandomGrayscale, a uint8
  RandomErasing) and `policy.py` (RandAugment, TrivialAugmentWide, AutoAugment), on the kernels of
  `pixels.py`.
- **Batched on whole batches** (`stage = "batch"`, `gpu.py`, `mixing.py`): ops on a `[B, 3, H, W]`
  tensor with a `params(rng, n, h, w)` / `apply(x, params)` pair and `takes` / `gives` (uint8 or
  normalized float), drawing from the batch's key (seed, epoch, batch index); run by the device thread
  after the upload, or on the CPU batch without a device: batched colour/policy ops, Normalize,
  RandomErasing (after Normalize, as torchvision's), then a Mixup (`mixes_labels`).
- **Anything else** (`adapt.py`): torchvision transforms are translated to the above; other callables
  on numpy arrays, PIL images or CHW tensors are wrapped, with per-sample seeding and named errors.

`Pipeline` (`pipeline.py`) compiles a list into the planned geometric prefix, the per-array tail and
the batch ops, and names the ops that boxes and masks cannot follow (`pixel_movers`).
Randomness comes from per-sample uniform draws (`order.uniforms`) keyed by (seed, epoch, sample index);
each op reads a fixed slice of that stream.
"""

from __future__ import annotations

from .geometry import (INTERPOLATIONS, CenterCrop, CoverCrop, CropWindow, Plan, PlanState, RandomHorizontalFlip,
                       RandomResizedCrop, Resize, Resampling, Size, crop_resize_into, crop_window,
                       decode_minimums, plan_ops, resample, resample_region_into, resampling)
from .adapt import Adapted, TransformError, adapt
from .colour import ColorJitter, GaussianBlur, RandomGrayscale
from .batch_ops import BatchAugment, Normalize, RandomErasing   # stoker.RandomErasing: the batched op
from .kinds import BATCH, PLAN, SAMPLE
from .mixing import CutMix, MixUp, Mixup
from .pipeline import Pipeline
from .policy import AutoAugment, RandAugment, TrivialAugmentWide
from .user import apply_tail, run_user_op

__all__ = ["INTERPOLATIONS", "Adapted", "AutoAugment", "BATCH", "BatchAugment", "CenterCrop", "ColorJitter",
           "CoverCrop", "CropWindow", "CutMix", "GaussianBlur", "MixUp", "Mixup", "Normalize", "PLAN", "Pipeline", "Plan",
           "PlanState", "RandAugment", "RandomErasing", "RandomGrayscale", "RandomHorizontalFlip", "RandomResizedCrop",
           "Resampling", "Resize", "SAMPLE", "Size",
           "TransformError", "TrivialAugmentWide", "adapt", "apply_tail", "crop_resize_into", "crop_window",
           "decode_minimums", "plan_ops", "resample", "resample_region_into", "resampling", "run_user_op"]
