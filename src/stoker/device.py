"""The device stage: batches to the GPU on a side stream, converted and normalized there.

    for images, labels in stoker.prefetch(train_loader, "cuda", normalize="imagenet"):
        ...                               # images: float32 [B, 3, H, W] on the GPU, already normalized

Batches travel as they come (uint8 images move 4x fewer bytes than float32) on one CUDA stream per
stage, made once and kept: the caching allocator keeps its memory pools per stream, so a stream per
epoch would strand pools. Turning uint8 into normalized float and laying out NCHW or channels_last
happens on that stream too. The consumer never blocks the host on the GPU: its stream waits on a CUDA
event recorded after the copy (`handoff`), and `record_stream` tells the allocator that the consumer
uses the output, so freeing it cannot hand its memory back to the copy stream too early.

The CUDA path uses torch's documented stream and event API (`torch.cuda.Stream`, `torch.cuda.Event`,
`Stream.wait_event`, `Tensor.record_stream`); its tests live in tests/cuda/ and run where a GPU is
present. Everything else, including the conversion arithmetic, is tested on the CPU.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterable, Iterator

import numpy as np
import torch

from .errors import ConfigError, LoaderTimeoutError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "uint8": torch.uint8,
}
_FORMATS = {
    "contiguous": torch.contiguous_format, "nchw": torch.contiguous_format,
    "channels_last": torch.channels_last, "nhwc": torch.channels_last,
}
_IMAGE_KEYS = ("image", "images", "img", "pixel_values", "x")  # dict keys tried, in order, by images=None
_LAYOUTS = ("nchw", "nhwc")
_POLL_MIN_S = 0.0002  # Fence.wait: first pause between event queries, seconds
_POLL_MAX_S = 0.002  # ... growing to this, so a wait costs at most ~2 ms of latency and little CPU
_CLOSE_WAIT_S = 10.0  # Prefetcher: longest wait for in-flight copies before dropping their CPU batches


# ---- options --------------------------------------------------------------------------------
def parse_device(device: Any) -> torch.device:
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ConfigError(f"device must be 'cuda', 'cuda:<index>', an int GPU index, a torch.device or 'cpu'; "
                          f"got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ConfigError(f"device={device}: a GPU index must be >= 0")
        dev = torch.device("cuda", device)
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"device={device!r} is not a device torch understands ({exc}); "
                              f"use 'cuda', 'cuda:1' or 'cpu'") from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ConfigError(f"device={device!r}: stoker's device stage supports 'cuda' and 'cpu', not {dev.type!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} asks for CUDA, but this torch ({torch.__version__}) sees no CUDA GPU; "
                          f"install a CUDA build of torch (https://pytorch.org/get-started/locally/) "
                          f"or pass device='cpu'")
    count = torch.cuda.device_count()
    # "cuda" means the current GPU when the options are made (torch.cuda.set_device first under torchrun);
    # fixing the index here keeps the stage's stream, its events and its outputs on one GPU
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise ConfigError(f"device={device!r}: this machine has {count} CUDA GPU(s), indices 0..{count - 1}")
    return torch.device("cuda", index)


def _floats(name: str, values: Any) -> tuple[float, ...]:
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        values = (values,)
    if isinstance(values, (str, bytes)):
        raise ConfigError(f"normalize {name} must be numbers, got {values!r}")
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"normalize {name} must be a number or a sequence of numbers, got {values!r}") from exc
    if not out:
        raise ConfigError(f"normalize {name} is empty; give 1 value or one per channel")
    if not all(math.isfinite(v) for v in out):
        raise ConfigError(f"normalize {name} must be finite numbers, got {out}")
    return out


def _parse_normalize(normalize: Any) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    if normalize is None:
        return None
    if isinstance(normalize, str):
        if normalize.lower() == "imagenet":
            return IMAGENET_MEAN, IMAGENET_STD
        raise ConfigError(f"normalize={normalize!r}: the only named statistics are 'imagenet'; "
                          f"otherwise pass (mean, std) in 0..1 units")
    try:
        mean, std = normalize
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"normalize must be None, 'imagenet' or a (mean, std) pair, got {normalize!r}") from exc
    mean, std = _floats("mean", mean), _floats("std", std)
    if any(s <= 0 for s in std):
        raise ConfigError(f"normalize std must be > 0 (it divides), got {std}")
    if any(m > 1 for m in mean) or any(s > 1 for s in std):
        raise ConfigError(f"normalize (mean={mean}, std={std}) looks like 0-255 units; stoker takes them in 0..1 "
                          f"units like torchvision's Normalize: divide by 255 (ImageNet: normalize='imagenet')")
    if len(mean) != len(std) and 1 not in (len(mean), len(std)):
        raise ConfigError(f"normalize mean has {len(mean)} values and std {len(std)}; give each 1 value "
                          f"or one per channel")
    return mean, std


def _parse_dtype(dtype: Any, normalize: Any) -> torch.dtype:
    if dtype is None:
        return torch.float32 if normalize is not None else torch.uint8
    if isinstance(dtype, str):
        resolved = _DTYPES.get(dtype.lower())
    else:
        resolved = dtype if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values() else None
    if resolved is None:
        raise ConfigError(f"dtype={dtype!r} is not supported; use 'float32', 'float16', 'bfloat16' or 'uint8' "
                          f"(or the torch dtypes)")
    if resolved == torch.uint8 and normalize is not None:
        raise ConfigError("dtype=uint8 cannot hold normalized values; pass dtype='float32' (or 'float16', "
                          "'bfloat16'), or drop normalize to get uint8 images")
    return resolved


def _parse_memory_format(memory_format: Any) -> torch.memory_format:
    if memory_format is None:
        return torch.contiguous_format
    if isinstance(memory_format, str):
        fmt = _FORMATS.get(memory_format.lower())
        if fmt is not None:
            return fmt
    elif memory_format in (torch.contiguous_format, torch.channels_last):
        return memory_format
    raise ConfigError(f"memory_format={memory_format!r} is not supported; use 'contiguous' (plain NCHW) or "
                      f"'channels_last' (or torch.contiguous_format / torch.channels_last)")


@dataclass(frozen=True)
class DeviceOptions:
    """Where batches go and what they become there. Build with `DeviceOptions.make(...)`, which
    accepts shorthand and checks it; the fields hold the resolved values."""

    device: torch.device
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None  # (mean, std) in 0..1 units
    dtype: torch.dtype  # float32 when normalize is set and no dtype was given, else uint8
    memory_format: torch.memory_format  # torch.contiguous_format (plain NCHW) or torch.channels_last
    # (scale, shift) constants [1, C, 1, 1] in float32, one pair per (device, input kind); made on first
    # use and kept, so no batch builds them again
    _constants: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @classmethod
    def make(cls, device: Any = "cuda", normalize: Any = None, dtype: Any = None,
             memory_format: Any = None) -> "DeviceOptions":
        """device: "cuda", "cuda:1", an int GPU index, a torch.device or "cpu" ("cuda" = the current GPU).
        normalize: None, "imagenet" or (mean, std), 1 value or one per channel each, in 0..1 units.
        dtype: float32/float16/bfloat16/uint8 as a torch dtype or name; default float32 with normalize,
        else uint8 (a float dtype without normalize gives x / 255, like ToTensor).
        memory_format: None/"contiguous"/"nchw" or "channels_last" (or the torch memory formats)."""
        norm = _parse_normalize(normalize)
        return cls(parse_device(device), norm, _parse_dtype(dtype, norm), _parse_memory_format(memory_format))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _affine(self, device: torch.device, from_uint8: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale, shift) with y = x * scale + shift, or None when there is nothing to compute."""
        if self.normalize is None:
            return None
        key = (device, from_uint8)
        cached = self._constants.get(key)
        if cached is None:
            mean, std = self.normalize
            n = max(len(mean), len(std))
            mean64 = np.asarray(mean, np.float64) * np.ones(n)  # a 1-value side broadcasts to n
            std64 = np.asarray(std, np.float64) * np.ones(n)
            # (x/255 - mean)/std folded into one multiply-add, constants computed in float64
            scale = (1.0 / 255.0 if from_uint8 else 1.0) / std64
            shift = -mean64 / std64
            cached = tuple(torch.tensor(v, dtype=torch.float32).view(1, n, 1, 1).to(device) for v in (scale, shift))
            self._constants[key] = cached
        return cached


# ---- conversion -----------------------------------------------------------------------------
def convert(images: torch.Tensor, opts: DeviceOptions, *, layout: str = "nhwc") -> torch.Tensor:
    """Images already on opts.device, uint8 or float, [B, H, W, C] (layout "nhwc") or [B, C, H, W] ("nchw")
    -> [B, C, H, W] in opts.dtype and opts.memory_format.

    uint8 input: (x/255 - mean)/std; float input (0..1 units): (x - mean)/std; without normalize only
    the /255 (uint8 input to a float dtype). Arithmetic in float32, cast at the end. A uint8 output is a
    layout change only (no copy when NHWC input is asked for as channels_last). On the GPU, call it
    inside DeviceStage.context() so it runs on the copy stream."""
    if layout not in _LAYOUTS:
        raise ConfigError(f"layout must be 'nhwc' or 'nchw', got {layout!r}")
    if images.dim() != 4:
        raise ConfigError(f"images must be a 4-D batch ({layout.upper()}), got shape {tuple(images.shape)}")
    if images.device != opts.device:
        raise ConfigError(f"images are on {images.device} but the options say {opts.device}; upload them first "
                          f"(DeviceStage.upload)")
    from_uint8 = images.dtype == torch.uint8
    if not from_uint8 and not images.is_floating_point():
        raise ConfigError(f"images must be uint8 (0..255) or float (0..1), got {images.dtype}")
    # NHWC viewed as NCHW: a channels_last-strided view, no copy
    x = images.permute(0, 3, 1, 2) if layout == "nhwc" else images
    channels = x.shape[1]
    fmt = opts.memory_format
    if opts.normalize is not None:
        n = max(len(opts.normalize[0]), len(opts.normalize[1]))
        if n not in (1, channels):
            raise ConfigError(f"normalize has {n} values per channel but the images have {channels} channel(s) "
                              f"(shape {tuple(images.shape)}, layout {layout!r}); give 1 or {channels} values, "
                              f"or check layout=")
    if opts.dtype == torch.uint8:
        if not from_uint8:
            raise ConfigError(f"images are {images.dtype} and dtype=uint8 was asked for; stoker does not quantize "
                              f"float images: pass a float dtype")
        return x.contiguous(memory_format=fmt)
    affine = opts._affine(x.device, from_uint8)
    if affine is not None:
        # one kernel reads the input once and writes a float32 result already in the requested layout
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device, memory_format=fmt)
        torch.addcmul(affine[1], x, affine[0], out=out)
        return out if opts.dtype == torch.float32 else out.to(opts.dtype)  # .to keeps the layout
    if from_uint8:
        # true division computes in float32 and the kernel casts on store: one pass, one allocation
        out = torch.empty(x.shape, dtype=opts.dtype, device=x.device, memory_format=fmt)
        return torch.div(x, 255, out=out)
    if x.dtype != opts.dtype:
        x = x.to(opts.dtype, memory_format=fmt)
    return x.contiguous(memory_format=fmt)


# ---- fences and the stage -------------------------------------------------------------------
class Fence:
    """Marks a point on a stream: done once the GPU has run everything queued there before it.

    `event` is anything with `query() -> bool` (a torch.cuda.Event); None (the CPU) is always done."""

    __slots__ = ("event", "what")

    def __init__(self, event: Any = None, what: str = "the copy to the device") -> None:
        self.event = event
        self.what = what

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Return once done; return early (no error) when `stop` is set; LoaderTimeoutError after `timeout` s.

        Polls with short sleeps (0.2 ms growing to 2 ms) rather than event.synchronize(), which would
        block the host with no way to honour the timeout or the stop flag."""
        pause = _POLL_MIN_S
        deadline = time.monotonic() + timeout
        while not self.done():
            if stop is not None and stop.is_set():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoaderTimeoutError(f"{self.what} had not finished after {timeout:g} s; the GPU may be hung "
                                         f"or its copy engine starved by other work")
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)


def _cuda_tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            yield batch
    elif isinstance(batch, (tuple, list)):
        for item in batch:
            yield from _cuda_tensors(item)
    elif isinstance(batch, dict):
        for item in batch.values():
            yield from _cuda_tensors(item)


class DeviceStage:
    """One per loader (or prefetcher): a dedicated CUDA copy stream, made once and kept, plus the conversion."""

    def __init__(self, opts: DeviceOptions) -> None:
        self.opts = opts
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device=opts.device) if opts.is_cuda else None

    def context(self) -> ContextManager[None]:
        """Makes the copy stream current (and its GPU the current device) inside the block."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """Call inside context(): an asynchronous copy (truly overlapped when `t` is in pinned memory)."""
        return t.to(self.opts.device, non_blocking=True)

    def convert(self, images: torch.Tensor, layout: str = "nhwc") -> torch.Tensor:
        """Call inside context(): `convert(images, self.opts, layout=layout)`."""
        return convert(images, self.opts, layout=layout)

    def fence(self) -> Fence:
        """Call inside context(), after the uploads: a Fence behind everything queued on the copy stream."""
        if self.stream is None:
            return Fence(None)
        event = torch.cuda.Event()  # no timing: cheaper to record and query
        event.record(self.stream)
        return Fence(event, f"the copy of a batch to {self.opts.device}")

    def handoff(self, batch: Any, fence: Fence) -> Any:
        """In the consuming thread: the consumer's current stream waits for `fence` (on the GPU, the host
        does not block), and every CUDA tensor of `batch` (tuple/list/dict, nested) is marked as used
        by that stream, so freeing it defers reuse of its memory until the consumer's queued work is done."""
        if self.stream is None:
            return batch
        consumer = torch.cuda.current_stream(self.opts.device)
        if fence.event is not None:
            consumer.wait_event(fence.event)
        for t in _cuda_tensors(batch):
            t.record_stream(consumer)
        return batch


# ---- prefetch -------------------------------------------------------------------------------
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
        if layout not in ("auto", *_LAYOUTS):
            raise ConfigError(f"layout must be 'auto', 'nchw' or 'nhwc', got {layout!r}")
        if images is not None and (isinstance(images, bool) or not isinstance(images, (int, str))):
            raise ConfigError(f"images must be None (auto), an int index or a str key, got {images!r}")
        self.source = batches
        self.opts = opts
        self.images, self.layout, self._convert = images, layout, bool(convert)
        self._delegate = callable(getattr(batches, "_stoker_device_iter", None))
        if self._delegate and (images is not None or layout != "auto"):
            raise ConfigError("images= and layout= do not apply to a stoker.Loader, which knows its own batches; "
                              "drop them")
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
        it = iter(self.source._stoker_device_iter(self.opts))  # type: ignore[attr-defined]
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


def prefetch(batches: Iterable[Any], device: Any = "cuda", *, normalize: Any = None, dtype: Any = None,
             memory_format: Any = None, images: int | str | None = None, layout: str = "auto") -> Prefetcher:
    """Wrap any iterable of batches (a torch DataLoader, a list, a generator) so each batch arrives on
    `device`, copied on a side stream one batch ahead of the training step.

    Every tensor of a batch (tensor, tuple, list, namedtuple or dict, nested; numpy arrays too) goes to the
    device; other leaves pass unchanged. With normalize, dtype or memory_format, the image tensor
    (`images`: None = the batch itself, item 0, or the first of the dict keys "image", "images", "img",
    "pixel_values", "x"; or an int index / str key) is also converted (see `convert`); `layout` says
    whether it is "nchw" or "nhwc" ("auto": decided from which dim has 1, 3 or 4 entries).
    A stoker.Loader is handed the options and does the device copy itself."""
    opts = DeviceOptions.make(device, normalize=normalize, dtype=dtype, memory_format=memory_format)
    wants = any(v is not None for v in (normalize, dtype, memory_format))
    return Prefetcher(batches, opts, convert=wants, images=images, layout=layout)
