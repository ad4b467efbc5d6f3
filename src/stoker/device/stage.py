"""The device stage: options, conversion, and batches to the GPU on a side stream.

    opts = DeviceOptions("cuda", normalize="imagenet", memory_format="channels_last")
    Loader(src, 256, device=opts)        # or device="cuda": uint8 NCHW batches on the GPU

`DeviceOptions` says where batches go and what they become there (one frozen, self-validating value
shared by `Loader(device=)` and `stoker.prefetch(device=)`); `convert` turns uint8 or float images into
normalized float in NCHW or channels_last; `DeviceStage` owns one CUDA copy stream per loader; `Fence`
marks when a copy is done. The `prefetch()` wrapper for any DataLoader lives in `prefetch.py`.

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
import os
import threading
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, ContextManager, Iterator

import numpy as np

from .._torch import HAVE_TORCH, torch
from .._system import poll_until
from .._tensors import IMAGENET_MEAN, IMAGENET_STD, all_levels, normalize_by_table
from ..errors import ConfigError, LoaderTimeoutError

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
LAYOUTS = ("nchw", "nhwc")
DECODES = ("cpu", "gpu", "auto")  # where JPEGs are decoded (DeviceOptions.decode)


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
    if dev.index is not None and dev.index >= count:
        raise ConfigError(f"device={device!r}: this machine has {count} CUDA GPU(s), indices 0..{count - 1}")
    # "cuda" keeps no index here: which GPU it means is decided when a pass starts (resolve_device)
    return torch.device("cuda", dev.index) if dev.index is not None else torch.device("cuda")


def resolve_device(device: torch.device, *, warn: bool = True) -> torch.device:
    """`device` with its GPU index fixed: "cuda" becomes `default_gpu`'s choice, asked when it is
    called (a pass starting), not when the options were made, so a Loader made before
    `torch.cuda.set_device(local_rank)` still feeds the right GPU; anything else is returned as is."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", default_gpu(torch.cuda.device_count(), warn=warn))


def default_gpu(count: int, *, warn: bool = True) -> int:
    """The GPU that "cuda" means: under torchrun (LOCAL_RANK set, and that many GPUs visible) the local
    rank's, so a Loader made before `torch.cuda.set_device(local_rank)` still feeds its own rank's GPU,
    not GPU 0; otherwise (and when each rank sees one GPU) the current one. Warns (`warn`) when
    LOCAL_RANK and the current device disagree: the model is probably on the other one."""
    current = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK", "").strip()
    if not local.isdigit() or int(local) >= count:
        return current
    rank = int(local)
    if rank != current and warn:
        warnings.warn(f"stoker: device='cuda' is cuda:{rank} here (LOCAL_RANK={rank}), but the current CUDA device is "
                      f"cuda:{current}; call torch.cuda.set_device({rank}) before building the model and "
                      f"iterating the Loader, or pass device='cuda:<index>' to choose", stacklevel=4)
    return rank


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
    """Where batches go and what they become there: one value for `Loader(device=)` and `prefetch(device=)`.

    Frozen and self-validating: shorthand is accepted and resolved when it is made, so a bad value
    fails at construction with a message that names the fix, and the fields hold resolved values.

    device: "cuda", "cuda:1", an int GPU index, a torch.device or "cpu". "cuda" keeps no index (the field
        is torch.device("cuda")) until a Loader's pass starts (or a prefetch() is made): then it is
        LOCAL_RANK's GPU under torchrun, else the current GPU (`resolved()`, `default_gpu`).
    normalize: None, "imagenet" or (mean, std), 1 value or one per channel each, in 0..1 units.
    dtype: float32/float16/bfloat16/uint8 as a torch dtype or name; default float32 with normalize,
        else uint8 (a float dtype without normalize gives x / 255, like ToTensor).
    memory_format: None/"contiguous"/"nchw" or "channels_last" (or the torch memory formats).
    decode: None (the default): "auto" on a CUDA device, "cpu" elsewhere. "cpu" (JPEGs decoded by the worker
        threads), "gpu" (nvJPEG on the device side, with the
        CPU's crop plan; a Loader only; CUDA only, unless gpu_decoder is an object) or "auto": each
        batch's JPEGs split between the GPU decoder and the worker threads by their measured
        throughput where a GPU decoder works here (the CPU's share through the native batch engine where
        it serves the pipeline), else the CPU alone: no decoder, transforms only the CPU path runs, video
        clips, or Workers(processes=N), which refuses "gpu" (`LoaderStats.gpu_split` says why).
    gpu_share: with decode="gpu"/"auto", a fixed share (0..1) of each batch's JPEGs for the GPU; None:
        all of them with "gpu", the measured balance with "auto" (docs/gpu-decode.md).
    gpu_decoder: with decode="gpu" or "auto": "auto" (TorchCodec, else nvImageCodec: the first that works here),
        "torchcodec", "nvimgcodec" (hardware JPEG engines first) or an object with a
        `decode(list_of_uint8_tensors)` method.

    A plain device string anywhere a DeviceOptions is accepted means `DeviceOptions(device=that)`:
    uint8 images, NCHW, decoded where `decode`'s default puts them (`as_device_options`)."""

    device: Any = "cuda"
    normalize: Any = None  # resolved: (mean, std) tuples in 0..1 units, or None
    dtype: Any = None  # resolved: a torch.dtype
    memory_format: Any = None  # resolved: torch.contiguous_format (plain NCHW) or torch.channels_last
    decode: str | None = None  # resolved: "auto" on a CUDA device, else "cpu"
    gpu_decoder: Any = field(default="auto", hash=False)
    gpu_share: float | None = None
    # (scale, shift) constants [1, C, 1, 1] in float32, one pair per (device, input kind); made on first
    # use and kept, so no batch builds them again
    _constants: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        norm = _parse_normalize(self.normalize)
        resolved = {"device": parse_device(self.device), "normalize": norm,
                    "dtype": _parse_dtype(self.dtype, norm), "memory_format": _parse_memory_format(self.memory_format)}
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        if self.decode is None:   # the GPU takes a measured share where a decoder works, else the route says why not
            object.__setattr__(self, "decode", "auto" if self.is_cuda else "cpu")
        if self.decode not in DECODES:
            raise ConfigError(f"decode must be one of {DECODES}, got {self.decode!r}")
        share = self.gpu_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1):
            raise ConfigError(f"gpu_share must be a number between 0 and 1 (the GPU's share of each batch's "
                              f"JPEGs) or None, got {self.gpu_share!r}")
        if self.decode in ("gpu", "auto"):
            if isinstance(self.gpu_decoder, str) and not self.is_cuda and self.decode == "gpu":
                raise ConfigError(f"decode='gpu' needs a CUDA device, got device={self.device}; use decode='cpu'")
            if not isinstance(self.gpu_decoder, str) and not callable(getattr(self.gpu_decoder, "decode", None)):
                raise ConfigError(f"gpu_decoder must be 'auto', 'torchcodec', 'nvimgcodec' or an object with a "
                                  f"decode(list_of_tensors) method, got {self.gpu_decoder!r}")

    @property
    def converts(self) -> bool:
        """True when the images change on the device (normalized, a float dtype or channels_last), not only move."""
        return (self.normalize is not None or self.dtype != torch.uint8
                or self.memory_format != torch.contiguous_format)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def gpu_decode(self) -> bool:
        """Whether the JPEGs are decoded on the GPU (`decode="gpu"`): the one place that answers it."""
        return self.decode == "gpu"

    def resolved(self, *, warn: bool = True) -> "DeviceOptions":
        """These options with the GPU fixed (`resolve_device`): what a pass and its stage use. Itself
        when the device already has an index (or is the CPU)."""
        device = resolve_device(self.device, warn=warn)
        return self if device == self.device else replace(self, device=device)

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
            cached = (_filled(scale, device), _filled(shift, device))
            self._constants[key] = cached
        return cached


def _filled(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """float32 [1, n, 1, 1] holding `values`, made on `device` by fills: no copy from pageable host
    memory, which on CUDA would block the host until the GPU catches up (an implicit sync)."""
    out = torch.empty((1, len(values), 1, 1), dtype=torch.float32, device=device)
    for c, v in enumerate(values.tolist()):
        out[0, c].fill_(v)
    return out


def as_device_options(device: Any) -> DeviceOptions | None:
    """The one reading of a `device=` argument: None stays None (uint8 batches on the CPU, no device
    stage); a DeviceOptions is used as is; anything else is a device (`DeviceOptions(device=that)`)."""
    if device is None or isinstance(device, DeviceOptions):
        return device
    return DeviceOptions(device=device)


# ---- conversion -----------------------------------------------------------------------------
def convert(images: torch.Tensor, opts: DeviceOptions, *, layout: str = "nhwc") -> torch.Tensor:
    """Images already on opts.device, uint8 or float, [B, H, W, C] (layout "nhwc") or [B, C, H, W] ("nchw")
    -> [B, C, H, W] in opts.dtype and opts.memory_format.

    uint8 input: (x/255 - mean)/std; float input (0..1 units): (x - mean)/std; without normalize only
    the /255 (uint8 input to a float dtype). Arithmetic in float32, rounded to the output dtype as it
    is stored (one kernel, one pass over the output). A uint8 output is a
    layout change only (no copy when NHWC input is asked for as channels_last). On the GPU, call it
    inside DeviceStage.context() so it runs on the copy stream. An unresolved "cuda" in the options
    accepts images on any GPU (the output is made where they are)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be 'nhwc' or 'nchw', got {layout!r}")
    if images.ndim != 4:
        raise ConfigError(f"images must be a 4-D batch ({layout.upper()}), got shape {tuple(images.shape)}")
    if images.device != opts.device and not is_on(images.device, opts.device):
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
    if affine is not None and from_uint8 and x.device.type == "cpu" and opts.dtype == torch.float32:
        # on the CPU a 256-entry table per channel beats the arithmetic several times over (see normalize_by_table)
        out = torch.empty(x.shape, dtype=torch.float32, memory_format=fmt)
        if normalize_by_table(x, uint8_levels(opts, channels).view(1, channels, 1, 256), out):
            return out
    if affine is not None:
        # one kernel reads the input once, computes in float32 and stores straight into the final dtype
        # and layout (float16/bfloat16 rounded on store: no float32 intermediate, no second pass)
        out = torch.empty(x.shape, dtype=opts.dtype, device=x.device, memory_format=fmt)
        return torch.addcmul(affine[1], x, affine[0], out=out)
    if from_uint8:
        # true division computes in float32 and the kernel casts on store: one pass, one allocation
        out = torch.empty(x.shape, dtype=opts.dtype, device=x.device, memory_format=fmt)
        return torch.div(x, 255, out=out)
    if x.dtype != opts.dtype:
        x = x.to(opts.dtype, memory_format=fmt)
    return x.contiguous(memory_format=fmt)


def is_on(device: torch.device, want: torch.device) -> bool:
    """Whether a tensor on `device` is where `want` says: the same device, or any GPU for a "cuda" not
    yet resolved to one (options made before a pass started)."""
    return device == want or (want.index is None and device.type == want.type)


def uint8_levels(opts: DeviceOptions, channels: int = 3) -> torch.Tensor | None:
    """What `convert` makes of each uint8 level on the CPU, per channel: [channels, 256] in opts.dtype, by the
    same arithmetic on all_levels (a table the engine's threads write a float batch from, bit for bit), or
    None for a uint8 output."""
    if opts.dtype == torch.uint8:
        return None
    x = all_levels(channels)
    affine = opts._affine(torch.device("cpu"), True)
    out = torch.empty(x.shape, dtype=opts.dtype)
    if affine is not None:
        torch.addcmul(affine[1], x, affine[0], out=out)
    else:
        torch.div(x, 255, out=out)
    return out.view(channels, 256)


# ---- fences and the stage -------------------------------------------------------------------
class Fence:
    """Marks a point on a stream: done once the GPU has run everything queued there before it.

    `event` is anything with `query() -> bool` (a torch.cuda.Event); None (the CPU) is always done.
    Query it only from the loader's CUDA actor (the device thread, bound to its GPU at its start, or
    the consumer's own thread): a thread that never chose a device would make a context on GPU 0."""

    __slots__ = ("event", "what")
    on_gpu = True   # a slot's guard (`slots.Guard`): done once the GPU passes it

    def __init__(self, event: Any = None, what: str = "the copy to the device") -> None:
        self.event = event
        self.what = what

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Return once done; return early (no error) when `stop` is set; LoaderTimeoutError after `timeout` s.

        Polls (`_system.poll_until`) rather than event.synchronize(), which would block the host with
        no way to honour the timeout or the stop flag."""
        poll_until(self.done, timeout, stop=stop, on_timeout=lambda: LoaderTimeoutError(
            f"{self.what} had not finished after {timeout:g} s; the GPU may be hung or its copy engine "
            f"starved by other work"))


#: the fence of a stage on the CPU: always passed (one, shared: fences are never changed once made)
PASSED = Fence(None)


def _tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a batch (tuple/list/dict, nested), in no particular order; one call for the whole
    batch (the device thread runs it per batch)."""
    out: list[torch.Tensor] = []
    todo = [batch]
    for item in todo:   # breadth first: the loop goes on over what it appends
        kind = type(item)   # the common kinds first, by type: no call for them
        if kind is tuple or kind is list:
            todo += item
        elif kind is torch.Tensor or isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (tuple, list)):
            todo += item
        elif isinstance(item, dict):
            todo += item.values()
    return out


def storages_on(batch: Any, device: torch.device) -> dict[int, int]:
    """The distinct storages of `batch`'s tensors (tuple/list/dict, nested) on `device`: address -> bytes.
    Views share their storage, so each is counted once, at its full size."""
    out: dict[int, int] = {}
    for t in _tensors(batch):
        if t.device == device:
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def _cuda_tensors(batch: Any) -> Iterator[torch.Tensor]:
    return (t for t in _tensors(batch) if t.is_cuda)


def consumer_fence() -> Fence | None:
    """A fence behind everything the calling thread has queued on its current CUDA stream so far, or
    None when this process has not initialised CUDA (then no GPU work can read host memory).

    The plain Loader (no device stage) records one at each step, so a pinned batch the training loop
    copied with `images.cuda(non_blocking=True)` is refilled only after that copy has run; an event
    record costs a few microseconds and never blocks the host. Work on other streams or GPUs than the
    current one at `next()` is not covered: copy the batch on the current stream, or `.clone()` it."""
    if not HAVE_TORCH or not torch.cuda.is_initialized():   # NumPy output without torch: no GPU work
        return None
    stream = torch.cuda.current_stream()
    event = torch.cuda.Event()
    event.record(stream)
    return Fence(event, "your GPU work on an earlier batch (e.g. images.cuda(non_blocking=True))")


def bind_device(index: int) -> None:
    """Make GPU `index` the calling thread's current device (a new thread starts on GPU 0). Cheap when it
    already is: `current_device` asks the runtime, it creates no context."""
    if torch.cuda.current_device() != index:
        torch.cuda.set_device(index)


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stage's CUDA stream, at the default priority. A higher one buys the copies nothing (the copy
    engines do not preempt) and would let the conversion and the batch ops (RandAugment, Mixup), which
    run on this stream too, preempt the training step's kernels."""
    return torch.cuda.Stream(device=device)


class DeviceStage:
    """One per loader (or prefetcher): a dedicated CUDA copy stream, made once and kept, plus the
    conversion."""

    def __init__(self, opts: DeviceOptions) -> None:
        self.opts = opts.resolved()  # "cuda" means a GPU from here on: the stream, events and outputs share it
        self.stream: torch.cuda.Stream | None = copy_stream(self.opts.device) if self.opts.is_cuda else None

    def bind(self) -> None:
        """Call first in the thread that drives this stage (the device thread, the loader's one CUDA
        actor): its GPU becomes the thread's current device, so nothing the thread does (event queries
        included) touches GPU 0, and the copy stream its current stream, so all its work is queued there
        with no `context()` per batch."""
        if self.stream is not None:
            bind_device(self.opts.device.index)
            torch.cuda.set_stream(self.stream)

    def context(self) -> ContextManager[None]:
        """Makes the copy stream current (and its GPU the current device) inside the block."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def follow(self, batch: Any) -> None:
        """Call outside context(), before the copy stream reads `batch`: when some of its tensors are
        already on this GPU (made by the caller's work on its current stream), the copy stream waits for
        that stream, on the GPU (the host does not block). Batches in host memory need no wait, and
        get none, so their copies still overlap the caller's step."""
        if self.stream is None:
            return
        if any(t.device == self.opts.device for t in _tensors(batch)):
            self.stream.wait_stream(torch.cuda.current_stream(self.opts.device))

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """Call inside context(): an asynchronous copy (truly overlapped when `t` is in pinned memory)."""
        return t.to(self.opts.device, non_blocking=True)

    def convert(self, images: torch.Tensor, layout: str = "nhwc") -> torch.Tensor:
        """Call inside context(): `convert(images, self.opts, layout=layout)`."""
        return convert(images, self.opts, layout=layout)

    def fence(self) -> Fence:
        """Call inside context(), after the uploads: a Fence behind everything queued on the copy stream."""
        if self.stream is None:
            return PASSED
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
