"""The batched augmentations (`stoker.batch`): each op draws its per-sample parameters in numpy
(`params(rng, n, h, w)`) and applies them with the kernels of `gpu` (`apply(x, params)`), on whatever
device the batch is; `Normalize`, `RandomErasing`, and `BatchAugment`, which runs a list of them
(and a Mixup) over a batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from .._tensors import IMAGENET_MEAN, IMAGENET_STD, all_levels, host_to_device, normalize_by_table
from .._torch import torch
from ..errors import ConfigError
from . import colour, pixels, policy
from .gpu import (_OP_ID, _TAG_BATCH_AUG, F, _check_uint8, _col, _gray, _u8, adjust_brightness, adjust_contrast,
                  adjust_hue, adjust_saturation, run_policy)
from .kinds import BATCH, stage_of
from .mixing import Mixup, batch_rng


# ---- batched transforms: params(rng, n, h, w) in numpy, apply(x, params) on the device ----------
@dataclass(frozen=True)
class BatchColorJitter:
    """Batched torchvision ColorJitter: per-sample factors and per-sample order of the four ops."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = False

    brightness: Any = 0
    contrast: Any = 0
    saturation: Any = 0
    hue: Any = 0
    ranges: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", colour.ColorJitter(self.brightness, self.contrast, self.saturation,
                                                           self.hue).ranges)

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(rng.random((n, 4)), axis=1)  # a uniform permutation per sample
        factors = np.full((n, 4), np.nan, np.float32)
        for k, r in enumerate(self.ranges):
            if r is not None:
                factors[:, k] = rng.uniform(r[0], r[1], n)
        return order, factors

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        _check_uint8(x, "ColorJitter")
        order, factors = params
        fns = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)
        for step in range(4):
            for fn_id in range(4):
                if self.ranges[fn_id] is None:
                    continue
                rows = np.nonzero(order[:, step] == fn_id)[0]
                if len(rows) == 0:
                    continue
                idx = host_to_device(rows, x.device)
                f = host_to_device(factors[rows, fn_id], x.device)
                x = x.index_copy(0, idx, fns[fn_id](x.index_select(0, idx), f))
        return x


@dataclass(frozen=True)
class BatchRandAugment:
    """Batched torchvision RandAugment (num_ops=2, magnitude=9, num_magnitude_bins=31 by default)."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = True

    num_ops: int = 2
    magnitude: int = 9
    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: pixels.Fill = None

    def __post_init__(self) -> None:
        policy.RandAugment(self.num_ops, self.magnitude, self.num_magnitude_bins, self.interpolation, self.fill)

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        space = policy.augmentation_space("randaugment", self.num_magnitude_bins, h, w)
        names = list(space)
        choice = rng.integers(len(names), size=(n, self.num_ops))
        flip = rng.integers(2, size=(n, self.num_ops)).astype(bool)
        table = np.array([0.0 if space[s][0] is None else float(space[s][0][self.magnitude]) for s in names])
        signed = np.array([space[s][1] for s in names])
        mags = np.where(signed[choice] & flip, -table[choice], table[choice])
        ids = np.array([_OP_ID[s] for s in names])[choice]
        return ids, mags

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        _check_uint8(x, "RandAugment")
        return run_policy(x, params[0], params[1], self.interpolation, self.fill)


@dataclass(frozen=True)
class BatchTrivialAugmentWide:
    """Batched torchvision TrivialAugmentWide: one op and one magnitude bin per sample."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = True

    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: pixels.Fill = None

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        space = policy.augmentation_space("trivialaugmentwide", self.num_magnitude_bins, h, w)
        names = list(space)
        choice = rng.integers(len(names), size=n)
        bins = rng.integers(self.num_magnitude_bins, size=n)
        flip = rng.integers(2, size=n).astype(bool)
        mags = np.array([0.0 if space[names[c]][0] is None else float(space[names[c]][0][b])
                         for c, b in zip(choice, bins)])
        signed = np.array([space[s][1] for s in names])[choice]
        mags = np.where(signed & flip, -mags, mags)
        return np.array([_OP_ID[s] for s in names])[choice][:, None], mags[:, None]

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        _check_uint8(x, "TrivialAugmentWide")
        return run_policy(x, params[0], params[1], self.interpolation, self.fill)


@dataclass(frozen=True)
class BatchAutoAugment:
    """Batched torchvision AutoAugment, ImageNet policy: a sub-policy per sample, each op kept when
    its uniform draw is <= its probability."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = True

    policy: str = "imagenet"
    interpolation: str = "nearest"
    fill: pixels.Fill = None

    def __post_init__(self) -> None:
        policy.AutoAugment(self.policy, self.interpolation, self.fill)

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        space = policy.augmentation_space("autoaugment", 10, h, w)
        table = [[(_OP_ID[name], p, 0.0 if bin_ is None or space[name][0] is None else float(space[name][0][bin_]),
                   space[name][1]) for name, p, bin_ in sub] for sub in policy.IMAGENET_POLICY]
        t = np.array(table, dtype=np.float64)  # [25, 2, (op, prob, magnitude, signed)]
        pol = rng.integers(len(policy.IMAGENET_POLICY), size=n)
        probs = rng.random((n, 2))
        signs = rng.integers(2, size=(n, 2))
        chosen = t[pol]  # [n, 2, 4]
        keep = probs <= chosen[..., 1]
        ids = np.where(keep, chosen[..., 0], -1).astype(np.int64)
        mags = np.where((chosen[..., 3] > 0) & (signs == 0), -chosen[..., 2], chosen[..., 2])
        return ids, mags

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        _check_uint8(x, "AutoAugment")
        return run_policy(x, params[0], params[1], self.interpolation, self.fill)


@dataclass(frozen=True)
class BatchGaussianBlur:
    """Batched torchvision GaussianBlur: a sigma per sample, one grouped separable convolution."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = False

    kernel_size: Any
    sigma: Any = (0.1, 2.0)

    def __post_init__(self) -> None:
        ref = colour.GaussianBlur(self.kernel_size, self.sigma)
        object.__setattr__(self, "kernel_size", ref.kernel_size)
        object.__setattr__(self, "sigma", ref.sigma)

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
        return rng.uniform(self.sigma[0], self.sigma[1], n).astype(np.float32)

    def apply(self, x: torch.Tensor, sigma: np.ndarray) -> torch.Tensor:
        _check_uint8(x, "GaussianBlur")
        n, c, h, w = x.shape
        s = host_to_device(sigma, x.device).repeat_interleave(c).view(-1, 1)
        out = x.float().reshape(1, n * c, h, w)
        kx, ky = self.kernel_size
        for k, dim in ((kx, 3), (ky, 2)):
            pos = torch.linspace(-(k - 1) * 0.5, (k - 1) * 0.5, k, device=x.device).view(1, -1)
            ker = torch.exp(-0.5 * (pos / s) ** 2)
            ker = ker / ker.sum(1, keepdim=True)
            if dim == 3:
                out = F.conv2d(F.pad(out, (k // 2, k // 2, 0, 0), mode="reflect"), ker.view(n * c, 1, 1, k),
                               groups=n * c)
            else:
                out = F.conv2d(F.pad(out, (0, 0, k // 2, k // 2), mode="reflect"), ker.view(n * c, 1, k, 1),
                               groups=n * c)
        return _u8(out.round_()).view(n, c, h, w)


@dataclass(frozen=True)
class BatchRandomGrayscale:
    """Batched torchvision RandomGrayscale: the luma on all three channels, with probability `p`."""

    stage = BATCH
    takes = "uint8"
    moves_pixels = False

    p: float = 0.1

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
        return rng.random(n) < self.p

    def apply(self, x: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
        _check_uint8(x, "RandomGrayscale")
        m = _col(host_to_device(mask, x.device))
        return torch.where(m, _gray(x).expand_as(x), x)


@dataclass(frozen=True)
class Normalize:
    """torchvision Normalize after ToTensor: `(x / 255 - mean) / std` per channel, as float32
    (mean/std in 0..1 units; "imagenet" for ImageNet's)."""

    stage = BATCH
    takes = "any"
    gives = "float"
    moves_pixels = False

    mean: Any = "imagenet"
    std: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.mean, str):
            if self.mean != "imagenet":
                raise ConfigError(f"Normalize: the only named statistics are 'imagenet', got {self.mean!r}")
            object.__setattr__(self, "mean", IMAGENET_MEAN)
            object.__setattr__(self, "std", IMAGENET_STD)
        if self.std is None or len(self.mean) != len(self.std) or min(self.std) <= 0 \
                or not np.isfinite(np.asarray([*self.mean, *self.std], dtype=np.float64)).all():
            raise ConfigError(f"Normalize needs mean and std with one finite mean and one finite positive std per "
                              f"channel, got mean={self.mean}, std={self.std}")

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> None:
        return None

    def _affine(self, from_uint8: bool) -> tuple[torch.Tensor, torch.Tensor]:
        std = torch.tensor(self.std, dtype=torch.float64)
        scale = (1.0 / std / (255.0 if from_uint8 else 1.0)).float().view(1, -1, 1, 1)
        shift = (torch.tensor(self.mean, dtype=torch.float64) / std).float().view(1, -1, 1, 1)
        return scale, shift

    def levels(self, channels: int = 3) -> torch.Tensor:
        """What `apply` makes of each uint8 level on the CPU, per channel: float32 [1, channels, 1, 256] (the
        table `apply` maps a batch through, and the engine's threads write a float batch from)."""
        scale, shift = self._affine(True)
        return all_levels(channels).float().mul_(scale).add_(-shift)

    def apply(self, x: torch.Tensor, params: None = None) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.uint8 and x.dim() == 4:
            out = torch.empty(x.shape, dtype=torch.float32)
            if normalize_by_table(x, self.levels(x.shape[1]), out):
                return out
        scale, shift = self._affine(x.dtype == torch.uint8)
        # (x / 255 - mean) / std, in place on the float copy
        return x.float().mul_(host_to_device(scale, x.device)).add_(host_to_device(-shift, x.device))


@dataclass(frozen=True)
class RandomErasing:
    """Batched torchvision RandomErasing on the normalized float batch (in place on the CPU; value 0 = the mean colour,
    "random" = N(0, 1) per pixel), p=0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3)."""

    stage = BATCH
    takes = "float"
    moves_pixels = False

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: Any = 0

    def __post_init__(self) -> None:
        colour.SampleRandomErasing(self.p, self.scale, self.ratio, self.value)  # the same checks
        object.__setattr__(self, "value", colour._erase_value(self.value))

    def params(self, rng: np.random.Generator, n: int, h: int, w: int) -> tuple[np.ndarray, int]:
        """[n, 4] (top, left, h, w), h = 0 where nothing is erased. torchvision's 10 tries,
        vectorised: the first try that fits, then a uniform position."""
        apply = rng.random(n) < self.p
        area = h * w * rng.uniform(self.scale[0], self.scale[1], (n, 10))
        lr = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        aspect = np.exp(rng.uniform(lr[0], lr[1], (n, 10)))
        eh = np.rint(np.sqrt(area * aspect)).astype(np.int64)  # Python's round() is half-even as well
        ew = np.rint(np.sqrt(area / aspect)).astype(np.int64)
        ok = (eh < h) & (ew < w)
        first = np.argmax(ok, axis=1)
        found = ok[np.arange(n), first] & apply
        eh, ew = eh[np.arange(n), first] * found, ew[np.arange(n), first] * found
        top = np.floor(rng.random(n) * (h - eh + 1)).astype(np.int64)
        left = np.floor(rng.random(n) * (w - ew + 1)).astype(np.int64)
        return np.stack([top, left, eh, ew], 1), int(rng.integers(1 << 62))

    def apply(self, x: torch.Tensor, params: tuple[np.ndarray, int]) -> torch.Tensor:
        boxes, seed = params
        if not x.dtype.is_floating_point:
            raise ConfigError("RandomErasing (batched) works on the normalized float batch, as torchvision's; put "
                              "it after Normalize, or use stoker.transforms.colour.SampleRandomErasing on uint8 samples")
        n, c, h, w = x.shape
        if x.device.type == "cpu":  # on the CPU a slice per erased box beats full-batch masks
            for k in np.nonzero(boxes[:, 2] > 0)[0]:
                t, l_, bh, bw = (int(v) for v in boxes[k])
                if self.value == "random":
                    gen = torch.Generator().manual_seed(seed + int(k))
                    x[k, :, t:t + bh, l_:l_ + bw] = torch.randn((c, bh, bw), generator=gen).to(x.dtype)
                else:
                    x[k, :, t:t + bh, l_:l_ + bw] = torch.tensor(self._values(c), dtype=x.dtype).view(c, 1, 1)
            return x
        b = host_to_device(boxes, x.device)
        ys = torch.arange(h, device=x.device).view(1, h, 1)
        xs = torch.arange(w, device=x.device).view(1, 1, w)
        t, l_, bh, bw = (b[:, k].view(n, 1, 1) for k in range(4))
        inside = ((ys >= t) & (ys < t + bh) & (xs >= l_) & (xs < l_ + bw)).unsqueeze(1)
        if self.value == "random":
            # drawn on the batch's device: the same for a seed on one kind of device (CPU and CUDA
            # generators differ; the erased boxes do not)
            gen = torch.Generator(device=x.device).manual_seed(seed)
            fill = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32).to(x.dtype)
        else:
            fill = host_to_device(torch.tensor(self._values(c), dtype=x.dtype), x.device).view(1, c, 1, 1)
        return torch.where(inside, fill, x)

    def _values(self, c: int) -> tuple[float, ...]:
        return tuple(self.value[:c]) if len(self.value) >= c else tuple(self.value) * c


class BatchAugment:
    """Batched ops (and optionally Mixup/CutMix) run on whole batches, their randomness a pure
    function of (seed, epoch, batch index): deterministic on any device, and resumable."""

    def __init__(self, ops: Sequence[Any], mix: Mixup | None = None, seed: int = 0) -> None:
        dtype = "uint8"   # what the batch is before each op: the ops declare what they take and give
        for k, op in enumerate(ops):
            if stage_of(op) != BATCH or getattr(op, "mixes_labels", False):
                raise ConfigError(f"batch op #{k} ({op!r}) is not a batched op; use the ones in stoker.transforms.gpu")
            takes = getattr(op, "takes", "any")
            if takes == "float" and dtype == "uint8":
                raise ConfigError(f"{type(op).__name__} (batched) works on the normalized batch, as torchvision's "
                                  f"RandomErasing does: put a Normalize before it")
            if takes == "uint8" and dtype == "float":
                raise ConfigError(f"{type(op).__name__} works on uint8 images: put it before Normalize")
            dtype = getattr(op, "gives", None) or dtype
        self.ops, self.mix, self.seed = list(ops), mix, int(seed)

    def __call__(self, images: torch.Tensor, labels: Any = None, *, epoch: int = 0, batch: int = 0,
                 seed: int | None = None) -> Any:
        """Augment one batch (`images` [B, 3, H, W]; a [B, H, W, 3] batch is viewed as NCHW).
        Returns images, or (images, soft targets) when a Mixup is set."""
        x = images.permute(0, 3, 1, 2) if images.ndim == 4 and images.shape[-1] == 3 and images.shape[1] != 3 \
            else images
        n, _, h, w = x.shape
        seed = self.seed if seed is None else int(seed)
        rng = batch_rng(seed, epoch, batch, tag=_TAG_BATCH_AUG)
        for op in self.ops:
            x = op.apply(x, op.params(rng, n, h, w))
        if self.mix is None:
            return x
        if labels is None:
            raise ConfigError("BatchAugment with mix= needs the labels: call it as batch_aug(images, labels, ...)")
        return self.mix(x, labels, seed=seed, epoch=epoch, batch=batch)

    def over(self, loader: Any) -> Iterator[tuple]:
        """Iterate a stoker Loader, augmenting each batch under the loader's seed (not `self.seed`),
        epoch and batch index: a resumed loader continues exactly."""
        it = iter(loader)
        epoch, start = loader.epoch, loader.state_dict()["batch"]
        for b, batch in enumerate(it, start):
            out = self(batch[0], batch[1], epoch=epoch, batch=b, seed=loader.seed)
            yield (*out, *batch[2:]) if isinstance(out, tuple) else (out, *batch[1:])
