"""JPEG decode on the GPU (nvJPEG), cropped and resized there with the CPU path's crop plan.

For machines whose CPU cores cannot decode fast enough: the Loader's device thread hands the JPEGs
of a batch to a `GpuDecoder` (nvJPEG through TorchCodec, or NVIDIA nvImageCodec), then crops each
decoded image with the same integer geometry as the CPU path (`transforms.crop_window`), then crops,
resizes (`torch.nn.functional.interpolate`'s bilinear weights, as batched resampling matrices), flips
and writes a whole group of samples into their rows of the batch on the device in a few kernels. The crop plan is the CPU's (computed from the stored sizes), so a seed gives the same crops
on both paths; only the resampling kernel differs (torch bilinear, antialiased when shrinking, vs
OpenCV bilinear/area).

The decoder libraries are optional imports. A sample the GPU cannot decode is returned as a
failure, never raised, and the Loader decodes it on the CPU instead.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from .._torch import torch
from ..codecs import encode_jpeg
from ..errors import ConfigError, CorruptImageError, ImageError
from ..loading.jobs import GpuJob
from ..transforms import CropWindow, crop_window

F = torch.nn.functional

#: Accepted values of `gpu_decoder` / `make_decoder(backend=...)`.
BACKENDS = ("auto", "torchcodec", "nvimgcodec")
#: Default bound on the decoded pixels held at once by `GpuBatchDecoder.run`: 256 MiB of uint8 RGB,
#: e.g. about 470 ImageNet-sized (375x500) images, or 7 twelve-megapixel photos.
DEFAULT_BUDGET_BYTES = 256 << 20
#: The first TorchCodec with image decoding (torchcodec.decoders.decode_jpeg, CPU and CUDA).
TORCHCODEC_MIN = (0, 16)


@runtime_checkable
class GpuDecoder(Protocol):
    """What `GpuBatchDecoder` needs from a decoder library: whole images, one per JPEG.

    A decoder that writes its outputs when called rather than in stream order (the hardware JPEG
    engines) says so with a true `writes_at_call` attribute (see `GpuBatchDecoder`)."""

    name: str  # e.g. "TorchCodec 0.17.0 nvJPEG"

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        """One result per input, in order: a uint8 RGB tensor [3, H, W] on the decoder's device, or the
        exception for that sample. One failing sample must not fail the others."""
        ...


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


def _decode_each(call: Any, datas: Sequence[torch.Tensor]) -> list[Any]:
    """Decode a batch with `call(list) -> list`; when the batched call fails (or returns a list of the
    wrong length), decode one image at a time so only the bad ones fail."""
    def run(idx: list[int]) -> list[Any]:
        return list(call([datas[i] for i in idx]))

    results: list[Any] = [None] * len(datas)
    todo = []
    for i, data in enumerate(datas):
        problem = _input_problem(data)
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
    for i, out in zip(todo, outs):
        results[i] = out
    return results


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

    def _call(self, batch: list[torch.Tensor]) -> list[Any]:
        raise NotImplementedError

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        context = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with context:
            return _decode_each(self._call, datas)


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
    interleaved [H, W, 3] and are viewed as [3, H, W].
    Colour spec sRGB turns grayscale and CMYK into 3 channels; EXIF orientation is not applied (as on
    the CPU path). An image that fails comes back as None (older releases drop it from the list
    instead; a list of the wrong length is retried one image at a time).

    On the CPU (`device="cpu"`) the same library runs its CPU backend (libjpeg-turbo) and no GPU is
    involved: that is how the GPU path is tested against the real library on machines without one.
    Whole images only: the engines decode nothing else, and 0.9's CUDA region decode fails on ordinary
    regions (NVIDIA/nvImageCodec#55).
    """

    label = "nvImageCodec"

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

    def __init__(self, device: torch.device | str) -> None:
        nv = self.load()
        self.device = torch.device(device)
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

    def _call(self, batch: list[torch.Tensor]) -> list[Any]:
        sources = [data.numpy() for data in batch]
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            images = self._decoder.decode(sources, params=self._params, cuda_stream=stream.cuda_stream)
        else:
            images = self._decoder.decode(sources, params=self._params)
        if len(images) != len(sources):  # an older release dropped the failed ones: retried one by one
            raise RuntimeError(f"nvImageCodec returned {len(images)} images for {len(sources)} inputs")
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


# ---- crop, resize, flip on the device: a whole chunk in a few kernels ----------------------------------

_WEIGHT_TEMPS = 6  # _axis_weights holds up to this many [N, n_out, n_in] float32 tensors at once


def _axis_weights(n_out: int, length: torch.Tensor, size: torch.Tensor, start: torch.Tensor, aa: torch.Tensor,
                  flip: torch.Tensor | None, n_in: int) -> torch.Tensor:
    """Resampling matrices [N, n_out, n_in] (float32) for one axis of N samples: output index i takes
    sum_x W[i, x] * input[x]. Sample k's `length[k]` input pixels (from index 0) are resized to
    `size[k]` outputs placed from `start[k]`; output rows outside stay all-zero (CenterCrop padding);
    `flip[k]` mirrors the whole output axis.

    The weights are those of `torch.nn.functional.interpolate(mode="bilinear", align_corners=False)`,
    with `antialias=aa[k]`: plain bilinear (source index clamped at 0, the last pixel repeated), or the
    antialiased triangle filter widened by the shrink factor and normalized over the pixels it covers
    (PIL's and torch's `_upsample_bilinear2d_aa`). An axis whose length equals its size is the identity."""
    dev = length.device
    i = torch.arange(n_out, device=dev, dtype=torch.float32).view(1, n_out, 1)
    x = torch.arange(n_in, device=dev, dtype=torch.float32).view(1, 1, n_in)
    length, size, start = (v.to(torch.float32).view(-1, 1, 1) for v in (length, size, start))
    if flip is not None:
        i = torch.where(flip.view(-1, 1, 1), n_out - 1 - i, i)
    local = i - start  # output index inside the sample's window
    inside = (local >= 0) & (local < size)
    scale = length / size
    # plain bilinear
    src = (scale * (local + 0.5) - 0.5).clamp_min(0)
    i0 = src.floor().clamp(max=length - 1)
    i1 = torch.where(i0 < length - 1, i0 + 1, i0)
    l1 = (src - i0).clamp(0, 1)
    plain = (x == i0) * (1 - l1) + (x == i1) * l1
    # antialiased: support and filter width grow with the shrink factor
    wide = scale >= 1
    support = torch.where(wide, scale, torch.ones_like(scale))
    invscale = torch.where(wide, 1 / scale, torch.ones_like(scale))
    center = scale * (local + 0.5)
    xmin = (center - support + 0.5).floor().clamp_min(0)
    xmax = torch.minimum((center + support + 0.5).floor(), length)
    tri = (1 - ((x - center + 0.5) * invscale).abs()).clamp_min(0) * ((x >= xmin) & (x < xmax))
    total = tri.sum(-1, keepdim=True)
    smooth = tri / torch.where(total > 0, total, torch.ones_like(total))
    weights = torch.where(aa.view(-1, 1, 1), smooth, plain)
    return weights * inside


@dataclass
class _Placed:
    """A decoded image and where its crop goes: source window (sy0, sy1, sx0, sx1), target window
    (dy0, dy1, dx0, dx1) inside the output, mirrored or not."""

    job: GpuJob
    img: torch.Tensor  # uint8 [3, h, w] on the device
    src: tuple[int, int, int, int]
    dst: tuple[int, int, int, int]

    @property
    def crop(self) -> tuple[int, int]:
        return self.src[1] - self.src[0], self.src[3] - self.src[2]


def resample_into(placed: Sequence[_Placed], out: torch.Tensor) -> None:
    """Crop, resize (bilinear, antialiased when shrinking in either axis), round, flip and store every
    sample of `placed` into its row of `out` (uint8 [B, 3, H, W], any strides): one copy per sample
    into a zero-padded float32 batch of crops, then two batched matrix products with per-sample
    resampling matrices (`_axis_weights`) and one store. Samples whose target window does not cover
    the output (padded CenterCrop) get zeros around it, as on the CPU path."""
    n = len(placed)
    if n == 0:
        return
    dev = out.device
    out_h, out_w = out.shape[2], out.shape[3]
    ch = max(p.crop[0] for p in placed)
    cw = max(p.crop[1] for p in placed)
    crops = torch.zeros((n, 3, ch, cw), dtype=torch.float32, device=dev)
    for k, p in enumerate(placed):
        sy0, sy1, sx0, sx1 = p.src
        crops[k, :, :sy1 - sy0, :sx1 - sx0].copy_(p.img[:, sy0:sy1, sx0:sx1])
    # per-sample parameters: (crop h, crop w, target h, target w, target top, target left, flip)
    params = [(*p.crop, p.dst[1] - p.dst[0], p.dst[3] - p.dst[2], p.dst[0], p.dst[2], p.job.flip) for p in placed]
    aa = [(h > th or w > tw) for h, w, th, tw, *_ in params]  # antialias both axes once either shrinks
    host = torch.tensor([list(map(int, q)) + [int(a)] for q, a in zip(params, aa)], dtype=torch.int64)
    cols = host.to(dev, non_blocking=False) if dev.type == "cpu" else host.pin_memory().to(dev, non_blocking=True)
    h, w, th, tw, ty, tx, flip, anti = cols.unbind(1)
    wy = _axis_weights(out_h, h, th, ty, anti.bool(), None, ch)
    wx = _axis_weights(out_w, w, tw, tx, anti.bool(), flip.bool(), cw)
    pixels = torch.matmul(torch.matmul(wy.unsqueeze(1), crops), wx.transpose(1, 2).unsqueeze(1))
    rows = torch.tensor([p.job.row for p in placed], dtype=torch.int64)
    rows = rows.to(dev) if dev.type == "cpu" else rows.pin_memory().to(dev, non_blocking=True)
    out.index_copy_(0, rows, pixels.round_().clamp_(0, 255).to(torch.uint8))


class GpuBatchDecoder:
    """Decode a batch's JPEGs on the GPU and write each, cropped, resized and flipped, into its row.

    Memory: jobs are decoded in chunks whose decoded size (3 * height * width bytes per image, from
    the stored sizes) stays under `budget_bytes` (at least one image per chunk); a chunk's images
    are released before the next chunk is decoded. The chunk's crops are then resampled together
    (`resample_into`) in groups whose float32 working set (the padded crops, the resampling matrices
    and the intermediate product) also stays under `budget_bytes` (at least one image per group).
    Peak GPU memory of one `run` is therefore about 2 x budget_bytes (or a single large image's
    share), plus the decoder library's own work buffers (nvJPEG keeps them between calls).
    """

    def __init__(self, decoder: GpuDecoder, device: torch.device | str, budget_bytes: int = DEFAULT_BUDGET_BYTES
                 ) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ConfigError(f"budget_bytes must be a positive int (bytes of decoded pixels), got {budget_bytes!r}")
        self.decoder = decoder
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        # a decoder that writes its outputs when called (`writes_at_call`: the hardware JPEG engines) may
        # be handed memory that queued kernels still read: it waits, on the host, for this event,
        # recorded after the last read of the previous chunk's decoded images
        self._reads_done: Any = None

    def chunks(self, jobs: Sequence[GpuJob]) -> Iterator[list[GpuJob]]:
        """Consecutive runs of jobs whose decoded bytes (3*h*w each) sum to at most budget_bytes; a job
        larger than the budget on its own gets a chunk of its own."""
        chunk: list[GpuJob] = []
        size = 0
        for job in jobs:
            nbytes = 3 * max(job.height, 0) * max(job.width, 0)
            if chunk and size + nbytes > self.budget_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(job)
            size += nbytes
        if chunk:
            yield chunk

    def groups(self, placed: list[_Placed], out_h: int, out_w: int) -> Iterator[list[_Placed]]:
        """`placed` sorted by crop size and cut where the float32 working set of `resample_into`
        (padded crops, both resampling matrices with the temporaries that build them, the
        intermediate product, the result) would pass budget_bytes."""
        group: list[_Placed] = []
        ch = cw = 0
        for p in sorted(placed, key=lambda p: p.crop):
            h, w = max(ch, p.crop[0]), max(cw, p.crop[1])
            need = 4 * (len(group) + 1) * (3 * h * w + _WEIGHT_TEMPS * (out_h * h + out_w * w) + 3 * out_h * w
                                           + 3 * out_h * out_w)
            if group and need > self.budget_bytes:
                yield group
                group, h, w = [], p.crop[0], p.crop[1]
            group.append(p)
            ch, cw = h, w
        if group:
            yield group

    def run(self, jobs: Sequence[GpuJob], out: torch.Tensor) -> list[tuple[GpuJob, Exception]]:
        """Decode `jobs` and write each into `out[job.row]` (uint8 [B, 3, H, W] on the device, any
        strides). Returns the jobs that failed, each with an exception naming its key (the caller
        decodes those on the CPU); one bad sample never raises. Call it inside the copy stream's
        context: all work is queued on the current stream."""
        self._check_out(jobs, out)
        failures: list[tuple[GpuJob, Exception]] = []
        out_h, out_w = out.shape[2], out.shape[3]
        context = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with context:
            for chunk in self.chunks(jobs):
                windows = [crop_window(job.box, job.height, job.width, job.height, job.width, out_h, out_w)
                           for job in chunk]
                if self._reads_done is not None:
                    self._reads_done.synchronize()
                    self._reads_done = None
                # Backends already retry a failed batch one image at a time; this covers any other decoder.
                images = _decode_each(self.decoder.decode, [job.data for job in chunk])
                placed: list[_Placed] = []
                for k, job in enumerate(chunk):
                    img, images[k] = images[k], None
                    try:
                        if isinstance(img, BaseException):
                            raise img
                        placed.append(self._place(job, img, windows[k], out))
                    except Exception as exc:
                        failures.append((job, self._failure(job, exc)))
                img = images = None
                for group in self.groups(placed, out_h, out_w):
                    try:
                        resample_into(group, out)
                    except Exception as exc:  # e.g. out of GPU memory: these samples go to the CPU
                        failures.extend((p.job, self._failure(p.job, exc)) for p in group)
                group = placed = None  # the chunk's decoded images are free before the next chunk is decoded
                if getattr(self.decoder, "writes_at_call", False):
                    self._reads_done = torch.cuda.Event()
                    self._reads_done.record(torch.cuda.current_stream(self.device))
        failures.sort(key=lambda f: f[0].row)
        return failures

    def _check_out(self, jobs: Sequence[GpuJob], out: torch.Tensor) -> None:
        if (not isinstance(out, torch.Tensor) or out.dim() != 4 or out.shape[1] != 3 or out.dtype != torch.uint8
                or out.device.type != self.device.type):
            got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else repr(out)
            raise ValueError(f"out must be a uint8 [B, 3, H, W] tensor on {self.device}, got {got}")
        bad = [job.row for job in jobs if not 0 <= job.row < out.shape[0]]
        if bad:
            raise ValueError(f"job rows {bad[:5]} are outside the batch of {out.shape[0]}")

    def _failure(self, job: GpuJob, exc: BaseException) -> Exception:
        if isinstance(exc, ImageError) and exc.key == job.key:
            return exc
        err = CorruptImageError(job.key, f"GPU decode ({self.decoder.name}) failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def _place(self, job: GpuJob, img: Any, win: CropWindow, out: torch.Tensor) -> _Placed:
        """Check a decoded image (uint8 [C, h, w], C 1 or 3, the stored size) and place it with the CPU
        path's crop window (`crop_window`)."""
        if (not isinstance(img, torch.Tensor) or img.dim() != 3 or img.dtype != torch.uint8
                or img.shape[0] not in (1, 3)):
            got = f"{img.dtype} {tuple(img.shape)}" if isinstance(img, torch.Tensor) else type(img).__name__
            raise ValueError(f"the decoder returned {got}; expected a uint8 [3, H, W] tensor")
        _, h, w = img.shape
        if (h, w) != (job.height, job.width):
            raise CorruptImageError(job.key, f"the GPU decoded {h}x{w} pixels, the dataset stores "
                                             f"{job.height}x{job.width} for this image")
        if img.shape[0] == 1:  # grayscale from a decoder that ignored the RGB request: a view, no copy
            img = img.expand(3, h, w)
        if img.device != out.device:
            img = img.to(out.device)
        return _Placed(job, img, win.src, win.dst)
