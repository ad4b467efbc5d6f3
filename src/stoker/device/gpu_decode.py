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
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from .._torch import torch
from ..errors import ConfigError, CorruptImageError, ImageError
from ..loading.jobs import GpuBatch, GpuJob
from ..transforms import CropWindow, crop_window
from .gpu_backends import (AUTO, BACKENDS, NVIMGCODEC_CPU_THREADS, REMOVED, TORCHCODEC_MIN,  # noqa: F401
                           GpuDecoder, NvImageCodecDecoder, TorchCodecDecoder, _columns_each, _decode_each,
                           make_decoder)

F = torch.nn.functional
# tensors of any shapes joined into one 1-D tensor in one C call (each made dense first where it is not)
_join_flat = getattr(torch._C._nn, "flatten_dense_tensors", None) or torch._utils._flatten_dense_tensors

#: Default bound on the decoded pixels held at once by `GpuBatchDecoder.run`: 256 MiB of uint8 RGB,
#: e.g. about 470 ImageNet-sized (375x500) images, or 7 twelve-megapixel photos.
DEFAULT_BUDGET_BYTES = 256 << 20
#: The resample's working set (float32 crops, resampling matrices, products) per chunk, as a multiple of
#: the decode budget: one group per chunk, and so a fixed number of calls, for ordinary batches.
RESAMPLE_PER_BUDGET = 8


# ---- crop, resize, flip on the device: a whole chunk in a few kernels ----------------------------------

_WEIGHT_TEMPS = 4  # _axis_weights holds up to this many [N, n_out, n_in] float32 tensors at once


def _axis_weights(n_out: int, length: torch.Tensor, size: torch.Tensor, start: torch.Tensor, aa: torch.Tensor,
                  flip: torch.Tensor | None, n_in: int) -> torch.Tensor:
    """Resampling matrices [N, n_out, n_in] (float32) for one axis of N samples (every argument a
    float32 or bool tensor [N, 1, 1]): output index i takes sum_x W[i, x] * input[x]. Sample k's
    `length[k]` input pixels (from index 0) are resized to `size[k]` outputs placed from `start[k]`;
    output rows outside stay all-zero (CenterCrop padding); `flip[k]` mirrors the whole output axis.

    The weights are those of `torch.nn.functional.interpolate(mode="bilinear", align_corners=False)`,
    with `antialias=aa[k]`: plain bilinear (source index clamped at 0, the last pixel repeated), or the
    antialiased triangle filter widened by the shrink factor and normalized over the pixels it covers
    (PIL's and torch's `_upsample_bilinear2d_aa`). An axis whose length equals its size is the identity.
    A fixed number of kernels whatever N, written with operators where they give the same numbers
    (`-a + 1` for `1 - a`, `max(scale, 1)` for the support) so the Python calls stay few."""
    ar = torch.arange(max(n_out, n_in), device=length.device, dtype=torch.float32)
    i = ar[None, :n_out, None]
    x = ar[None, None, :n_in]
    if flip is not None:
        i = torch.where(flip, -i + (n_out - 1), i)
    local = i - start  # output index inside the sample's window
    inside = (local >= 0) & (local < size)
    scale = length / size
    # plain bilinear
    src = (scale * (local + 0.5) - 0.5).clamp_min(0)
    i0 = torch.minimum(src.floor(), length - 1)
    i1 = torch.where(i0 < length - 1, i0 + 1, i0)
    l1 = (src - i0).clamp(0, 1)
    plain = (x == i0) * (-l1 + 1) + (x == i1) * l1
    # antialiased: support and filter width grow with the shrink factor
    support = scale.clamp_min(1)
    invscale = support.reciprocal()
    center = scale * (local + 0.5)
    xmin = (center - support + 0.5).floor().clamp_min(0)
    xmax = torch.minimum((center + support + 0.5).floor(), length)
    tri = (-((x - center + 0.5) * invscale).abs() + 1).clamp_min(0) * ((x >= xmin) & (x < xmax))
    total = tri.sum(-1, keepdim=True)
    weights = torch.where(aa, tri / torch.where(total > 0, total, 1.0), plain)
    return weights * inside


class _Placed(NamedTuple):
    """A decoded image and where its crop goes: source window (sy0, sy1, sx0, sx1) inside `img`, target
    window (dy0, dy1, dx0, dx1) inside the output, mirrored or not; `crop` is the source window's
    (height, width). The record of one image, for tests and the per-image path; the resample reads columns."""

    job: GpuJob
    img: torch.Tensor  # uint8 [3, h, w] on the device (the whole image, or only the crop's region)
    src: tuple[int, int, int, int]
    dst: tuple[int, int, int, int]
    crop: tuple[int, int]


#: columns of `PlacedChunk.meta` (int64): where image i starts in `flat`, its (channel, row, column) strides
#: there, and its height and width
BASE, SC, SY, SX, IMG_H, IMG_W = range(6)


def layout_meta(heights: np.ndarray, widths: np.ndarray, layout: str) -> np.ndarray:
    """int64 [k, 6] `PlacedChunk.meta` of k images of `heights` x `widths` laid out back to back in one
    flat buffer, each planar ("chw") or interleaved ("hwc")."""
    h, w = heights.astype(np.int64), widths.astype(np.int64)
    meta = np.empty((len(h), 6), np.int64)
    size = 3 * h * w
    meta[:, BASE] = np.cumsum(size) - size
    if layout == "hwc":
        meta[:, SC], meta[:, SY], meta[:, SX] = 1, 3 * w, 3
    else:
        meta[:, SC], meta[:, SY], meta[:, SX] = h * w, w, 1
    meta[:, IMG_H], meta[:, IMG_W] = h, w
    return meta


class PlacedChunk:
    """A decoded chunk as columns: its images' pixels in one flat uint8 tensor on the device (`flat`),
    image i (row `pos[i]` of `batch`) at `meta[i]` (`layout_meta`: start, strides, height, width), its
    crop's source window `src[i]` inside the image and target window `dst[i]` (int64 [k, 4]). No object
    per image: the resample reads the columns. Iterating (for tests and error paths) gives `_Placed`
    records, each image a strided view of `flat`."""

    __slots__ = ("batch", "pos", "flat", "meta", "src", "dst")

    def __init__(self, batch: GpuBatch, pos: np.ndarray, flat: torch.Tensor, meta: np.ndarray, src: np.ndarray,
                 dst: np.ndarray) -> None:
        self.batch, self.pos, self.flat, self.meta, self.src, self.dst = batch, pos, flat, meta, src, dst

    def __len__(self) -> int:
        return len(self.pos)

    def __iter__(self) -> Iterator[_Placed]:
        job, flat = self.batch.job, self.flat
        return iter([_Placed(job(i), flat.as_strided((3, m[IMG_H], m[IMG_W]), (m[SC], m[SY], m[SX]), m[BASE]),
                             tuple(s), tuple(d), (s[1] - s[0], s[3] - s[2]))
                     for i, m, s, d in zip(self.pos.tolist(), self.meta.tolist(), self.src.tolist(),
                                           self.dst.tolist())])

    def take(self, sel: np.ndarray) -> "PlacedChunk":
        return PlacedChunk(self.batch, self.pos[sel], self.flat, self.meta[sel], self.src[sel], self.dst[sel])

    def jobs(self) -> list[GpuJob]:
        job = self.batch.job
        return [job(i) for i in self.pos.tolist()]

    @staticmethod
    def of(placed: "PlacedChunk | Sequence[_Placed]") -> "PlacedChunk":
        """`_Placed` records as columns: each image copied planar into one flat tensor (one call per image:
        the per-image form, for tests)."""
        if isinstance(placed, PlacedChunk):
            return placed
        n = len(placed)
        batch = GpuBatch.of_jobs([p.job for p in placed])
        imgs = [p.img.expand(3, -1, -1) if p.img.shape[0] == 1 else p.img for p in placed]
        meta = layout_meta(np.array([i.shape[1] for i in imgs], np.int64),
                           np.array([i.shape[2] for i in imgs], np.int64), "chw")
        flat = torch.cat([i.reshape(-1) for i in imgs]) if n else torch.empty(0, dtype=torch.uint8)
        return PlacedChunk(batch, np.arange(n, dtype=np.int64), flat, meta,
                           np.array([p.src for p in placed], np.int64).reshape(n, 4),
                           np.array([p.dst for p in placed], np.int64).reshape(n, 4))


#: columns uploaded once per group by `resample_into` (int64): the crop's start in `flat` and strides, its
#: size, the target window's size and corner, flip, antialias, batch row
_G_START, _G_SC, _G_SY, _G_SX, _G_H, _G_W, _G_TH, _G_TW, _G_TY, _G_TX, _G_FLIP, _G_AA, _G_ROW = range(13)


def _upload(cols: np.ndarray, dev: torch.device) -> torch.Tensor:
    """int64 host columns on `dev` (pinned and asynchronous on a GPU)."""
    host = torch.from_numpy(cols)
    return host.to(dev) if dev.type == "cpu" else host.pin_memory().to(dev, non_blocking=True)


def resample_into(placed: "PlacedChunk | Sequence[_Placed]", out: torch.Tensor) -> None:
    """Crop, resize (bilinear, antialiased when shrinking in either axis), round, flip and store every
    sample of `placed` into its row of `out` (uint8 [B, 3, H, W], any strides) in a fixed number of
    kernels and Python calls, never one per sample: the group's columns uploaded in one copy, every crop
    gathered from the flat buffer into one float32 batch by one indexed read (pixels beyond a crop
    repeat its last row or column; their weights are zero), two batched matrix products with per-sample
    resampling matrices (`_axis_weights`) and one store. Samples whose target window does not cover
    the output (padded CenterCrop) get zeros around it, as on the CPU path."""
    cols = PlacedChunk.of(placed)
    k = len(cols)
    if not k:
        return
    dev = out.device
    out_h, out_w = out.shape[2], out.shape[3]
    src, dst, meta, pos = cols.src, cols.dst, cols.meta, cols.pos
    host = np.empty((k, 13), np.int64)
    host[:, _G_START] = meta[:, BASE] + src[:, 0] * meta[:, SY] + src[:, 2] * meta[:, SX]
    host[:, _G_SC:_G_SX + 1] = meta[:, SC:SX + 1]
    host[:, _G_H], host[:, _G_W] = src[:, 1] - src[:, 0], src[:, 3] - src[:, 2]
    host[:, _G_TH], host[:, _G_TW] = dst[:, 1] - dst[:, 0], dst[:, 3] - dst[:, 2]
    host[:, _G_TY], host[:, _G_TX] = dst[:, 0], dst[:, 2]
    host[:, _G_FLIP], host[:, _G_ROW] = cols.batch.flip[pos], cols.batch.rows[pos]
    # antialias both axes once either shrinks
    host[:, _G_AA] = (host[:, _G_H] > host[:, _G_TH]) | (host[:, _G_W] > host[:, _G_TW])
    ch, cw = host[:, _G_H:_G_W + 1].max(0).tolist()
    g = _upload(host, dev)
    c4 = g[:, :, None, None, None]   # column j as [k, 1, 1, 1]: c4[:, j]
    ar = torch.arange(max(ch, cw, 3), device=dev)
    y = torch.minimum(ar[None, None, :ch, None], c4[:, _G_H] - 1)
    x = torch.minimum(ar[None, None, None, :cw], c4[:, _G_W] - 1)
    index = c4[:, _G_START] + ar[None, :3, None, None] * c4[:, _G_SC] + y * c4[:, _G_SY] + x * c4[:, _G_SX]
    crops = cols.flat[index].to(torch.float32)
    f = g.to(torch.float32)[:, :, None, None]   # column j as float32 [k, 1, 1]: f[:, j]
    aa = f[:, _G_AA] > 0
    wy = _axis_weights(out_h, f[:, _G_H], f[:, _G_TH], f[:, _G_TY], aa, None, ch)
    wx = _axis_weights(out_w, f[:, _G_W], f[:, _G_TW], f[:, _G_TX], aa, f[:, _G_FLIP] > 0, cw)
    pixels = torch.matmul(torch.matmul(wy[:, None], crops), wx.transpose(1, 2)[:, None])
    out.index_copy_(0, g[:, _G_ROW], pixels.round_().clamp_(0, 255).to(torch.uint8))


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

    def __init__(self, decoder: GpuDecoder, device: torch.device | str, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 resample_budget_bytes: int | None = None) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ConfigError(f"budget_bytes must be a positive int (bytes of decoded pixels), got {budget_bytes!r}")
        if resample_budget_bytes is not None and (not isinstance(resample_budget_bytes, int)
                                                  or resample_budget_bytes < 1):
            raise ConfigError(f"resample_budget_bytes must be a positive int (bytes of the resample's working set) "
                              f"or None (RESAMPLE_PER_BUDGET times budget_bytes), got {resample_budget_bytes!r}")
        self.decoder = decoder
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.resample_budget_bytes = (RESAMPLE_PER_BUDGET * budget_bytes if resample_budget_bytes is None
                                      else resample_budget_bytes)
        self.regions = bool(getattr(decoder, "regions", False))
        # decode_columns: the library's per-image work stays inside its call (`gpu_backends.GpuDecoder`)
        self._columns = getattr(decoder, "decode_columns", None)
        self.layout = str(getattr(decoder, "layout", "chw")) if self._columns is not None else "chw"
        if self.layout not in ("chw", "hwc"):
            raise ConfigError(f"the GPU decoder's layout must be 'chw' or 'hwc', got {self.layout!r}")
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

    def _decoded_bytes(self, batch: GpuBatch) -> np.ndarray:
        """int64 [k]: the decoded bytes of each row (3*h*w; the crop's window with `regions`, where known)."""
        full = 3 * np.maximum(batch.heights, 0) * np.maximum(batch.widths, 0)
        if not self.regions:
            return full
        src = batch.src
        return np.where(batch.planned, 3 * (src[:, 1] - src[:, 0]) * (src[:, 3] - src[:, 2]), full)

    def chunks(self, jobs: "GpuBatch | Sequence[GpuJob]") -> Iterator[GpuBatch]:
        """Consecutive runs of rows whose decoded bytes (3*h*w each) sum to at most budget_bytes; a row
        larger than the budget on its own gets a chunk of its own. Each run is a `GpuBatch`."""
        if not isinstance(jobs, GpuBatch):
            if not jobs:   # a batch the CPU renders whole
                return
            jobs = GpuBatch.of_jobs(jobs)
        batch = jobs
        budget, start, size, n = self.budget_bytes, 0, 0, len(batch.rows)
        for k, nbytes in enumerate(self._decoded_bytes(batch).tolist()):
            if k > start and size + nbytes > budget:
                yield batch.take(slice(start, k))
                start, size = k, 0
            size += nbytes
        if start < n:
            yield batch if start == 0 else batch.take(slice(start, n))

    def groups(self, placed: "PlacedChunk | Sequence[_Placed]", out_h: int, out_w: int) -> Iterator[PlacedChunk]:
        """`placed` sorted by crop size and cut where the working set of `resample_into` (gathered
        float32 crops and their int64 index, both resampling matrices with the temporaries that build
        them, the intermediate product, the result) would pass the resample budget
        (`resample_budget_bytes`): one group, a fixed number of calls, while the chunk fits."""
        cols = PlacedChunk.of(placed)
        if not len(cols):
            return
        src = cols.src
        hs, ws = src[:, 1] - src[:, 0], src[:, 3] - src[:, 2]
        order = np.lexsort((ws, hs))   # by (height, width), stable: sorted() by `crop`
        cut: list[int] = []
        ch = cw = k = 0
        for i, (ph, pw) in enumerate(zip(hs[order].tolist(), ws[order].tolist())):
            h, w = (ch if ch > ph else ph), (cw if cw > pw else pw)
            need = 4 * (k + 1) * (9 * h * w + _WEIGHT_TEMPS * (out_h * h + out_w * w)
                                           + 3 * out_h * w + 3 * out_h * out_w)
            if k and need > self.resample_budget_bytes:
                cut.append(i)
                h, w, k = ph, pw, 0
            k += 1
            ch, cw = h, w
        if not cut:
            yield cols.take(order)
            return
        bounds = [0, *cut, len(order)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            yield cols.take(order[a:b])

    def _context(self) -> Any:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def run(self, jobs: "GpuBatch | Sequence[GpuJob]", out: torch.Tensor) -> list[tuple[GpuJob, Exception]]:
        """Decode `jobs` (GpuJobs, or a `GpuBatch` of rows) and write each into `out[row]` (uint8
        [B, 3, H, W] on the device, any strides). Returns the jobs that failed, each with an exception
        naming its key (the caller decodes those on the CPU); one bad sample never raises. Call it
        inside the copy stream's context: all work is queued on the current stream."""
        batch = GpuBatch.of_jobs(jobs)
        self._check_out(batch, out)
        failures: list[tuple[GpuJob, Exception]] = []
        with self._context():
            for chunk in self.chunks(batch):
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

    def _plan(self, chunk: GpuBatch, out_h: int, out_w: int) -> None:
        """The crop windows of rows made without one (`crop_window`, one row at a time, as they were)."""
        for i in np.flatnonzero(chunk.planned == 0).tolist():
            job = chunk.job(i)
            win = crop_window(job.box, job.height, job.width, job.height, job.width, out_h, out_w)
            chunk.src[i], chunk.dst[i], chunk.padded[i] = win.src, win.dst, win.padded
            chunk.planned[i] = 1

    def decode_chunk(self, chunk: "GpuBatch | Sequence[GpuJob]", out_h: int, out_w: int
                     ) -> tuple[PlacedChunk, list[tuple[GpuJob, Exception]]]:
        """Decode one chunk (on the current stream): its images joined into one flat buffer and placed
        with their crop windows, as columns (`PlacedChunk`), and the jobs that failed. With a `regions`
        decoder only each crop's window is decoded.

        A fixed number of calls whatever the rows, where the decoder has `decode_columns` and every image
        comes back as expected: one decoder call on the chunk's buffer, one pass reading the results'
        attributes, one call joining them (`flatten_dense_tensors`: no per-image call). A `GpuJob` is
        made only for a row that fails or needs the per-image checks (`_one`)."""
        if not isinstance(chunk, GpuBatch):
            chunk = GpuBatch.of_jobs(chunk)
        if 0 in chunk.planned:
            chunk = chunk.copy()
            self._plan(chunk, out_h, out_w)
        src = chunk.src
        if self.regions:
            hs, ws = src[:, 1] - src[:, 0], src[:, 3] - src[:, 2]
            at = np.zeros_like(src)   # the crop's window inside the decoded region
            at[:, 1], at[:, 3] = hs, ws
        else:
            hs, ws, at = chunk.heights, chunk.widths, src
        outs, layout = self._decode(chunk)
        # one pass reading attributes only: an image of the shape expected, already on the device, is
        # taken as it is; anything else goes through `_one` (checks, grayscale, moves) or fails
        dev, u8, tensor = self.device, torch.uint8, torch.Tensor
        three = [3] * len(outs)
        want = zip(hs.tolist(), ws.tolist(), three) if layout == "hwc" else zip(three, hs.tolist(), ws.tolist())
        fine = [o.__class__ is tensor and o.dtype == u8 and o.shape == e and o.device == dev
                for o, e in zip(outs, want)]
        failures: list[tuple[GpuJob, Exception]] = []
        if all(fine):
            pos = np.arange(len(outs), dtype=np.int64)
        else:
            at = at.copy()
            for k in np.flatnonzero(~np.array(fine, bool)).tolist():
                job = chunk.job(k)
                try:
                    outs[k], at[k] = self._one(job, outs[k], chunk, k, layout)
                except Exception as exc:
                    failures.append((job, self._failure(job, exc)))
                    outs[k] = None
            keep = [k for k, o in enumerate(outs) if o is not None]
            pos = np.array(keep, dtype=np.int64)
            outs = [outs[k] for k in keep]
        flat = _join_flat(outs) if outs else torch.empty(0, dtype=torch.uint8, device=dev)
        return PlacedChunk(chunk, pos, flat, layout_meta(hs[pos], ws[pos], layout), at[pos], chunk.dst[pos]), failures

    def _decode(self, chunk: GpuBatch) -> tuple[list, str]:
        """The decoder's results for `chunk`, one per row, and their layout: `decode_columns` on the
        chunk's buffer where the decoder has it and the rows are columns; else the list API (`decode`),
        its [3, H, W] images ("chw")."""
        regions = chunk.src if self.regions else None
        if self._columns is not None and chunk.data is not None:
            return _columns_each(self._columns, chunk.data, chunk.spans, regions), self.layout
        wins = None if regions is None else list(map(tuple, regions.tolist()))
        # Backends already retry a failed batch one image at a time; this covers any other decoder.
        return _decode_each(self.decoder.decode, chunk.datas, wins), "chw"

    def _one(self, job: GpuJob, out: Any, chunk: GpuBatch, k: int, layout: str) -> tuple[torch.Tensor, np.ndarray]:
        """Row k's result that the one pass did not take: checked (`_place`) and laid out as `layout`, with
        its crop's window in it; raises what fails it."""
        if isinstance(out, BaseException):
            raise out
        if layout == "hwc" and isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[2] in (1, 3):
            out = out.permute(2, 0, 1)
        win = job.window if job.window is not None else CropWindow(
            tuple(chunk.src[k].tolist()), tuple(chunk.dst[k].tolist()), bool(chunk.padded[k]))
        p = self._place(job, out, win)
        img = p.img if p.img.device == self.device else p.img.to(self.device)
        return (img.permute(1, 2, 0) if layout == "hwc" else img), np.array(p.src, np.int64)

    def resample_chunk(self, placed: "PlacedChunk | Sequence[_Placed]", out: torch.Tensor
                       ) -> list[tuple[GpuJob, Exception]]:
        """Crop, resize, flip and store a decoded chunk into `out` (on the current stream), in groups
        under the budget; the samples of a group that fails (e.g. out of GPU memory) are returned."""
        failures: list[tuple[GpuJob, Exception]] = []
        for group in self.groups(placed, out.shape[2], out.shape[3]):
            try:
                resample_into(group, out)
            except Exception as exc:  # e.g. out of GPU memory: these samples go to the CPU
                failures.extend((job, self._failure(job, exc)) for job in group.jobs())
        return failures

    def _check_out(self, jobs: "GpuBatch | Sequence[GpuJob]", out: torch.Tensor) -> None:
        if (not isinstance(out, torch.Tensor) or out.dim() != 4 or out.shape[1] != 3 or out.dtype != torch.uint8
                or out.device.type != self.device.type):
            got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else repr(out)
            raise ValueError(f"out must be a uint8 [B, 3, H, W] tensor on {self.device}, got {got}")
        rows = GpuBatch.of_jobs(jobs).rows
        bad = rows[(rows < 0) | (rows >= out.shape[0])].tolist()
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
