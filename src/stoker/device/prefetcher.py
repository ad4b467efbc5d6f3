"""`stoker.prefetch()`: the device stage around any iterable of batches (the prefetcher pattern).

    for images, labels in stoker.prefetch(train_loader, DeviceOptions("cuda", normalize="imagenet")):
        ...                               # images: float32 [B, 3, H, W] on the GPU, already normalized

Each batch is copied on the stage's side stream while the caller trains on the previous one, and
converted there when the options ask for it (`device.convert`). No threads: everything runs in the
consumer's thread. A stoker.Loader is not wrapped: it is handed the options and runs its own device
thread, because its pinned ring slots are refilled as soon as their copy is done.

(The module is `prefetcher`, not `prefetch`: a submodule named like the function the package exports
would replace `stoker.prefetch` with the module whenever it is imported directly.)
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Iterable, Iterator

import numpy as np

from .._torch import torch
from .stage import LAYOUTS, DeviceOptions, DeviceStage, Fence, as_device_options
from ..errors import ConfigError

_IMAGE_KEYS = ("image", "images", "img", "pixel_values", "x")  # dict keys tried, in order, by images=None
_CLOSE_WAIT_S = 10.0  # longest wait for in-flight copies before dropping their CPU batches


def _rebuild(container: Any, items: list[Any]) -> Any:
    """A tuple, namedtuple or list like `container` holding `items`."""
    if isinstance(container, tuple):
        return type(container)(*items) if hasattr(container, "_fields") else tuple(items)
    try:
        return type(container)(items)
    except TypeError:  # a list subclass whose constructor wants something else
        return list(items)


def _rebuild_dict(container: dict, items: dict) -> dict:
    try:
        return type(container)(items)
    except TypeError:  # e.g. defaultdict, whose first argument is the factory
        return dict(items)


def _as_tensor(leaf: Any) -> torch.Tensor | None:
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biufc":
        # torch.from_numpy shares memory and warns on read-only arrays; those get a private copy
        return torch.from_numpy(leaf if leaf.flags.writeable else leaf.copy())
    return None


def _walk(batch: Any, fn: Any) -> Any:
    """`fn` applied to every tensor (numpy arrays become tensors first); containers rebuilt, other leaves kept."""
    t = _as_tensor(batch)
    if t is not None:
        return fn(t)
    if isinstance(batch, (tuple, list)):
        return _rebuild(batch, [_walk(item, fn) for item in batch])
    if isinstance(batch, dict):
        return _rebuild_dict(batch, {k: _walk(v, fn) for k, v in batch.items()})
    return batch


def _auto_layout(shape: tuple[int, ...]) -> str:
    first, last = shape[1] in (1, 3, 4), shape[-1] in (1, 3, 4)
    if first and not last:
        return "nchw"
    if last and not first:
        return "nhwc"
    why = "both" if first else "neither"
    raise ConfigError(f"cannot tell the layout of images of shape {shape}: {why} dim 1 and the last dim look like "
                      f"channels (1, 3 or 4); pass layout='nchw' or layout='nhwc'")


class Prefetcher:
    """Iterates `batches`, one batch ahead, with the next batch's copy (and conversion) overlapping the
    caller's step on the current one. No threads: everything runs in the consumer's thread.

    Every iter() reads the source anew through one DeviceStage (one copy stream for the Prefetcher's
    life). The source iterator is closed (when it has close()) on exhaustion, break, errors and close().
    Exceptions from the source reach the caller unchanged, after the batches that came before them."""

    def __init__(self, batches: Iterable[Any], opts: DeviceOptions, *, convert: bool = True,
                 images: int | str | None = None, layout: str = "auto") -> None:
        if layout not in ("auto", *LAYOUTS):
            raise ConfigError(f"layout must be 'auto', 'nchw' or 'nhwc', got {layout!r}")
        if images is not None and (isinstance(images, bool) or not isinstance(images, (int, str))):
            raise ConfigError(f"images must be None (auto), an int index or a str key, got {images!r}")
        self.source = batches
        self.opts = opts
        self.images, self.layout, self._convert = images, layout, bool(convert)
        # a stoker.Loader (or anything with its public `iter_on(opts)`) does its own device copy
        self._delegate = callable(getattr(batches, "iter_on", None))
        if self._delegate and (images is not None or layout != "auto"):
            raise ConfigError("images= and layout= do not apply to a stoker.Loader, which knows its own batches; "
                              "drop them")
        if not self._delegate and opts.gpu_decode:
            raise ConfigError(f"decode='gpu' applies to a stoker.Loader, which holds encoded JPEGs; a "
                              f"{type(batches).__name__} yields decoded batches: use decode='cpu'")
        # a stoker.Loader reuses its pinned batch memory, so it does the device copy itself
        self.stage: DeviceStage | None = None if self._delegate else DeviceStage(opts)
        self._live: weakref.WeakSet = weakref.WeakSet()

    def __len__(self) -> int:
        try:
            return len(self.source)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"the source ({type(self.source).__name__}) has no len()") from None

    def __iter__(self) -> Iterator[Any]:
        gen = self._run_delegate() if self._delegate else self._run()
        self._live.add(gen)
        return gen

    def close(self) -> None:
        """End every iteration in progress (closing its source iterator). A later iter() starts afresh."""
        for gen in list(self._live):
            gen.close()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the passes ---------------------------------------------------------------------------
    def _run_delegate(self) -> Iterator[Any]:
        it = iter(self.source.iter_on(self.opts))  # type: ignore[attr-defined]
        try:
            for batch in it:  # not `yield from`, which would close `it` a second time on break
                yield batch
        finally:
            _close(it)

    def _run(self) -> Iterator[Any]:
        stage = self.stage
        assert stage is not None
        it = iter(self.source)
        inflight: deque[tuple[Fence, Any]] = deque()  # (fence, CPU batch): kept alive until its copy is done
        try:
            current = self._stage_next(it, stage, inflight)
            while current is not None:
                error: Exception | None = None
                try:
                    # batch k+1 goes on the copy stream before batch k is handed over, so its copy
                    # overlaps the caller's step on batch k
                    following = self._stage_next(it, stage, inflight)
                except Exception as exc:  # raised after batch k is delivered, in its place in the stream
                    error, following = exc, None
                out, fence = current
                current = None
                yield stage.handoff(out, fence)
                del out  # the caller's reference is the only one left
                while inflight and inflight[0][0].done():
                    inflight.popleft()
                if error is not None:
                    try:
                        raise error
                    finally:
                        error = None
                current = following
        finally:
            _close(it)
            for fence, _ in inflight:
                try:
                    fence.wait(_CLOSE_WAIT_S)
                except Exception:  # stuck or failed GPU: pinned memory stays guarded by torch's host allocator
                    break
            inflight.clear()

    def _stage_next(self, it: Iterator[Any], stage: DeviceStage,
                    inflight: deque[tuple[Fence, Any]]) -> tuple[Any, Fence] | None:
        try:
            cpu = next(it)
        except StopIteration:
            return None
        stage.follow(cpu)  # a batch already on the GPU: its copy waits for the work that made it
        with stage.context():
            out = self._move(cpu, stage)
            fence = stage.fence()
        inflight.append((fence, cpu))
        return out, fence

    # ---- one batch ------------------------------------------------------------------------------
    def _move(self, batch: Any, stage: DeviceStage) -> Any:
        if not self._convert:
            return _walk(batch, stage.upload)
        if _as_tensor(batch) is not None:
            if self.images is not None:
                raise ConfigError(f"images={self.images!r} picks one item of a batch, but the batches are single "
                                  f"tensors; drop images=")
            return self._convert_leaf(batch, stage, "the batch")
        key = self._image_key(batch)
        if isinstance(batch, dict):
            return _rebuild_dict(batch, {k: (self._convert_leaf(v, stage, f"batch[{k!r}]") if k == key
                                             else _walk(v, stage.upload)) for k, v in batch.items()})
        return _rebuild(batch, [self._convert_leaf(v, stage, f"batch[{i}]") if i == key else _walk(v, stage.upload)
                                for i, v in enumerate(batch)])

    def _image_key(self, batch: Any) -> int | str:
        """Which item of the batch holds the images (normalized to a position for tuples and lists)."""
        sel = self.images
        if isinstance(batch, dict):
            keys = list(batch)
            if sel is None:
                for k in _IMAGE_KEYS:
                    if k in batch:
                        return k
                raise ConfigError(f"batches are dicts with keys {keys} and none of {list(_IMAGE_KEYS)}; "
                                  f"pass images='<key of the image tensor>'")
            if sel not in batch:
                raise ConfigError(f"images={sel!r}: no such key in the batch; its keys are {keys}")
            return sel
        if isinstance(batch, (tuple, list)):
            n = len(batch)
            if sel is None:
                sel = 0
            elif isinstance(sel, str):
                fields = getattr(batch, "_fields", None)
                if fields is None:
                    raise ConfigError(f"images={sel!r} is a key, but the batches are {type(batch).__name__}s; "
                                      f"pass an int index")
                if sel not in fields:
                    raise ConfigError(f"images={sel!r}: no such field; the batch's fields are {list(fields)}")
                sel = fields.index(sel)
            if not -n <= sel < n:
                raise ConfigError(f"images={self.images!r}: out of range for batches of {n} items")
            return sel % n
        raise ConfigError(f"cannot find the images in a batch of type {type(batch).__name__}; prefetch understands "
                          f"tensors, tuples, lists, namedtuples and dicts (pass images= to pick the item)")

    def _convert_leaf(self, leaf: Any, stage: DeviceStage, where: str) -> torch.Tensor:
        t = _as_tensor(leaf)
        if t is None:
            raise ConfigError(f"{where} should be the image tensor but is a {type(leaf).__name__}; "
                              f"pass images= to pick the item that holds the images")
        if t.dim() != 4:
            raise ConfigError(f"{where} should be a 4-D image batch but has shape {tuple(t.shape)}; "
                              f"pass images= to pick the item that holds the images")
        layout = _auto_layout(tuple(t.shape)) if self.layout == "auto" else self.layout
        return stage.convert(stage.upload(t), layout)


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if callable(close):
        close()


def prefetch(batches: Iterable[Any], device: str | int | torch.device | DeviceOptions = "cuda", *,
             images: int | str | None = None, layout: str = "auto") -> Prefetcher:
    """Wrap any iterable of batches (a torch DataLoader, a list, a generator) so each batch arrives on
    the device, copied on a side stream one batch ahead of the training step.

    `device`: "cuda", "cuda:1", "cpu", ... (batches move as they are) or a `DeviceOptions` (see there).
    Every tensor of a batch (tensor, tuple, list, namedtuple or dict, nested; numpy arrays too) goes to the
    device; other leaves pass unchanged. When the options convert (normalize, a float dtype or
    channels_last), the image tensor (`images`: None = the batch itself, item 0, or the first of the dict
    keys "image", "images", "img", "pixel_values", "x"; or an int index / str key) is also converted (see
    `device.convert`); `layout` says whether it is "nchw" or "nhwc" ("auto": decided from which dim has
    1, 3 or 4 entries). A stoker.Loader is handed the options and does the device copy itself."""
    opts = as_device_options(device)
    if opts is None:
        raise ConfigError("prefetch needs a device: pass device='cuda' (or a DeviceOptions)")
    return Prefetcher(batches, opts, convert=opts.converts, images=images, layout=layout)
