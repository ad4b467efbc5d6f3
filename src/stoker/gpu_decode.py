"""JPEG decode on the GPU (nvJPEG), cropped and resized there with the CPU path's crop plan.

For machines whose CPU cores cannot decode fast enough: the Loader's device thread hands the JPEGs
of a batch to a `GpuDecoder` (nvJPEG through torchvision or NVIDIA nvImageCodec), then crops each
decoded image with the same integer geometry as the CPU path (`transforms.crop_window`), then crops,
resizes (`torch.nn.functional.interpolate`'s bilinear weights, as batched resampling matrices), flips
and writes a whole group of samples into their rows of the batch on the device in a few kernels. The crop plan is the CPU's (computed from the stored sizes), so a seed gives the same crops
on both paths; only the resampling kernel differs (torch bilinear, antialiased when shrinking, vs
OpenCV bilinear/area).

Both decoder libraries are optional imports. A sample the GPU cannot decode is returned as a
failure, never raised, and the Loader decodes it on the CPU instead.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from ._torch import torch
from .codecs import encode_jpeg
from .errors import ConfigError, CorruptImageError, ImageError
from .transforms import crop_window

F = torch.nn.functional

#: Accepted values of `gpu_decoder` / `make_decoder(backend=...)`.
BACKENDS = ("auto", "torchvision", "nvimgcodec", "nvimgcodec-cuda")
#: Default bound on the decoded pixels held at once by `GpuBatchDecoder.run`: 256 MiB of uint8 RGB,
#: e.g. about 470 ImageNet-sized (375x500) images, or 7 twelve-megapixel photos.
DEFAULT_BUDGET_BYTES = 256 << 20
#: The first torchvision whose decode_jpeg takes a list and batches it on the GPU.
TORCHVISION_MIN = (0, 19)


@dataclass
class GpuJob:
    """One JPEG for the GPU: where it goes and how it is cropped (a row of the CPU crop plan)."""

    row: int  # row of the batch this sample goes to
    data: torch.Tensor  # 1-D uint8 CPU tensor, writable: the JPEG file bytes
    box: tuple[float, float, float, float]  # crop (top, left, height, width) in full-image pixels (Plan.box row)
    flip: bool  # mirror left-right after resizing
    height: int  # stored full-image size, pixels
    width: int
    key: str  # names the sample in error messages


@runtime_checkable
class GpuDecoder(Protocol):
    """What `GpuBatchDecoder` needs from a decoder library."""

    name: str  # e.g. "torchvision 0.26.0 nvJPEG"

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
        outs = list(call([datas[i] for i in todo]))
        if len(outs) != len(todo):
            raise RuntimeError(f"the decoder returned {len(outs)} images for {len(todo)} inputs")
    except Exception as exc:
        if len(todo) == 1:
            outs = [exc]
        else:
            outs = []
            for i in todo:
                try:
                    one = list(call([datas[i]]))
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


def _torchvision_install() -> str:
    return f"pip install torchvision (the build matching torch {torch.__version__}, from the same index as torch)"


def _nvimgcodec_install() -> str:
    cuda = torch.version.cuda
    if cuda:
        major = cuda.split(".")[0]
        return f"pip install nvidia-nvimgcodec-cu{major} (CUDA {major}, like this torch)"
    return "pip install nvidia-nvimgcodec-cu12 or nvidia-nvimgcodec-cu13 (the one matching your CUDA)"


def _torchvision_hint() -> str:
    return f"Fix: {_torchvision_install()}, or use decode='cpu'"


def _nvimgcodec_hint() -> str:
    return f"Fix: {_nvimgcodec_install()}, or use decode='cpu'"


class _Backend:
    """What both library backends share: `_call(list) -> list` on their device, retried one image at a
    time when a batched call fails, so one bad sample never fails the others."""

    device: torch.device

    def _call(self, batch: list[torch.Tensor]) -> list[Any]:
        raise NotImplementedError

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        with torch.cuda.device(self.device):
            return _decode_each(self._call, datas)


class TorchvisionDecoder(_Backend):
    """nvJPEG through `torchvision.io.decode_jpeg(list, mode=RGB, device="cuda")` (torchvision >= 0.19).

    How torchvision runs it (torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp): one process-wide
    decoder behind a mutex; baseline JPEGs go to nvJPEG's batched decoder (the hardware JPEG engine on
    A100/H100-class GPUs), others (progressive) one at a time through its hybrid path; the work runs
    on a private CUDA stream and **the call blocks the calling thread** (cudaStreamSynchronize) until
    the batch is decoded; the result is then ordered before later work on the current stream. RGB
    mode turns grayscale into 3 channels. EXIF orientation is not applied on the GPU. One bad image
    fails the whole call (RuntimeError "Error while decoding JPEG images: ..."), so a failed batch is
    retried one image at a time.

    The outputs are allocated on the caller's current stream but written from the private stream,
    which does not wait for the caller's stream (pytorch/vision#9606): a block the caching allocator
    recycles may still be read by kernels queued on that stream. So the call runs with a dedicated
    decode stream current (made once, kept): its pool only ever holds decoded images, nothing queued
    on it reads them, and each output is marked `record_stream(caller's stream)`, so its block is
    recycled only once the caller's work on it has run. The caller's stream then waits for the
    decode stream (`wait_stream`, on the GPU): no host synchronization of stoker's own.
    """

    label = "torchvision"

    @staticmethod
    def load() -> Any:
        """torchvision.io, or a ConfigError with the install hint (touches no GPU)."""
        try:
            tv = importlib.import_module("torchvision")
            tv_io = importlib.import_module("torchvision.io")
        except Exception as exc:  # missing (ImportError), or built for another torch (RuntimeError: operator ...)
            raise ConfigError(f"gpu_decoder='torchvision' needs a torchvision that imports with this torch "
                              f"({type(exc).__name__}: {exc}). {_torchvision_hint()}") from None
        version = getattr(tv, "__version__", "0")
        if _version(version) < TORCHVISION_MIN:
            raise ConfigError(f"torchvision {version} cannot batch JPEG decodes on the GPU; "
                              f"{'.'.join(map(str, TORCHVISION_MIN))} or newer can. {_torchvision_hint()}")
        return tv_io

    @staticmethod
    def hint() -> str:
        return _torchvision_hint()

    def __init__(self, device: torch.device) -> None:
        tv_io = self.load()
        self.device = device
        self.name = f"torchvision {importlib.import_module('torchvision').__version__} nvJPEG"
        self._decode_jpeg = tv_io.decode_jpeg
        self._rgb = tv_io.ImageReadMode.RGB
        self._stream = torch.cuda.Stream(device=device)  # the decode stream (see the class docstring)

    def _call(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        caller = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            outs = self._decode_jpeg(batch, mode=self._rgb, device=self.device)
        caller.wait_stream(self._stream)
        for out in outs:
            out.record_stream(caller)
        return outs



class NvImageCodecDecoder(_Backend):
    """nvJPEG (and nvImageCodec's other JPEG backends) through `nvidia.nvimgcodec.Decoder`.

    The batch is decoded with `cuda_stream=` the current stream, so the pixels are ready for work
    queued after it on that stream (no extra wait). Output buffers are nvImageCodec's own (allocated
    on that stream, outside PyTorch's caching allocator) and freed on that stream when the tensors
    wrapping them are released. Images come back interleaved [H, W, 3] and are viewed as [3, H, W].
    Colour spec RGB turns grayscale into 3 channels; EXIF orientation is not applied (as on the CPU
    path). An image that fails comes back as None (older releases drop it from the list instead; a
    list of the wrong length is retried one image at a time).
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

    hardware = False  # NvImageCodecHardwareDecoder: the GPU's hardware JPEG engines first

    def __init__(self, device: torch.device) -> None:
        nvimgcodec = self.load()
        self.device = device
        version = getattr(nvimgcodec, "__version__", "")
        kinds = getattr(nvimgcodec, "BackendKind", None)
        if kinds is None or not hasattr(nvimgcodec, "Backend"):  # an early release: its default backends
            backends = None
        elif self.hardware:  # what the hardware engine cannot take (progressive JPEGs) goes to the CUDA ones
            backends = [nvimgcodec.Backend(kinds.HW_GPU_ONLY), nvimgcodec.Backend(kinds.GPU_ONLY),
                        nvimgcodec.Backend(kinds.HYBRID_CPU_GPU)]
        else:
            backends = [nvimgcodec.Backend(kinds.GPU_ONLY), nvimgcodec.Backend(kinds.HYBRID_CPU_GPU)]
        kind = "" if backends is None else " hardware JPEG" if self.hardware else " CUDA"
        self.name = f"nvImageCodec {version}".rstrip() + kind
        if backends is None:
            self._decoder = nvimgcodec.Decoder(device_id=device.index)
        else:
            self._decoder = nvimgcodec.Decoder(device_id=device.index, backends=backends)
        try:
            self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.RGB,
                                                   allow_any_depth=False)
        except TypeError:  # a release whose constructor takes other arguments: set the properties
            self._params = nvimgcodec.DecodeParams()
            self._params.apply_exif_orientation = False
            self._params.color_spec = nvimgcodec.ColorSpec.RGB

    def _call(self, batch: list[torch.Tensor]) -> list[Any]:
        stream = torch.cuda.current_stream(self.device)
        images = self._decoder.decode([d.numpy() for d in batch], params=self._params, cuda_stream=stream.cuda_stream)
        out: list[Any] = []
        for img in images:
            if img is None:
                out.append(RuntimeError("nvImageCodec could not decode this image (its log says why)"))
            else:  # torch keeps the Image alive while the tensor lives
                out.append(torch.as_tensor(img, device=self.device).permute(2, 0, 1))
        return out



class NvImageCodecHardwareDecoder(NvImageCodecDecoder):
    """nvImageCodec with the GPU's hardware JPEG decode engines first (A100, H100, H200 and other GPUs
    that have them; elsewhere nvImageCodec passes every image on to its CUDA backends)."""

    label = "nvImageCodec (hardware JPEG)"
    hardware = True


def _synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)


class MeasuredDecoder:
    """gpu_decoder="auto" with more than one working backend: the first batch is decoded by every
    candidate, each timed from start to finish on the GPU (the device is synchronized around each:
    a one-time cost, at first use), and the fastest that decoded the most images decodes everything
    from then on. `name` says which one runs and what was measured; `timings` holds ms per image."""

    def __init__(self, candidates: Sequence[GpuDecoder], device: torch.device,
                 synchronize: Any = _synchronize, clock: Any = time.perf_counter) -> None:
        self.candidates = list(candidates)
        self.device = device
        self.chosen: GpuDecoder | None = None
        self.timings: dict[str, float] = {}
        self._sync, self._clock = synchronize, clock
        self.name = "auto, not measured yet: " + " or ".join(c.name for c in self.candidates)

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        if self.chosen is not None:
            return self.chosen.decode(datas)
        best: tuple[int, float] | None = None
        result: list[Any] = []
        for cand in self.candidates:
            self._sync(self.device)
            t0 = self._clock()
            outs = cand.decode(datas)
            self._sync(self.device)
            seconds = self._clock() - t0
            self.timings[cand.name] = 1000 * seconds / max(1, len(datas))
            rank = (-sum(not isinstance(o, BaseException) for o in outs), seconds)
            if best is None or rank < best:
                best, result, self.chosen = rank, outs, cand
        assert self.chosen is not None
        measured = ", ".join(f"{n} {ms:.3f}" for n, ms in self.timings.items())
        self.name = f"{self.chosen.name} (auto: fastest on the first {len(datas)} images, ms/image: {measured})"
        return result


def _cuda_device(device: Any) -> torch.device:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ConfigError(f"GPU JPEG decode needs a CUDA device, got {dev}; use decode='cpu'")
    if not torch.cuda.is_available():
        raise ConfigError(f"GPU JPEG decode needs CUDA, and this torch ({torch.__version__}) sees no CUDA GPU: install "
                          f"a CUDA build of torch, or use decode='cpu'")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def make_decoder(backend: str, device: torch.device | str | int) -> GpuDecoder:
    """A working GPU JPEG decoder on `device` (a CUDA device).

    backend: "torchvision", "nvimgcodec" (the hardware JPEG engines first where the GPU has them),
    "nvimgcodec-cuda" (nvImageCodec's CUDA decoders only), or "auto": every one of them that works
    here, and when more than one does, the fastest on the first batch (`MeasuredDecoder`), so the
    choice follows the machine, not what happens to be installed. Each backend decodes a probe image
    once here, so a broken install fails now with a ConfigError that names the fix (the pip install
    command), not later on every sample."""
    if backend not in BACKENDS:
        raise ConfigError(f"gpu_decoder must be one of {BACKENDS}, got {backend!r}")
    kinds: list[Any] = {"torchvision": [TorchvisionDecoder], "nvimgcodec": [NvImageCodecHardwareDecoder],
                        "nvimgcodec-cuda": [NvImageCodecDecoder],
                        "auto": [TorchvisionDecoder, NvImageCodecHardwareDecoder, NvImageCodecDecoder]}[backend]
    reasons: list[str] = []
    importable = []
    for kind in kinds:  # imports first: a missing library is named even on a machine without a GPU
        try:
            kind.load()
            importable.append(kind)
        except ConfigError as exc:
            reasons.append(str(exc))
    working: list[GpuDecoder] = []
    if importable:
        dev = _cuda_device(device)
        for kind in importable:
            try:
                decoder = kind(dev)
                _check_backend(decoder, kind.label, kind.hint())
                working.append(decoder)
            except ConfigError as exc:
                reasons.append(str(exc))
            except Exception as exc:  # the library imported but cannot start (driver, CUDA mismatch)
                reasons.append(f"{kind.label} could not start on {dev}: {type(exc).__name__}: {exc}. {kind.hint()}")
        if len(working) == 1:
            return working[0]
        if working:
            return MeasuredDecoder(working, dev)
    if len(reasons) == 1:
        raise ConfigError(reasons[0])
    raise ConfigError("decode='gpu' found no working GPU JPEG decoder:\n  - " + "\n  - ".join(reasons) +
                      f"\nInstall one: {_torchvision_install()}; or {_nvimgcodec_install()}. Or use decode='cpu'.")


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
                images = self._decode(chunk)
                placed: list[_Placed] = []
                for k, job in enumerate(chunk):
                    img, images[k] = images[k], None
                    try:
                        if isinstance(img, BaseException):
                            raise img
                        placed.append(self._place(job, img, out))
                    except Exception as exc:
                        failures.append((job, self._failure(job, exc)))
                img = images = None
                for group in self.groups(placed, out_h, out_w):
                    try:
                        resample_into(group, out)
                    except Exception as exc:  # e.g. out of GPU memory: these samples go to the CPU
                        failures.extend((p.job, self._failure(p.job, exc)) for p in group)
                group = placed = None  # the chunk's decoded images are free before the next chunk is decoded
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

    def _decode(self, chunk: list[GpuJob]) -> list[Any]:
        # Backends already retry a failed batch one image at a time; this covers any other decoder.
        return _decode_each(self.decoder.decode, [job.data for job in chunk])

    def _failure(self, job: GpuJob, exc: BaseException) -> Exception:
        if isinstance(exc, ImageError) and exc.key == job.key:
            return exc
        err = CorruptImageError(job.key, f"GPU decode ({self.decoder.name}) failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def _place(self, job: GpuJob, img: Any, out: torch.Tensor) -> _Placed:
        """Check a decoded image (uint8 [C, h, w], C 1 or 3, the stored size) and plan its crop with the
        CPU path's integer geometry (`crop_window`), the whole image being the decoded source."""
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
        win = crop_window(job.box, h, w, h, w, out.shape[2], out.shape[3])
        return _Placed(job, img, win.src, win.dst)
