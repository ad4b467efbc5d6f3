"""JPEG decode on the GPU (nvJPEG), cropped and resized there with the CPU path's crop plan.

For machines whose CPU cores cannot decode fast enough: the Loader's device thread hands the JPEGs
of a batch to a `GpuDecoder` (nvJPEG through TorchCodec, or NVIDIA nvImageCodec: `gpu_backends`), then
crops each decoded image with the same integer geometry as the CPU path (`transforms.crop_window`),
then crops, resizes (`torch.nn.functional.interpolate`'s bilinear weights, as batched resampling
matrices), flips and writes a whole group of samples into their rows of the batch on the device in a
few kernels. The crop plan is the CPU's (computed from the stored sizes), so a seed gives the same
crops on both paths; only the resampling kernel differs (torch bilinear, antialiased when shrinking,
vs OpenCV bilinear/area). A decoder that says `regions` decodes only each crop's window.

`GpuBatchDecoder.run` does a batch in series; `gpu_pipeline` runs the same two halves (`decode_chunk`
on a decode thread, `resample_chunk` on the device thread) overlapped.

The decoder libraries are optional imports. A sample the GPU cannot decode is returned as a
failure, never raised, and the Loader decodes it on the CPU instead.
"""

from __future__ import annotations

import contextlib
from functools import partial
from operator import attrgetter
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from .._torch import torch
from ..errors import ConfigError, CorruptImageError, ImageError
from ..loading.jobs import GpuJob
from ..transforms import CropWindow, crop_window
from .gpu_backends import (AUTO, BACKENDS, NVIMGCODEC_CPU_THREADS, REMOVED, TORCHCODEC_MIN,  # noqa: F401
                           GpuDecoder, NvImageCodecDecoder, TorchCodecDecoder, _decode_each, make_decoder)

F = torch.nn.functional

#: Default bound on the decoded pixels held at once by `GpuBatchDecoder.run`: 256 MiB of uint8 RGB,
#: e.g. about 470 ImageNet-sized (375x500) images, or 7 twelve-megapixel photos.
DEFAULT_BUDGET_BYTES = 256 << 20

_CROP = attrgetter("crop")


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


class _Placed(NamedTuple):
    """A decoded image and where its crop goes: source window (sy0, sy1, sx0, sx1) inside `img`, target
    window (dy0, dy1, dx0, dx1) inside the output, mirrored or not; `crop` is the source window's
    (height, width)."""

    job: GpuJob
    img: torch.Tensor  # uint8 [3, h, w] on the device (the whole image, or only the crop's region)
    src: tuple[int, int, int, int]
    dst: tuple[int, int, int, int]
    crop: tuple[int, int]


_new_placed = partial(tuple.__new__, _Placed)  # a _Placed from one tuple, without a Python frame


def _dense(img: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`img` (uint8 [3, h, w]) as the 1-D block of memory it spans, with its (channel, row, column)
    strides in that block: no copy for a contiguous CHW tensor or an interleaved HWC one viewed as CHW
    (nvImageCodec's); anything else is copied once."""
    if not (img.is_contiguous() or img.permute(1, 2, 0).is_contiguous()) or img.stride(0) == 0:
        img = img.contiguous()  # e.g. a grayscale image expanded to 3 channels
    flat = img.as_strided((img.numel(),), (1,), img.storage_offset())
    return flat, (img.stride(0), img.stride(1), img.stride(2))


def _flats(imgs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], np.ndarray]:
    """`_dense` of every image: the flat blocks and int64 [N, 4] (channel, row, column strides, elements).
    When every image is a contiguous CHW image or an interleaved HWC one viewed as CHW (the usual
    outputs), each takes two calls, its strides read once; otherwise each goes through `_dense`."""
    shapes = [img.shape for img in imgs]
    strides = [img.stride() for img in imgs]
    if all([h * w and (st == (h * w, w, 1) or (c == 3 and st == (1, 3 * w, 3)))
            for (c, h, w), st in zip(shapes, strides)]):
        flats = [img.as_strided((c * h * w,), (1,)) for img, (c, h, w) in zip(imgs, shapes)]
        meta = [(*st, c * h * w) for st, (c, h, w) in zip(strides, shapes)]
    else:
        dense = [_dense(img) for img in imgs]
        flats = [flat for flat, _ in dense]
        meta = [(*st, flat.shape[0]) for flat, st in dense]
    return flats, np.array(meta, dtype=np.int64).reshape(-1, 4)


def _host_columns(cols: np.ndarray, dev: torch.device) -> torch.Tensor:
    """int64 [N, k] host columns on `dev` (pinned and asynchronous on a GPU)."""
    host = torch.from_numpy(np.ascontiguousarray(cols, dtype=np.int64))
    return host.to(dev) if dev.type == "cpu" else host.pin_memory().to(dev, non_blocking=True)


def _gather_crops(imgs: Sequence[torch.Tensor], src: np.ndarray, ch: int, cw: int, dev: torch.device
                  ) -> torch.Tensor:
    """Every sample's crop (`src`: int64 [N, 4] windows (y0, y1, x0, x1) inside `imgs`) in one float32
    batch [N, 3, ch, cw], gathered in a few kernels whatever N: the images' memory joined
    (`torch.cat`), then one indexed read. Pixels beyond a crop repeat its last row or column; the
    resampling weights there are zero."""
    flats, meta = _flats(imgs)
    base = np.zeros(len(meta), np.int64)
    np.cumsum(meta[:-1, 3], out=base[1:])
    sc, sy, sx = meta[:, 0], meta[:, 1], meta[:, 2]
    params = np.stack([base + src[:, 0] * sy + src[:, 2] * sx, sc, sy, sx, src[:, 1] - src[:, 0],
                       src[:, 3] - src[:, 2]], 1)
    joined = torch.cat(flats) if len(flats) > 1 else flats[0]
    start, sc, sy, sx, h, w = (c.view(-1, 1, 1, 1) for c in _host_columns(params, dev).unbind(1))
    c = torch.arange(3, device=dev).view(1, 3, 1, 1)
    y = torch.minimum(torch.arange(ch, device=dev).view(1, 1, ch, 1), h - 1)
    x = torch.minimum(torch.arange(cw, device=dev).view(1, 1, 1, cw), w - 1)
    index = start + c * sc + y * sy + x * sx
    return joined[index].to(torch.float32)


def resample_into(placed: Sequence[_Placed], out: torch.Tensor) -> None:
    """Crop, resize (bilinear, antialiased when shrinking in either axis), round, flip and store every
    sample of `placed` into its row of `out` (uint8 [B, 3, H, W], any strides) in a fixed number of
    kernels, never one per sample: the crops gathered into a float32 batch (`_gather_crops`), two
    batched matrix products with per-sample resampling matrices (`_axis_weights`) and one store.
    Samples whose target window does not cover the output (padded CenterCrop) get zeros around it,
    as on the CPU path."""
    n = len(placed)
    if n == 0:
        return
    dev = out.device
    out_h, out_w = out.shape[2], out.shape[3]
    # per sample, one row: source window, target window, flip, batch row
    geo = np.array([(*p.src, *p.dst, p.job.flip, p.job.row) for p in placed], dtype=np.int64).reshape(n, 10)
    src, dst = geo[:, 0:4], geo[:, 4:8]
    h, w = src[:, 1] - src[:, 0], src[:, 3] - src[:, 2]
    th, tw = dst[:, 1] - dst[:, 0], dst[:, 3] - dst[:, 2]
    ch, cw = int(h.max()), int(w.max())
    crops = _gather_crops([p.img for p in placed], src, ch, cw, dev)
    anti = (h > th) | (w > tw)  # antialias both axes once either shrinks
    cols = _host_columns(np.stack([h, w, th, tw, dst[:, 0], dst[:, 2], geo[:, 8] != 0, anti, geo[:, 9]], 1), dev)
    h, w, th, tw, ty, tx, flip, anti, rows = cols.unbind(1)
    wy = _axis_weights(out_h, h, th, ty, anti.bool(), None, ch)
    wx = _axis_weights(out_w, w, tw, tx, anti.bool(), flip.bool(), cw)
    pixels = torch.matmul(torch.matmul(wy.unsqueeze(1), crops), wx.transpose(1, 2).unsqueeze(1))
    out.index_copy_(0, rows, pixels.round_().clamp_(0, 255).to(torch.uint8))


class GpuBatchDecoder:
    """Decode a batch's JPEGs on the GPU and write each, cropped, resized and flipped, into its row.

    Memory: jobs are decoded in chunks whose decoded size (3 * height * width bytes per image, from
    the stored sizes; the crop's window only, when the decoder decodes `regions`) stays under
    `budget_bytes` (at least one image per chunk); a chunk's images are released before the next
    chunk is decoded. The chunk's crops are then resampled together (`resample_into`) in groups whose
    working set (the gathered crops and their int64 index, the resampling matrices and the
    intermediate product) also stays under `budget_bytes` (at least one image per group). Peak GPU
    memory of one `run` is therefore about 2 x budget_bytes (or a single large image's share), plus
    the decoder library's own work buffers (nvJPEG keeps them between calls).

    `run` does a batch in series: for each chunk, `decode_chunk` then `resample_chunk`.
    `gpu_pipeline.GpuPipeline` calls the two halves on two threads, overlapped.
    """

    def __init__(self, decoder: GpuDecoder, device: torch.device | str, budget_bytes: int = DEFAULT_BUDGET_BYTES
                 ) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ConfigError(f"budget_bytes must be a positive int (bytes of decoded pixels), got {budget_bytes!r}")
        self.decoder = decoder
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.regions = bool(getattr(decoder, "regions", False))
        # a decoder that writes its outputs when called (`writes_at_call`: the hardware JPEG engines) may
        # be handed memory that queued kernels still read: it waits, on the host, for this event,
        # recorded after the last read of the previous chunk's decoded images
        self._reads_done: Any = None
        self._stream: Any = None

    def decode_stream(self) -> Any:
        """The CUDA stream the pipelined path decodes on (`gpu_pipeline`), made once and kept."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def _decoded_bytes(self, job: GpuJob) -> int:
        if self.regions and job.window is not None:
            sy0, sy1, sx0, sx1 = job.window.src
            return 3 * (sy1 - sy0) * (sx1 - sx0)
        return 3 * max(job.height, 0) * max(job.width, 0)

    def chunks(self, jobs: Sequence[GpuJob]) -> Iterator[list[GpuJob]]:
        """Consecutive runs of jobs whose decoded bytes (3*h*w each) sum to at most budget_bytes; a job
        larger than the budget on its own gets a chunk of its own."""
        if self.regions:
            sizes = [3 * (w.src[1] - w.src[0]) * (w.src[3] - w.src[2]) if w is not None
                     else 3 * (h if h > 0 else 0) * (v if v > 0 else 0)
                     for w, h, v in [(job.window, job.height, job.width) for job in jobs]]
        else:   # `_decoded_bytes` of each, inline
            sizes = [3 * (h if h > 0 else 0) * (v if v > 0 else 0) for h, v in [(job.height, job.width) for job in jobs]]
        chunk: list[GpuJob] = []
        size = 0
        for job, nbytes in zip(jobs, sizes):
            if chunk and size + nbytes > self.budget_bytes:
                yield chunk
                chunk, size = [], 0
            chunk += (job,)
            size += nbytes
        if chunk:
            yield chunk

    def groups(self, placed: list[_Placed], out_h: int, out_w: int) -> Iterator[list[_Placed]]:
        """`placed` sorted by crop size and cut where the working set of `resample_into` (gathered
        float32 crops and their int64 index, both resampling matrices with the temporaries that build
        them, the intermediate product, the result) would pass budget_bytes."""
        group: list[_Placed] = []
        ch = cw = k = 0
        for p in sorted(placed, key=_CROP):
            ph, pw = p.crop
            h, w = (ch if ch > ph else ph), (cw if cw > pw else pw)
            need = 4 * (k + 1) * (9 * h * w + _WEIGHT_TEMPS * (out_h * h + out_w * w)
                                           + 3 * out_h * w + 3 * out_h * out_w)
            if group and need > self.budget_bytes:
                yield group
                group, h, w, k = [], ph, pw, 0
            group += (p,)
            k += 1
            ch, cw = h, w
        if group:
            yield group

    def _context(self) -> Any:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def run(self, jobs: Sequence[GpuJob], out: torch.Tensor) -> list[tuple[GpuJob, Exception]]:
        """Decode `jobs` and write each into `out[job.row]` (uint8 [B, 3, H, W] on the device, any
        strides). Returns the jobs that failed, each with an exception naming its key (the caller
        decodes those on the CPU); one bad sample never raises. Call it inside the copy stream's
        context: all work is queued on the current stream."""
        self._check_out(jobs, out)
        failures: list[tuple[GpuJob, Exception]] = []
        with self._context():
            for chunk in self.chunks(jobs):
                if self._reads_done is not None:
                    self._reads_done.synchronize()
                    self._reads_done = None
                placed, failed = self.decode_chunk(chunk, out.shape[2], out.shape[3])
                failures += failed
                failures += self.resample_chunk(placed, out)
                placed = None  # the chunk's decoded images are free before the next chunk is decoded
                if getattr(self.decoder, "writes_at_call", False):
                    self._reads_done = torch.cuda.Event()
                    self._reads_done.record(torch.cuda.current_stream(self.device))
        failures.sort(key=lambda f: f[0].row)
        return failures

    def decode_chunk(self, chunk: Sequence[GpuJob], out_h: int, out_w: int
                     ) -> tuple[list[_Placed], list[tuple[GpuJob, Exception]]]:
        """Decode one chunk (on the current stream): each image placed with its crop window, and the
        jobs that failed. With a `regions` decoder only each crop's window is decoded."""
        windows = [job.window or crop_window(job.box, job.height, job.width, job.height, job.width, out_h, out_w)
                   for job in chunk]
        datas = [job.data for job in chunk]
        # Backends already retry a failed batch one image at a time; this covers any other decoder.
        if self.regions:
            images = _decode_each(self.decoder.decode, datas, [(w.src[0], w.src[1], w.src[2], w.src[3])
                                                              for w in windows])
        else:
            images = _decode_each(self.decoder.decode, datas)
        # one pass over the results, reading attributes only: an image of the size expected, already on
        # the device, is placed as it is; anything else goes through `_place` (checks, grayscale, moves)
        if self.regions:
            geo = [((0, y1 - y0, 0, x1 - x0), w.dst) for w in windows for y0, y1, x0, x1 in (w.src,)]
        else:
            geo = [(w.src, w.dst) for w in windows]
        sizes = [(3, src[1], src[3]) for src, _ in geo] if self.regions else [(3, job.height, job.width)
                                                                               for job in chunk]
        dev, u8, tensor = self.device, torch.uint8, torch.Tensor
        fine = [img.__class__ is tensor and img.dtype == u8 and img.shape == size and img.device == dev
                for img, size in zip(images, sizes)]
        if all(fine):
            return [_new_placed((job, img, src, dst, (src[1] - src[0], src[3] - src[2])))
                    for job, img, (src, dst) in zip(chunk, images, geo)], []
        placed: list[_Placed] = []
        failures: list[tuple[GpuJob, Exception]] = []
        for k, job in enumerate(chunk):
            img, images[k] = images[k], None
            if fine[k]:
                src, dst = geo[k]
                placed += (_new_placed((job, img, src, dst, (src[1] - src[0], src[3] - src[2]))),)
                continue
            try:
                if isinstance(img, BaseException):
                    raise img
                placed.append(self._place(job, img, windows[k]))
            except Exception as exc:
                failures.append((job, self._failure(job, exc)))
        return placed, failures

    def resample_chunk(self, placed: list[_Placed], out: torch.Tensor) -> list[tuple[GpuJob, Exception]]:
        """Crop, resize, flip and store a decoded chunk into `out` (on the current stream), in groups
        under the budget; the samples of a group that fails (e.g. out of GPU memory) are returned."""
        failures: list[tuple[GpuJob, Exception]] = []
        for group in self.groups(placed, out.shape[2], out.shape[3]):
            try:
                resample_into(group, out)
            except Exception as exc:  # e.g. out of GPU memory: these samples go to the CPU
                failures.extend((p.job, self._failure(p.job, exc)) for p in group)
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

    def _place(self, job: GpuJob, img: Any, win: CropWindow) -> _Placed:
        """Check a decoded image (uint8 [C, h, w], C 1 or 3: the stored size, or the crop's window from
        a `regions` decoder) and place it with the CPU path's crop window (`crop_window`)."""
        if (not isinstance(img, torch.Tensor) or img.dim() != 3 or img.dtype != torch.uint8
                or img.shape[0] not in (1, 3)):
            got = f"{img.dtype} {tuple(img.shape)}" if isinstance(img, torch.Tensor) else type(img).__name__
            raise ValueError(f"the decoder returned {got}; expected a uint8 [3, H, W] tensor")
        _, h, w = img.shape
        src = win.src
        want = (src[1] - src[0], src[3] - src[2]) if self.regions else (job.height, job.width)
        if (h, w) != want:
            what = "crop window" if self.regions else "dataset stores"
            raise CorruptImageError(job.key, f"the GPU decoded {h}x{w} pixels, the {what} {want[0]}x{want[1]} "
                                             f"for this image")
        if self.regions:
            src = (0, h, 0, w)
        if img.shape[0] == 1:  # grayscale from a decoder that ignored the RGB request: a view, no copy
            img = img.expand(3, h, w)
        if img.device != self.device and self.device.type == "cuda":
            img = img.to(self.device)
        return _Placed(job, img, src, win.dst, (src[1] - src[0], src[3] - src[2]))
