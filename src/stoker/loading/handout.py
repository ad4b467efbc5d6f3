"""A finished slot becomes the caller's batch: the one place that says what a batch is made of.

Every output goes through here: torch tensors in host memory (`host_batch`, the batch ops run on the
CPU), NumPy arrays (`numpy_batch`), and the device thread's batches (`device.build.DeviceBuilder`
takes its labels, extras and batch ops from here, then uploads and converts). The process mode hands
out the slots its child filled through the same functions (`procs.ProcessRun` only refills a slot's
labels and extras from the pipe).

Images are a view of the slot (`[B, 3, H, W]` with channels_last strides; clips `[B, T, 3, H, W]`), no
copy: the slot goes back to the workers only once nothing references it. Labels and extras are fresh
objects. Nothing here makes a CUDA call: `upload` is the device thread's, passed in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .._torch import torch
from ..errors import SampleError
from .kinds import fold_rows, unfold_rows
from .labels import MultiLabel
from .slots import Slot

if TYPE_CHECKING:
    from .render import RenderSpec

__all__ = ["batch_extras", "host_batch", "labels_of", "numpy_batch", "run_batch_ops"]


def labels_of(slot: Slot, encode: MultiLabel | None, copy: bool = True) -> Any:
    """The slot's labels as a batch item: numeric labels a tensor (`copy`: a fresh one; else a view of
    the slot, for a device upload that copies anyway), label lists encoded by `encode` (multi-label
    data) or a plain list."""
    n = slot.size
    if slot.labels is not None:
        return slot.labels[:n].clone() if copy else slot.labels[:n]
    return list(slot.objects[:n]) if encode is None else encode(slot.objects[:n])


def batch_extras(slot: Slot, upload: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """The third batch item: extra columns as lists, targets as their kind batches them, the padded
    images' sizes as a tensor (uploaded with `upload` when given)."""
    from ..transforms.targets import TargetRows

    out: dict[str, Any] = {}
    for c, v in slot.extras.items():
        if isinstance(v, TargetRows):   # boxes, masks, label maps...: as their kind batches them
            v = v.collate()
        elif isinstance(v, np.ndarray):   # pad=True's sizes
            v = torch.from_numpy(v)
        out[c] = (upload(v) if upload else v) if isinstance(v, torch.Tensor) else list(v)
    return out


def run_batch_ops(spec: "RenderSpec", images: Any, labels: Any, epoch: int, batch: int) -> tuple[Any, Any]:
    """The pipeline's batch ops on one batch (NHWC in, NCHW out; clips [B, T, H, W, 3] in, [B, T, 3, H, W]
    out, every frame an image of the batch), their draws keyed by (seed, epoch, batch index of the epoch);
    with a Mixup the labels come back as soft targets [B, num_classes]. On whatever device `images` is."""
    ops = spec.pipeline.batch
    if ops.mix is not None and not isinstance(labels, torch.Tensor):
        raise SampleError(f"Mixup needs numeric class labels, batch {batch} of epoch {epoch} has "
                          f"{type(labels[0]).__name__} labels; drop the Mixup or pack integer labels")
    x, lead = fold_rows(images)
    out = ops(x.permute(0, 3, 1, 2), labels if ops.mix is not None else None, epoch=epoch, batch=batch,
              seed=spec.seed)
    x, labels = out if isinstance(out, tuple) else (out, labels)
    return unfold_rows(x, lead), labels


def host_batch(slot: Slot, spec: "RenderSpec", epoch: int, batch: int) -> tuple:
    """The caller's torch batch in host memory: images a [B, 3, H, W] (clips: [B, T, 3, H, W]) view of the
    slot (channels_last strides, no copy), or with batch ops their output (run here, on the CPU); labels
    and extras fresh objects. `batch`: the batch's index in its epoch (the batch ops' key)."""
    n = slot.size
    images: Any = slot.images if n == slot.images.shape[0] else slot.images[:n]
    labels = labels_of(slot, spec.multi_label)
    if slot.floats is not None:   # the engine wrote the batch's one Normalize (RenderSpec.floats)
        images, slot.floats = slot.floats[:n], None
    elif spec.pipeline.batch is not None:
        images, labels = run_batch_ops(spec, images, labels, epoch, batch)
    else:
        images = images.movedim(-1, -3)
    if slot.extras:   # extra columns, and the sizes of padded images
        return images, labels, batch_extras(slot)
    return images, labels


def numpy_batch(slot: Slot, encode: MultiLabel | None) -> tuple:
    """The caller's NumPy batch (`Loader(device="numpy")`): images a [B, 3, H, W] (clips: [B, T, 3, H, W])
    view of the slot, labels and extras fresh (label lists encoded as numpy arrays, label maps stacked,
    pad=True's sizes)."""
    n = slot.size
    images = np.moveaxis(slot.images[:n], -1, -3)   # a view: its base is the slot's array, which counts it
    labels: Any
    if slot.labels_np is not None:
        labels = slot.labels_np[:n].copy()
    elif encode is None:
        labels = list(slot.objects[:n])
    else:
        labels = encode.arrays(slot.objects[:n])
    if not slot.extras:
        return images, labels
    from ..transforms.targets import LabelMap, TargetRows, stack_label_map_arrays

    extras: dict[str, Any] = {}
    for column, value in slot.extras.items():
        if isinstance(value, TargetRows):   # label maps stacked as arrays; boxes and masks as lists
            value = stack_label_map_arrays(list(value)) if isinstance(value.target, LabelMap) else list(value)
        extras[column] = value if isinstance(value, np.ndarray) else list(value)
    return images, labels, extras
