"""Batch mixing: Mixup, CutMix and timm's switch between them, with label smoothing, as soft targets.

`Mixup` has timm's parameter names and semantics (timm.data.Mixup): per batch (mode="batch") or per
sample (mode="elem"), with probability `prob` the batch is mixed with its reverse (`x.flip(0)`), by
Mixup (lam ~ Beta(mixup_alpha, mixup_alpha), a weighted sum) or CutMix (lam ~ Beta(cutmix_alpha,
cutmix_alpha), a box of area (1 - lam) pasted from the partner); with both alphas set, CutMix is chosen
with probability `switch_prob`. Targets become `lam * onehot(y) + (1 - lam) * onehot(y.flip(0))`,
each one-hot smoothed to `1 - smoothing + smoothing / num_classes` and `smoothing / num_classes`;
dense multi-label targets are smoothed toward 0.5 (timm's `multi_label=True`). The box is timm's
(timm >= 1.0.29); `MixUp` and `CutMix` are torchvision v2's names and parameters (its box, no smoothing),
and `RandomChoice([MixUp(...), CutMix(...)])` from torchvision becomes one `Mixup` switching between them.

Randomness is a pure function of `(seed, epoch, batch index)`, so a resumed run mixes exactly as the
uninterrupted one did. Works on stoker's CPU batches (uint8 [B, H, W, 3], rounded like timm's
uint8 collate) and on device batches (float or uint8 [B, 3, H, W], on any device), in a handful
of tensor ops: no per-sample Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from .._tensors import host_to_device
from .._torch import torch
from ..errors import ConfigError
from ..order import sample_keys
from .kinds import BATCH

MODES = ("batch", "elem")
BOXES = ("timm", "torchvision")  # whose CutMix box: see Mixup
_TAG_MIX = 5  # order.py's streams use tags 1-4; batch mixing draws from its own


def batch_rng(seed: int, epoch: int, batch: int, tag: int = _TAG_MIX) -> np.random.Generator:
    """A numpy Generator that is a pure function of (seed, epoch, batch index)."""
    key = int(sample_keys(seed, epoch, np.array([batch]), tag=tag)[0])
    return np.random.Generator(np.random.Philox(key=key))


def one_hot(labels: torch.Tensor, num_classes: int, on_value: float = 1.0, off_value: float = 0.0) -> torch.Tensor:
    """float32 [B, num_classes]: `on_value` at each label, `off_value` elsewhere (timm's one_hot).

    Labels in host memory are range-checked (`check_class_labels`); on a GPU that check would read
    them back to the host (a sync per batch), so there it is the caller's (the Loader checks the host
    copy before its upload) and an out-of-range label trips the device's index assert."""
    if labels.dtype.is_floating_point or labels.ndim != 1:
        raise ConfigError(f"class labels must be an integer tensor [B], got {labels.dtype} {tuple(labels.shape)}; "
                          f"multi-hot or soft targets are float [B, num_classes]")
    if labels.device.type == "cpu":
        check_class_labels(labels, num_classes)
    out = torch.full((labels.shape[0], num_classes), off_value, dtype=torch.float32, device=labels.device)
    return out.scatter_(1, labels.long().view(-1, 1), on_value)


def check_class_labels(labels: torch.Tensor, num_classes: int) -> None:
    """ConfigError unless every class label lies in [0, num_classes) (integer labels in host memory)."""
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ConfigError(f"labels must lie in [0, num_classes={num_classes}), got {int(labels.min())}.."
                          f"{int(labels.max())}; set num_classes to the dataset's class count")


def soft_targets(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0,
                 multi_label: bool | None = None) -> torch.Tensor:
    """Smoothed one-hot targets for int labels. Float [B, C] targets: multi-hot ones (`multi_label` True,
    or None) are smoothed toward 0.5 as timm's `multi_label=True`, `t * (1 - smoothing) + smoothing / 2`;
    soft targets (probabilities, `multi_label=False`) as `t * (1 - smoothing) + smoothing / num_classes`."""
    off = smoothing / num_classes
    if labels.dtype.is_floating_point and labels.ndim == 2:
        if labels.shape[1] != num_classes:
            raise ConfigError(f"targets have {labels.shape[1]} columns, num_classes is {num_classes}")
        return labels.float() * (1.0 - smoothing) + (off if multi_label is False else 0.5 * smoothing)
    return one_hot(labels, num_classes, 1.0 - smoothing + off, off)


@dataclass(frozen=True)
class MixParams:
    """What one batch gets: `lam` float32 [B] (1 = unmixed), `cutmix` bool [B], `box` int64 [B, 4]
    (y0, y1, x0, x1) of the pasted region (empty where not CutMix). Mode "batch" repeats one value."""

    lam: np.ndarray
    cutmix: np.ndarray
    box: np.ndarray


def _is_nhwc(x: torch.Tensor) -> bool:
    return x.ndim == 4 and x.shape[-1] == 3 and x.shape[1] != 3


@dataclass(frozen=True)
class Mixup:
    """timm.data.Mixup: Mixup and/or CutMix with a per-batch or per-sample switch and label smoothing.

    DeiT's setting: `Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)`.
    `cutmix_minmax` (min, max) draws the box's sides as fractions of the image instead of from lam;
    `correct_lam` recomputes lam from the clipped box's area (timm's default). `multi_label`: how dense
    float targets are smoothed (see `soft_targets`). `box`: "timm" (timm >= 1.0.29's `rand_bbox`) or
    "torchvision" (v2.CutMix's: half-sides int(sqrt(1 - lam) / 2 * size), lam always corrected)."""

    mixup_alpha: float = 1.0
    cutmix_alpha: float = 0.0
    cutmix_minmax: tuple[float, float] | None = None
    prob: float = 1.0
    switch_prob: float = 0.5
    mode: str = "batch"
    correct_lam: bool = True
    label_smoothing: float = 0.1
    num_classes: int = 1000
    multi_label: bool | None = None
    box: str = "timm"
    stage = BATCH   # the last batch op: it mixes the labels too
    mixes_labels = True
    moves_pixels = True

    def __post_init__(self) -> None:
        if self.box not in BOXES:
            raise ConfigError(f"Mixup: box must be one of {BOXES}, got {self.box!r}")
        if self.mode not in MODES:
            raise ConfigError(f"Mixup: mode must be one of {MODES}, got {self.mode!r}")
        if self.mixup_alpha < 0 or self.cutmix_alpha < 0:
            raise ConfigError(f"Mixup: alphas must be >= 0, got mixup_alpha={self.mixup_alpha}, "
                              f"cutmix_alpha={self.cutmix_alpha}")
        if self.mixup_alpha == 0 and self.cutmix_alpha == 0 and self.cutmix_minmax is None:
            raise ConfigError("Mixup: mixup_alpha and cutmix_alpha are both 0, so nothing would be mixed; "
                              "set one of them > 0 (DeiT: mixup_alpha=0.8, cutmix_alpha=1.0)")
        if self.cutmix_minmax is not None and len(self.cutmix_minmax) != 2:
            raise ConfigError(f"Mixup: cutmix_minmax must be (min, max), got {self.cutmix_minmax!r}")
        if not (0 <= self.prob <= 1 and 0 <= self.switch_prob <= 1 and 0 <= self.label_smoothing < 1):
            raise ConfigError(f"Mixup: prob and switch_prob must be in [0, 1] and label_smoothing in [0, 1), got "
                              f"prob={self.prob}, switch_prob={self.switch_prob}, "
                              f"label_smoothing={self.label_smoothing}")
        if not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ConfigError(f"Mixup: num_classes must be a positive int, got {self.num_classes!r}")

    # ---- parameters ---------------------------------------------------------------------------
    def _cutmix_on(self) -> bool:
        return self.cutmix_alpha > 0 or self.cutmix_minmax is not None

    def _lams(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """timm's _params_per_elem (n samples) / _params_per_batch (n = 1)."""
        lam = np.ones(n, np.float32)
        cut = np.zeros(n, bool)
        if self.mixup_alpha > 0 and self._cutmix_on():
            cut = rng.random(n) < self.switch_prob
            alpha_c = self.cutmix_alpha if self.cutmix_alpha > 0 else 1.0
            lam_mix = np.where(cut, rng.beta(alpha_c, alpha_c, n), rng.beta(self.mixup_alpha, self.mixup_alpha, n))
        elif self.mixup_alpha > 0:
            lam_mix = rng.beta(self.mixup_alpha, self.mixup_alpha, n)
        else:
            cut = np.ones(n, bool)
            alpha_c = self.cutmix_alpha if self.cutmix_alpha > 0 else 1.0
            lam_mix = rng.beta(alpha_c, alpha_c, n)
        apply = rng.random(n) < self.prob
        lam = np.where(apply, lam_mix.astype(np.float32), lam)
        return lam, cut & apply

    def _boxes(self, rng: np.random.Generator, lam: np.ndarray, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """timm's rand_bbox / rand_bbox_minmax plus the lam correction, for each sample."""
        n = len(lam)
        if self.cutmix_minmax is not None:
            lo, hi = self.cutmix_minmax
            cut_h = rng.integers(int(h * lo), int(h * hi), size=n)
            cut_w = rng.integers(int(w * lo), int(w * hi), size=n)
            yl, xl = rng.integers(0, h - cut_h + 1, size=n), rng.integers(0, w - cut_w + 1, size=n)
            yh, xh = yl + cut_h, xl + cut_w
        elif self.box == "torchvision":  # v2.CutMix: a box of half-sides int(r * size) around a random centre
            r = 0.5 * np.sqrt(1.0 - lam.astype(np.float64))
            half_h, half_w = (r * h).astype(np.int64), (r * w).astype(np.int64)
            cy, cx = rng.integers(0, h, size=n), rng.integers(0, w, size=n)
            yl, yh = np.clip(cy - half_h, 0, h), np.clip(cy + half_h, 0, h)
            xl, xh = np.clip(cx - half_w, 0, w), np.clip(cx + half_w, 0, w)
        else:  # timm's rand_bbox (>= 1.0.29: the lower half of an odd side is the shorter one)
            ratio = np.sqrt(1.0 - lam.astype(np.float64))
            cut_h, cut_w = (h * ratio).astype(np.int64), (w * ratio).astype(np.int64)
            cy, cx = rng.integers(0, h, size=n), rng.integers(0, w, size=n)
            yl, yh = np.clip(cy - cut_h // 2, 0, h), np.clip(cy + (cut_h + 1) // 2, 0, h)
            xl, xh = np.clip(cx - cut_w // 2, 0, w), np.clip(cx + (cut_w + 1) // 2, 0, w)
        box = np.stack([yl, yh, xl, xh], 1).astype(np.int64)
        if self.correct_lam or self.cutmix_minmax is not None or self.box == "torchvision":
            lam = (1.0 - (yh - yl) * (xh - xl) / float(h * w)).astype(np.float32)
        return box, lam

    def params(self, rng: np.random.Generator, batch_size: int, height: int, width: int) -> MixParams:
        """Draw one batch's mixing (a function of `rng` only)."""
        lam, cut = self._lams(rng, 1 if self.mode == "batch" else batch_size)
        box = np.zeros((len(lam), 4), np.int64)
        if cut.any():
            cbox, clam = self._boxes(rng, lam[cut], height, width)
            box[cut], lam[cut] = cbox, clam
        if self.mode == "batch":
            lam, cut, box = (np.repeat(a, batch_size, axis=0) for a in (lam, cut, box))
        return MixParams(lam, cut, box)

    # ---- application ----------------------------------------------------------------------------
    def apply(self, images: torch.Tensor, labels: torch.Tensor, p: MixParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix `images` in place with their reverse and return (images, soft targets float32 [B, C])."""
        nhwc = _is_nhwc(images)
        n = images.shape[0]
        h, w = (images.shape[1], images.shape[2]) if nhwc else (images.shape[-2], images.shape[-1])
        dev = images.device
        lam = host_to_device(p.lam, dev)
        shape = (n, 1, 1, 1)
        if not bool(np.all(p.lam == 1.0)):
            if self.mode == "batch":
                self._mix_batch(images, p, nhwc)
            else:
                self._mix_elem(images, p, nhwc, lam, h, w)
        t1 = soft_targets(labels, self.num_classes, self.label_smoothing, self.multi_label)
        targets = t1 * lam.view(n, 1) + t1.flip(0) * (1.0 - lam.view(n, 1))
        return images, targets

    @staticmethod
    def _mix_batch(images: torch.Tensor, p: MixParams, nhwc: bool) -> None:
        """One lam for the batch (timm's _mix_batch): a box copy for CutMix, one blend for Mixup."""
        lam = float(p.lam[0])
        if p.cutmix[0]:   # only the box is copied (flip makes the copy, so the write cannot read itself)
            y0, y1, x0, x1 = (int(v) for v in p.box[0])
            if nhwc:
                images[:, y0:y1, x0:x1] = images[:, y0:y1, x0:x1].flip(0)
            else:
                images[..., y0:y1, x0:x1] = images[..., y0:y1, x0:x1].flip(0)
            return
        partner = images.flip(0)
        if images.dtype.is_floating_point:
            images.mul_(lam).add_(partner, alpha=1.0 - lam)
        else:  # uint8: rounded, as timm's uint8 collate does
            images.copy_((images.float() * lam + partner.float() * (1.0 - lam)).round_().clamp_(0, 255))

    @staticmethod
    def _mix_elem(images: torch.Tensor, p: MixParams, nhwc: bool, lam: torch.Tensor, h: int, w: int) -> None:
        """A lam per sample (timm's _mix_elem), vectorised: blend weights per row, then box masks."""
        dev, n = images.device, images.shape[0]
        partner = images.flip(0)
        cut = host_to_device(p.cutmix, dev)
        wmix = torch.where(cut, torch.ones_like(lam), lam).view(n, 1, 1, 1)
        mixed = images.float() * wmix + partner.float() * (1.0 - wmix)
        if not images.dtype.is_floating_point:
            mixed = mixed.round_().clamp_(0, 255)
        if p.cutmix.any():
            ys = torch.arange(h, device=dev).view(1, h, 1)
            xs = torch.arange(w, device=dev).view(1, 1, w)
            b = host_to_device(p.box, dev)
            inside = ((ys >= b[:, 0, None, None]) & (ys < b[:, 1, None, None]) & (xs >= b[:, 2, None, None])
                      & (xs < b[:, 3, None, None]) & cut.view(n, 1, 1))
            inside = inside.unsqueeze(-1) if nhwc else inside.unsqueeze(1)
            mixed = torch.where(inside, partner.to(mixed.dtype), mixed)
        images.copy_(mixed)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, *, seed: int = 0, epoch: int = 0,
                 batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix one batch; the draws are a pure function of (seed, epoch, batch index)."""
        nhwc = _is_nhwc(images)
        h, w = (images.shape[1], images.shape[2]) if nhwc else (images.shape[-2], images.shape[-1])
        p = self.params(batch_rng(seed, epoch, batch), images.shape[0], h, w)
        return self.apply(images, labels, p)

    def over(self, loader: Any) -> Iterator[tuple]:
        """Iterate `loader` (a stoker Loader), mixing each batch under its seed, epoch and batch
        index: resuming from `loader.load_state_dict(...)` mixes the remaining batches exactly as the
        uninterrupted run did. Yields (images, soft targets[, columns])."""
        it = iter(loader)
        epoch, start = loader.epoch, loader.state_dict()["batch"]
        for b, batch in enumerate(it, start):
            images, labels = self(batch[0], batch[1], seed=loader.seed, epoch=epoch, batch=b)
            yield (images, labels, *batch[2:])


def MixUp(alpha: float = 1.0, num_classes: int | None = None) -> Mixup:  # noqa: N802 (torchvision's name)
    """torchvision.transforms.v2.MixUp: every batch blended with a partner, lam ~ Beta(alpha, alpha),
    one-hot targets mixed by lam (no smoothing). A stoker `Mixup`; the partner of each image is another
    image of the same (shuffled) batch, as torchvision's `roll(1)` is."""
    return Mixup(mixup_alpha=float(alpha), cutmix_alpha=0.0, label_smoothing=0.0,
                 num_classes=_classes(num_classes, "MixUp"), box="torchvision")


def CutMix(alpha: float = 1.0, num_classes: int | None = None) -> Mixup:  # noqa: N802 (torchvision's name)
    """torchvision.transforms.v2.CutMix: on every batch a box of area about (1 - lam) pasted from a partner,
    lam ~ Beta(alpha, alpha) corrected to the box's clipped area, one-hot targets (no smoothing)."""
    return Mixup(mixup_alpha=0.0, cutmix_alpha=float(alpha), label_smoothing=0.0,
                 num_classes=_classes(num_classes, "CutMix"), box="torchvision")


def _classes(num_classes: int | None, name: str) -> int:
    if num_classes is None:
        raise ConfigError(f"{name}: num_classes is needed (stoker's labels are class indices, made one-hot "
                          f"on the device); pass {name}(alpha, num_classes=...) with the dataset's class count")
    return int(num_classes)


def mix_choice(options: list[Mixup], p: list[float] | None = None) -> Mixup:
    """torchvision's `RandomChoice([MixUp(a), CutMix(b)])` (the v2 recipe) as one Mixup switching between
    them: CutMix with probability p[CutMix] (0.5 without p). Other combinations are refused."""
    kinds = {"mixup" if o.cutmix_alpha == 0 else "cutmix": o for o in options}
    if len(options) != 2 or set(kinds) != {"mixup", "cutmix"}:
        raise ConfigError("RandomChoice of batch mixes: stoker takes exactly one MixUp and one CutMix; "
                          "pass a stoker.Mixup(mixup_alpha=..., cutmix_alpha=..., switch_prob=...) instead")
    mix, cut = kinds["mixup"], kinds["cutmix"]
    weights = [1.0, 1.0] if p is None else [float(v) for v in p]
    switch = weights[options.index(cut)] / sum(weights)
    if mix.num_classes != cut.num_classes:
        raise ConfigError(f"RandomChoice: MixUp has num_classes={mix.num_classes}, CutMix {cut.num_classes}")
    return Mixup(mixup_alpha=mix.mixup_alpha, cutmix_alpha=cut.cutmix_alpha, switch_prob=switch,
                 label_smoothing=0.0, num_classes=mix.num_classes, box="torchvision")
