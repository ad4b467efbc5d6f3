"""Sample kinds: what one row of a batch holds, and what each stage does with it.

A Loader's samples are of one kind, resolved once with its dataset (`loader.plan.resolve`) and carried
in the `RenderSpec` (so it crosses to a worker process with it). The glue asks the kind, never "is this
a video?":

| question | asked by | `IMAGES` | `clips.ClipKind` |
| --- | --- | --- | --- |
| `frames`: frames per row, the ring's row shape (`slots.row_shape`) | plan, passes, procs | 0: `[H, W, 3]` | T: `[T, H, W, 3]` |
| `per_item`: epoch positions per dataset row | `plan.EpochOrder` | 1 | `clips_per_video` |
| `plans_batch`: crops planned per batch from the stored sizes | `render.Filler` | yes | no: each clip plans its own |
| `extras(indices, positions)`: columns the kind adds to a batch | `render.Filler` | none | `video`, `clip` (k > 1) |
| `render_row(...)`: one row into its slot | `render.Filler` | `Filler.render` | `clips.read_clip` |
| `per_row_python`: why rows need Python (no native path) | `route.decide` | None | PyAV's frame loop |
| `cpu_only`: why the GPU takes none of its rows | `route.decide` | None | PyAV decodes |
| `state()`: what a Loader state records to resume the same rows | `loader.Loader` | {} | the `Clips` |
| `options`: the kind's own sampling option (`Loader.clips`) | `loader.Loader` | None | the `Clips` |

The batch ops and the device stage need no question: a row's leading axes fold into the batch
(`fold_rows`), so every frame of a clip is an image of the batch, and unfold after (`unfold_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from .stats import WorkerTimes

__all__ = ["IMAGES", "ImageKind", "Renderer", "SampleKind", "fold_rows", "unfold_rows"]


class Renderer(Protocol):
    """What a kind's `render_row` may use of the worker's renderer (`render.Filler`): the dataset, the
    compiled transforms, the seed and epoch of the random streams, the spec (`RenderSpec.key_by_draw`),
    and its image path."""

    ds: Any
    pipe: Any
    seed: int
    epoch: int
    spec: Any

    def render(self, idx: int, key: int, u: np.ndarray, box: tuple | None, dst: np.ndarray, scratch: dict,
               times: WorkerTimes, sample: Any = None) -> None: ...


class SampleKind(Protocol):
    """What a kind of sample answers for the stages (the table in this module's docstring). A kind is a
    small frozen value: it is pickled with the `RenderSpec` into a worker process."""

    name: str
    frames: int
    per_item: int
    plans_batch: bool
    per_row_python: str | None
    cpu_only: str | None

    @property
    def options(self) -> Any: ...

    def extras(self, indices: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The extra columns this kind adds to a batch of dataset `indices` at epoch `positions`."""
        ...

    def render_row(self, filler: Renderer, idx: int, position: int, key: int, u: np.ndarray, box: tuple | None,
                   dst: np.ndarray, scratch: dict, times: WorkerTimes) -> None:
        """Sample `idx`, at `position` of the epoch, into its row `dst` of a slot."""
        ...

    def state(self) -> dict[str, str]:
        """What a Loader's state records (and a resume must match) so the same rows come back."""
        ...


@dataclass(frozen=True)
class ImageKind:
    """Each row is one image, uint8 [H, W, 3]: planned per batch, decoded by `Filler.render`."""

    name: ClassVar[str] = "image"
    frames: ClassVar[int] = 0
    per_item: ClassVar[int] = 1
    plans_batch: ClassVar[bool] = True
    per_row_python: ClassVar[str | None] = None
    cpu_only: ClassVar[str | None] = None

    @property
    def options(self) -> None:
        return None

    def extras(self, indices: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        return {}

    def render_row(self, filler: Renderer, idx: int, position: int, key: int, u: np.ndarray, box: tuple | None,
                   dst: np.ndarray, scratch: dict, times: WorkerTimes) -> None:
        filler.render(idx, key, u, box, dst, scratch, times)

    def state(self) -> dict[str, str]:
        return {}


#: the kind of every pack of images (the default of a `RenderSpec`)
IMAGES = ImageKind()


def fold_rows(x: Any) -> tuple[Any, tuple[int, ...]]:
    """A batch of rows (images [B, H, W, C], clips [B, T, H, W, C]) as a batch of images [N, H, W, C],
    a view, with the leading shape `unfold_rows` restores: every frame of a clip is an image of the batch."""
    return x.flatten(0, x.dim() - 4), tuple(x.shape[:-3])


def unfold_rows(x: Any, lead: tuple[int, ...]) -> Any:
    """`x` ([N, ...], what the batch ops or the conversion made of `fold_rows`'s images) regrouped as
    `lead` rows ([B, ...] for images, [B, T, ...] for clips), a view with the same strides."""
    return x.unflatten(0, lead)
