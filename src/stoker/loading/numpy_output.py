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

Only NumPy output imports this module; the torch path never loads it. A finished slot becomes the
caller's NumPy batch in `handout.numpy_batch`.
"""

from __future__ import annotations

import sys
import weakref
import numpy as np

from .slots import Slot, row_shape

__all__ = ["ArrayWeakRef", "NumpyBuffers"]


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
