"""NumPy batches: `Loader(device="numpy")`, for JAX, TensorFlow or plain NumPy training loops, with or
without torch installed.

The batch ring's slots are then plain numpy arrays (not pinned: no CUDA copy reads them), and a batch
is handed out with the layout contract of the torch output: images `uint8 [B, 3, H, W]` (clips
`[B, T, 3, H, W]`), a transposed view of the slot's `[B, H, W, 3]` rows (channels_last strides, no
copy); labels and extras fresh arrays. The batch stays valid while the caller holds it: a slot goes back to the workers only when
nothing refers to its memory any more. Every numpy view keeps a reference to the array it views (as
do a memoryview, `torch.from_numpy`, and a `jax.device_put` that aliases host memory while it copies),
so the slot array's reference count above the ring's own references counts exactly the holders, as
a tensor storage's use count does on the torch path.

Only NumPy output imports this module; the torch path never loads it.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import numpy as np

from .labels import MultiLabel
from .slots import Slot, row_shape

__all__ = ["ArrayWeakRef", "NumpyBuffers", "numpy_batch"]


class NumpyBuffers:
    """The ring's slots as numpy arrays (`slots.Buffers`): the image array counts its holders."""

    def allocate(self, batch_size: int, height: int, width: int, label_dtype: np.dtype | None,
                 frames: int = 0) -> Slot:
        labels = None if label_dtype is None else np.empty(batch_size, label_dtype)
        slot = Slot(np.empty((batch_size, *row_shape(height, width, frames)), np.uint8), None, labels, labels,
                    objects=[None] * batch_size)
        slot.images_np = slot.owner = slot.images
        # the ring's own references, counted the way `Slot.held` counts them (no local holds the array)
        slot.uses = sys.getrefcount(slot.owner)
        return slot

    def weak(self, slot: Slot) -> "ArrayWeakRef":
        return ArrayWeakRef(slot.owner)


class ArrayWeakRef:
    """A batch the ring let go while the caller kept it, until the caller drops it (what torch's
    StorageWeakRef is to a tensor storage)."""

    def __init__(self, array: np.ndarray) -> None:
        self._ref = weakref.ref(array)

    def expired(self) -> bool:
        return self._ref() is None


def numpy_batch(slot: Slot, encode: MultiLabel | None) -> tuple:
    """The caller's batch from a finished slot: images a [B, 3, H, W] (clips: [B, T, 3, H, W]) view of
    it, labels and extras fresh (label lists encoded as numpy arrays, label maps stacked, pad=True's sizes)."""
    n = slot.size
    images = np.moveaxis(slot.owner[:n], -1, -3)
    labels: Any
    if slot.labels_np is not None:
        labels = slot.labels_np[:n].copy()
    elif encode is None:
        labels = list(slot.objects[:n])
    else:
        labels = encode.arrays(slot.objects[:n])
    if not slot.extras:
        return images, labels
    # here, not at import: the ring's NumpyBuffers stay importable without OpenCV (the free-threaded checks)
    from ..transforms.targets import LabelMap, TargetRows, stack_label_map_arrays

    extras: dict[str, Any] = {}
    for column, value in slot.extras.items():
        if isinstance(value, TargetRows):   # label maps stacked as arrays; boxes and masks as lists
            value = stack_label_map_arrays(list(value)) if isinstance(value.target, LabelMap) else list(value)
        extras[column] = value if isinstance(value, np.ndarray) else list(value)
    return images, labels, extras

