"""The GPU JPEG decoder libraries behind `decode="gpu"`: TorchCodec (nvJPEG) and NVIDIA nvImageCodec
(hardware JPEG engines first), each also runnable on the CPU for tests; `make_decoder` picks one.

A decoder returns one result per JPEG (a uint8 [3, H, W] tensor on its device, or the exception for
that sample); `gpu_decode.GpuBatchDecoder` crops, resizes and places them. Its columns form,
`decode_columns` (one buffer of JPEGs and their spans in, each image in the library's own layout out),
keeps the per-image work inside the decoder: the Loader's side of a chunk is then a fixed number of calls.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from .._torch import torch
from ..codecs import encode_jpeg
from ..errors import ConfigError

#: Accepted values of `gpu_decoder` / `make_decoder(backend=...)`.
BACKENDS = ("auto", "torchcodec", "nvimgcodec")
#: The first TorchCodec with image decoding (torchcodec.decoders.decode_jpeg, CPU and CUDA).
TORCHCODEC_MIN = (0, 16)

@runtime_checkable
class GpuDecoder(Protocol):
    """What `GpuBatchDecoder` needs from a decoder library: whole images, one per JPEG.

    A decoder that writes its outputs when called rather than in stream order (the hardware JPEG
    engines) says so with a true `writes_at_call` attribute (see `GpuBatchDecoder`). Optional too:
    a true `regions` means `decode(datas, regions=[(top, bottom, left, right), ...])` decodes only
    each window (the result is that window's pixels); `reuse` > 0 means the decoder writes each call's
    outputs into a ring of `reuse` sets of buffers, and `use_entry(k)` says which set the next call
    writes into: the caller calls it only once it has finished reading the images that set held
    (`gpu_pipeline` waits for that, on an event).

    Optional, and what the Loader calls where a decoder has it: `decode_columns(data, spans,
    regions=None)`, the same decode with the JPEGs as columns (`data`: one 1-D uint8 CPU tensor;
    `spans`: int64 [k, 2], image i is `data[spans[i, 0]:spans[i, 1]]`; `regions`: int64 [k, 4] windows
    (top, bottom, left, right) for a `regions` decoder, else None). One entry per image, in order: a
    uint8 tensor on the device shaped as the decoder's `layout` says ("chw", the default: [3, H, W];
    "hwc": interleaved [H, W, 3]), dense where it can be (the Loader joins the chunk's images in one
    call, copying only those that are not), or the exception for that image; anything else is checked
    one image at a time. The decoders here implement it."""

    name: str  # e.g. "TorchCodec 0.17.0 nvJPEG"

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        """One result per input, in order: a uint8 RGB tensor [3, H, W] on the decoder's device, or the
        exception for that sample. One failing sample must not fail the others."""
        ...


def spans_views(data: torch.Tensor, spans: np.ndarray) -> list[torch.Tensor]:
    """Each image's bytes as a view of `data` (`decode_columns`' inputs as `decode`'s)."""
    return [data[a:b] for a, b in spans.tolist()]


def as_layout(images: list[Any], layout: str = "chw") -> list[Any]:
    """`decode`'s results ([C, H, W] tensors) as `decode_columns` returns them in `layout`: as they are
    for "chw"; for "hwc" each tensor viewed back as the [H, W, C] the library wrote (no copy)."""
    if layout != "hwc":
        return images
    return [img.permute(1, 2, 0) if isinstance(img, torch.Tensor) and img.ndim == 3 else img for img in images]


# ---- backends ------------------------------------------------------------------------------------

def _input_problem(data: Any) -> str | None:
    """Why `data` cannot be handed to a GPU decoder (None when it can)."""
    if not isinstance(data, torch.Tensor):
        return f"expected a 1-D uint8 CPU tensor of JPEG bytes, got {type(data).__name__}"
    if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu":
        return f"expected a 1-D uint8 CPU tensor of JPEG bytes, got {data.dtype} {tuple(data.shape)} on {data.device}"
    if data.numel() == 0:
        return "sample is empty (0 bytes)"
    return None


def _decode_each(call: Any, datas: Sequence[torch.Tensor], regions: Sequence[Any] | None = None) -> list[Any]:
    """Decode a batch with `call(list) -> list` (`call(list, regions=list)` when `regions` is given: one
    (top, bottom, left, right) window per input, decoded alone); when the batched call fails (or returns
    a list of the wrong length), decode one image at a time so only the bad ones fail."""
    def run(idx: list[int]) -> list[Any]:
        if regions is None:
            return list(call([datas[i] for i in idx]))
        return list(call([datas[i] for i in idx], regions=[regions[i] for i in idx]))

    results: list[Any] = [None] * len(datas)
    # one pass reading attributes only: a 1-D uint8 CPU tensor that is not empty is fine as it is
    u8 = torch.uint8
    fine = [d.__class__ is torch.Tensor and d.dtype == u8 and d.ndim == 1 and d.is_cpu and d.shape[0] > 0
            for d in datas]
    if all(fine):
        todo = list(range(len(datas)))
    else:
        todo = []
        for i, data in enumerate(datas):
            problem = None if fine[i] else _input_problem(data)
            if problem is None:
                todo.append(i)
            else:
                results[i] = ValueError(problem)
    if not todo:
        return results
    try:
        outs = run(todo)
        if len(outs) != len(todo):
            raise RuntimeError(f"the decoder returned {len(outs)} images for {len(todo)} inputs")
    except Exception as exc:
        if len(todo) == 1:
            outs = [exc]
        else:
            outs = []
            for i in todo:
                try:
                    one = run([i])
                    outs.append(one[0] if len(one) == 1 else RuntimeError("the decoder returned no image"))
                except Exception as single_exc:
                    outs.append(single_exc)
    if len(todo) == len(datas):
        return list(outs)
    for i, out in zip(todo, outs):
        results[i] = out
    return results


def _columns_each(call: Any, data: torch.Tensor, spans: np.ndarray, regions: np.ndarray | None = None) -> list[Any]:
    """`call(data, spans, regions)` (a `decode_columns`), one result per row; when the call fails (or
    returns something other than a list of one result per row), each row alone, so only the bad ones
    fail. Empty rows fail at once, never reaching the decoder."""
    n = spans.shape[0]
    empty = spans[:, 1] <= spans[:, 0]
    if True in empty:   # (an operator, not a call: this runs once a chunk)
        results: list[Any] = [ValueError("sample is empty (0 bytes)") if e else None for e in empty.tolist()]
        todo = np.flatnonzero(~empty)
        if len(todo):
            for i, out in zip(todo.tolist(), _columns_each(call, data, spans[todo],
                                                           None if regions is None else regions[todo])):
                results[i] = out
        return results
    try:
        outs = call(data, spans, regions)
        if type(outs) is not list or len(outs) != n:
            got = f"{len(outs)} results" if isinstance(outs, list) else type(outs).__name__
            raise RuntimeError(f"the decoder returned {got} for {n} inputs")
        return outs
    except Exception as exc:
        if n == 1:
            return [exc]
    outs = []
    for i in range(n):
        try:
            one = call(data, spans[i:i + 1], None if regions is None else regions[i:i + 1])
            outs.append(one[0] if isinstance(one, list) and len(one) == 1
                        else RuntimeError("the decoder returned no image"))
        except Exception as single_exc:
            outs.append(single_exc)
    return outs


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def _probe_jpeg() -> torch.Tensor:
    """A tiny JPEG made on the spot (no file, no download) to check a backend works."""
    img = np.zeros((16, 24, 3), np.uint8)
    img[..., 0] = np.arange(24, dtype=np.uint8)[None, :] * 10
    return torch.frombuffer(bytearray(encode_jpeg(img)), dtype=torch.uint8)


def _check_backend(decoder: Any, label: str, hint: str) -> None:
    """Decode the probe image once: surfaces a broken install now rather than as a CPU fallback on every
    sample, and pays nvJPEG's one-time setup before the first batch."""
    try:
        out = decoder.decode([_probe_jpeg()])[0]
        if isinstance(out, BaseException):
            raise out
        if tuple(out.shape) != (3, 16, 24):
            raise RuntimeError(f"decoded a 16x24 probe image as {tuple(out.shape)}")
    except Exception as exc:
        raise ConfigError(f"{label} cannot decode JPEGs on {decoder.device}: {type(exc).__name__}: {exc}. "
                          f"{hint}") from exc


def _nvimgcodec_install() -> str:
    # [nvjpeg] brings nvJPEG itself: without it nvImageCodec registers no GPU JPEG decoder
    # unless the CUDA toolkit's libraries are on the library path
    cuda = torch.version.cuda
    if cuda:
        major = cuda.split(".")[0]
        return f"pip install 'nvidia-nvimgcodec-cu{major}[nvjpeg]' (CUDA {major}, like this torch)"
    return "pip install 'nvidia-nvimgcodec-cu12[nvjpeg]' or 'nvidia-nvimgcodec-cu13[nvjpeg]' (the one matching your CUDA)"


def _torchcodec_install() -> str:
    return (f"pip install torchcodec ({'.'.join(map(str, TORCHCODEC_MIN))} or newer, the build matching torch "
            f"{torch.__version__}, from the same index as torch)")


def _torchcodec_hint() -> str:
    return f"Fix: {_torchcodec_install()}, or use decode='cpu'"


def _nvimgcodec_hint() -> str:
    return f"Fix: {_nvimgcodec_install()}, or use decode='cpu'"


class _Backend:
    """What both library backends share: `_call(list) -> list` on their device, retried one image at a
    time when a batched call fails, so one bad sample never fails the others."""

    device: torch.device
    # the library writes its outputs when called, not in stream order (GpuBatchDecoder waits for the
    # previous chunk's reads first)
    writes_at_call = False
    regions = False  # decodes whole images only
    reuse = 0  # a fresh output per image, freed by torch
    layout = "chw"  # decode_columns' pixel order: planar [3, H, W]

    def _call(self, batch: list[torch.Tensor]) -> list[Any]:
        raise NotImplementedError

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        context = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with context:
            return _decode_each(self._call, datas)

    def decode_columns(self, data: torch.Tensor, spans: np.ndarray, regions: np.ndarray | None = None
                       ) -> list[Any]:
        """`decode` of the JPEGs `data[spans[i, 0]:spans[i, 1]]` (`GpuDecoder.decode_columns`): the library
        takes a list of per-image inputs, so they are made here, and each output is returned in `layout`,
        as the library wrote it (no copy)."""
        datas = spans_views(data, spans)
        if regions is None:
            images = self.decode(datas)
        else:
            images = self.decode(datas, regions=[tuple(r) for r in regions.tolist()])  # type: ignore[call-arg]
        return as_layout(images, self.layout)


class TorchCodecDecoder(_Backend):
    """nvJPEG through TorchCodec's `torchcodec.decoders.decode_jpeg(list, mode="RGB", device="cuda")`
    (TorchCodec >= 0.16, whose image decoders supersede torchvision's: torchvision deprecated its GPU
    `decode_jpeg` in 0.29 in favour of them).

    How TorchCodec runs it (src/torchcodec/_core/DecodeJpegCuda.cpp): baseline JPEGs batched on the
    hardware JPEG engines where the GPU has them, others (progressive) one at a time through nvJPEG's
    software path; the work is queued on the current stream into outputs allocated there, and **the
    call host-synchronizes that stream** before it returns. So it runs with a dedicated decode stream
    current (made once, kept): the sync waits for the decode alone, not for the uploads and
    conversions queued on the copy stream; the outputs come from that stream's memory pool, and each
    is marked `record_stream(caller's stream)`, so its block is recycled only once the caller's work
    on it has run; the caller's stream then waits for the decode stream (`wait_stream`, on the GPU).
    RGB mode turns grayscale into 3 channels; EXIF orientation is applied (stored `jpeg` samples carry
    none: the pack turns rotated images upright). One bad image fails the whole call (RuntimeError),
    so a failed batch is retried one image at a time.

    On the CPU (`device="cpu"`) the same library call decodes on the calling thread, no stream
    involved: the wrapper's library calls run on machines without a GPU."""

    label = "TorchCodec"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        decoders = self.load()
        self._decode_jpeg = decoders.decode_jpeg
        version = getattr(importlib.import_module("torchcodec"), "__version__", "?")
        self.name = f"TorchCodec {version} {'nvJPEG' if self.device.type == 'cuda' else 'CPU'}"
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    @staticmethod
    def load() -> Any:
        """torchcodec.decoders with image decoding, or a ConfigError with the install hint (touches no GPU)."""
        try:
            decoders = importlib.import_module("torchcodec.decoders")
        except Exception as exc:  # missing, or built for another torch / CUDA (OSError: could not load ...)
            raise ConfigError(f"gpu_decoder='torchcodec' needs a TorchCodec that imports with this torch "
                              f"({type(exc).__name__}: {exc}). {_torchcodec_hint()}") from None
        if not hasattr(decoders, "decode_jpeg"):
            version = getattr(importlib.import_module("torchcodec"), "__version__", "?")
            raise ConfigError(f"TorchCodec {version} cannot decode images; {'.'.join(map(str, TORCHCODEC_MIN))} "
                              f"or newer can. {_torchcodec_hint()}")
        return decoders

    @staticmethod
    def hint() -> str:
        return _torchcodec_hint()

    def _call(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._stream is None:
            return list(self._decode_jpeg(batch, mode="RGB", device=self.device))
        caller = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            outs = self._decode_jpeg(batch, mode="RGB", device=self.device)
        caller.wait_stream(self._stream)
        for out in outs:
            out.record_stream(caller)
        return outs


#: Threads nvImageCodec may use for its CPU stages (the Huffman decode of what the hardware engines do not
#: take, on the hybrid backend). Its default, 0, means one per core: 16 more threads beside the Loader's.
NVIMGCODEC_CPU_THREADS = 4


class NvImageCodecDecoder(_Backend):
    """NVIDIA nvImageCodec (`nvidia.nvimgcodec.Decoder`, the decoder behind DALI): on a GPU its hardware
    JPEG engines first (A100, H100, H200 and other GPUs that have them), then its CUDA and hybrid
    CPU+GPU decoders for what the engines do not take (progressive JPEGs) or where there are none.

    The batch is decoded with `cuda_stream=` the current stream, so the pixels are ready for work
    queued after it on that stream. Output buffers are nvImageCodec's own (cudaMallocAsync on that
    stream, outside PyTorch's caching allocator) and freed on that stream (cudaFreeAsync) when the
    tensors wrapping them are released, while kernels queued there may still read them; the next
    decode may be handed that memory at once. The hardware JPEG engines write their outputs when the
    call is made, not in stream order (meta-pytorch/torchcodec#1634), so this backend says
    `writes_at_call`, and `GpuBatchDecoder` waits for an event recorded after the last read of the
    previous chunk's images before each decode (not for the whole stream). Images come back
    interleaved [H, W, 3] and are viewed as [3, H, W] (`decode_columns` returns them interleaved,
    `layout = "hwc"`, each as its Image: no copy).
    Colour spec sRGB turns grayscale and CMYK into 3 channels; EXIF orientation is not applied (as on
    the CPU path). An image that fails comes back as None (older releases drop it from the list
    instead; a list of the wrong length is retried one image at a time).

    On the CPU (`device="cpu"`) the same library runs its CPU backend (libjpeg-turbo) and no GPU is
    involved: that is how the GPU path is tested against the real library on machines without one.
    `regions`: decode only each crop's window (`get_sub_code_stream(region=)`); the default is on for
    the CPU backend and off on a GPU, where 0.9's CUDA region decode fails on ordinary regions
    (NVIDIA/nvImageCodec#55) and the hardware engines decode whole images. `reuse=k`: the first call
    after `use_entry(i)` decodes into the Images that entry i of a ring of k kept (`decode(images=)`), so
    a pipelined caller that has finished reading them allocates no device memory per image in steady
    state (buffers grow only for a larger image).
    """

    label = "nvImageCodec"
    layout = "hwc"  # its Images are interleaved [H, W, 3]: decode_columns returns them as they are

    @staticmethod
    def load() -> Any:
        """nvidia.nvimgcodec, or a ConfigError with the install hint (touches no GPU)."""
        try:
            return importlib.import_module("nvidia.nvimgcodec")
        except Exception as exc:  # missing, or a build whose libraries do not load here
            raise ConfigError(f"gpu_decoder='nvimgcodec' needs NVIDIA nvImageCodec, importable here "
                              f"({type(exc).__name__}: {exc}). {_nvimgcodec_hint()}") from None

    @staticmethod
    def hint() -> str:
        return _nvimgcodec_hint()

    def __init__(self, device: torch.device | str, *, regions: bool | None = None, reuse: int = 0) -> None:
        nv = self.load()
        self.device = torch.device(device)
        if reuse < 0:
            raise ConfigError(f"reuse must be 0 (no reuse) or the number of calls between reuses, got {reuse}")
        if self.device.type not in ("cuda", "cpu"):
            raise ConfigError(f"nvImageCodec decodes on a CUDA device or the CPU, not {self.device}")
        if self.device.type == "cuda" and self.device.index is None:  # nvImageCodec takes a device number
            self.device = _cuda_device(self.device)
        self._nv = nv
        version = str(getattr(nv, "__version__", ""))
        args = self._decoder_args(nv)
        self._decoder = nv.Decoder(max_num_cpu_threads=NVIMGCODEC_CPU_THREADS, **args)
        self.writes_at_call = self.device.type == "cuda"
        self._params = self._decode_params(nv)
        # region decode: the CPU backend (libjpeg-turbo) decodes a window exactly; 0.9's CUDA decoders
        # fail on ordinary regions (NVIDIA/nvImageCodec#55), so on a GPU only when asked for
        self.regions = self.device.type == "cpu" if regions is None else bool(regions)
        # output Images reused in a ring of `reuse` calls (0: a fresh Image per call, freed by torch)
        self.reuse = int(reuse)
        self._kept: list[Any] = [None] * max(self.reuse, 1)
        self._turn, self._fresh = 0, False
        kind = ("" if "backends" not in args else " CPU (libjpeg-turbo)" if self.device.type == "cpu"
                else " hardware JPEG first")  # an early release: its default backends
        self.name = f"nvImageCodec {version}".rstrip() + kind

    def _decoder_args(self, nv: Any) -> dict[str, Any]:
        kinds = getattr(nv, "BackendKind", None)
        if self.device.type == "cpu":
            if kinds is None or not hasattr(nv, "NVIMGCODEC_DEVICE_CPU_ONLY"):
                raise ConfigError(f"nvImageCodec {getattr(nv, '__version__', '')} has no CPU-only decoder; "
                                  f"upgrade it: {_nvimgcodec_install()}")
            return {"device_id": nv.NVIMGCODEC_DEVICE_CPU_ONLY, "backends": [nv.Backend(kinds.CPU_ONLY)]}
        if kinds is None or not hasattr(nv, "Backend"):  # an early release: its default backends
            return {"device_id": self.device.index}
        # what the hardware engines cannot take (progressive JPEGs) goes to the CUDA ones
        names = ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU")
        return {"device_id": self.device.index, "backends": [nv.Backend(getattr(kinds, n)) for n in names]}

    @staticmethod
    def _decode_params(nv: Any) -> Any:
        # the 3-channel colour spec is ColorSpec.SRGB in current releases and ColorSpec.RGB in early ones
        colour = next((getattr(nv.ColorSpec, n) for n in ("SRGB", "RGB") if hasattr(nv.ColorSpec, n)), None)
        if colour is None:
            raise ConfigError(f"nvImageCodec {getattr(nv, '__version__', '')} has no RGB colour spec "
                              f"(ColorSpec.SRGB); {_nvimgcodec_install()}")
        try:
            return nv.DecodeParams(apply_exif_orientation=False, color_spec=colour, allow_any_depth=False)
        except TypeError:  # a release whose constructor takes other arguments: set the properties
            params = nv.DecodeParams()
            params.apply_exif_orientation = False
            params.color_spec = colour
            return params

    def _tensor(self, image: Any) -> torch.Tensor:
        # torch keeps the Image alive while the tensor lives (through the array it wraps on the CPU)
        hwc = (torch.as_tensor(image, device=self.device) if self.device.type == "cuda"
               else torch.from_numpy(np.asarray(image)))
        return hwc.permute(2, 0, 1)

    def keep_outputs(self, ring: int) -> None:
        """Reuse output Images in a ring of `ring` entries from now on (see `reuse`)."""
        self.reuse = int(ring)
        self._kept = [None] * max(self.reuse, 1)
        self._turn, self._fresh = 0, False

    def use_entry(self, k: int) -> None:
        """With `reuse`: the following calls decode into the Images kept in entry k of the ring (the
        caller has finished reading them)."""
        if self.reuse:
            self._turn, self._fresh = k % self.reuse, True

    def decode(self, datas: list[torch.Tensor], regions: Sequence[Any] | None = None
               ) -> list[torch.Tensor | Exception]:
        context = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with context:
            if regions is None:
                return _decode_each(self._call, datas)
            return _decode_each(self._call, datas, regions)

    def _call(self, batch: list[torch.Tensor], regions: Sequence[Any] | None = None) -> list[Any]:
        nv = self._nv
        sources: list[Any] = [data.numpy() for data in batch]
        if regions is not None:  # a CodeStream per JPEG, narrowed to its crop window
            sources = [nv.CodeStream(src).get_sub_code_stream(region=nv.Region(r[0], r[2], r[1], r[3]))
                       if r is not None else nv.CodeStream(src) for src, r in zip(sources, regions)]
        # the Images of `reuse` calls ago: nvImageCodec resizes their buffers only when too small, so in
        # steady state a batch allocates nothing (the caller has finished reading them, see `reuse`)
        # only the first call after `use_entry` (the whole chunk): a retry one image at a time must not
        # overwrite the images that call returned
        first = bool(self.reuse) and self._fresh
        kept = self._kept[self._turn] if first else None
        reuse = kept if kept is not None and len(kept) == len(sources) else None
        kwargs = {"params": self._params}
        if reuse is not None:
            kwargs["images"] = reuse
        if self.device.type == "cuda":
            kwargs["cuda_stream"] = torch.cuda.current_stream(self.device).cuda_stream
        images = self._decoder.decode(sources, **kwargs)
        if len(images) != len(sources):  # an older release dropped the failed ones: retried one by one
            raise RuntimeError(f"nvImageCodec returned {len(images)} images for {len(sources)} inputs")
        if first:
            self._kept[self._turn] = None if any([img is None for img in images]) else list(images)
            self._fresh = False
        return [RuntimeError("nvImageCodec could not decode this image (its log says why)") if img is None
                else self._tensor(img) for img in images]


def _cuda_device(device: Any) -> torch.device:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ConfigError(f"GPU JPEG decode needs a CUDA device, got {dev}; use decode='cpu'")
    if not torch.cuda.is_available():
        raise ConfigError(f"GPU JPEG decode needs CUDA, and this torch ({torch.__version__}) sees no CUDA GPU: install "
                          f"a CUDA build of torch, or use decode='cpu'")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


#: gpu_decoder="auto": the first of these that works here, in this order (docs/gpu-decode.md says why);
#: the others are never made, so no second nvJPEG state, stream or thread pool is held.
AUTO = ("torchcodec", "nvimgcodec")
#: Backends that were removed, and what to use instead.
REMOVED = {"torchvision": "torchvision deprecated its GPU decode_jpeg in favour of TorchCodec: use 'torchcodec'",
           "nvimgcodec-cuda": "'nvimgcodec' uses the CUDA decoders for what the hardware JPEG engines do not take"}


def make_decoder(backend: str, device: torch.device | str | int) -> GpuDecoder:
    """A working GPU JPEG decoder on `device` (a CUDA device).

    backend: "torchcodec", "nvimgcodec" (the hardware JPEG engines first where the GPU has them), or
    "auto": the first of `AUTO` that works here; which one is faster on a machine is for
    benchmarks/bench_gpu_decode.py to say, not a timer at start-up. Each backend decodes a probe image
    once here, so a broken install fails now with a ConfigError that names the fix (the pip install
    command), not later on every sample."""
    if backend in REMOVED:
        raise ConfigError(f"gpu_decoder={backend!r} is no longer offered: {REMOVED[backend]}")
    if backend not in BACKENDS:
        raise ConfigError(f"gpu_decoder must be one of {BACKENDS}, got {backend!r}")
    kinds: dict[str, Any] = {"torchcodec": TorchCodecDecoder, "nvimgcodec": NvImageCodecDecoder}
    reasons: list[str] = []
    importable = []
    for name in AUTO if backend == "auto" else (backend,):
        try:  # imports first: a missing library is named even on a machine without a GPU
            kinds[name].load()
            importable.append(kinds[name])
        except ConfigError as exc:
            reasons.append(str(exc))
    if importable:
        dev = _cuda_device(device)
        for kind in importable:
            try:
                decoder = kind(dev)
                _check_backend(decoder, kind.label, kind.hint())
                return decoder
            except ConfigError as exc:
                reasons.append(str(exc))
            except Exception as exc:  # the library imported but cannot start (driver, CUDA mismatch)
                reasons.append(f"{kind.label} could not start on {dev}: {type(exc).__name__}: {exc}. {kind.hint()}")
    if len(reasons) == 1:
        raise ConfigError(reasons[0])
    raise ConfigError("decode='gpu' found no working GPU JPEG decoder:\n  - " + "\n  - ".join(reasons) +
                      f"\nInstall one: {_torchcodec_install()}; or {_nvimgcodec_install()}. Or use decode='cpu'.")
