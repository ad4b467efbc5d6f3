"""JPEG decode on the GPU (nvJPEG), cropped and resized there with the CPU path's crop plan.

For machines whose CPU cores cannot decode fast enough: the Loader's device thread hands the JPEGs
of a batch to a `GpuDecoder` (nvJPEG through TorchCodec, or NVIDIA nvImageCodec: `gpu_backends`), then
crops each decoded image with the same integer geometry as the CPU path (`transforms.crop_window`),
then crops, resizes (the weights of `torch.nn.functional.interpolate(antialias=True)`, as batched
resampling matrices), flips and writes a whole chunk of samples into their rows of the batch on the
device in a fixed number of kernels and Python calls. The crop plan is the CPU's (computed from the
stored sizes), so a seed gives the same crops on both paths; only the resampling kernel differs (torch's
antialiased bilinear, plain bilinear where an axis grows, vs OpenCV bilinear/area). A decoder that says
`regions` decodes only each crop's window.

`GpuBatchDecoder.run` does a batch in series; `gpu_pipeline` runs the same two halves (`decode_chunk`
on a decode thread, `resample_chunk` on the device thread) overlapped.

The decoder libraries are optional imports. A sample the GPU cannot decode is returned as a
failure, never raised, and the Loader decodes it on the CPU instead.
"""

from __future__ import annotations

import contextlib
from itertools import repeat
from operator import attrgetter
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from .._torch import torch
from ..errors import ConfigError, CorruptImageError, ImageError
from ..loading.jobs import HEIGHT, WIDTH, GpuBatch, GpuJob
from ..transforms import CropWindow, crop_window
from .gpu_backends import (AUTO, BACKENDS, NVIMGCODEC_CPU_THREADS, REMOVED, TORCHCODEC_MIN,  # noqa: F401
                           GpuDecoder, NvImageCodecDecoder, TorchCodecDecoder, _columns_each, _decode_each,
                           make_decoder)

# what `decode_chunk` reads of each decoder result, to compare with what it expects in one `==`
_RECORD = attrgetter("__class__", "dtype", "shape", "device")
# tensors of any shapes joined into one 1-D tensor in one C call (each made dense first where it is not)
_join_flat = getattr(torch._C._nn, "flatten_dense_tensors", None) or torch._utils._flatten_dense_tensors

#: Default bound on the decoded pixels held at once by `GpuBatchDecoder.run`: 256 MiB of uint8 RGB,
#: e.g. about 470 ImageNet-sized (375x500) images, or 7 twelve-megapixel photos.
DEFAULT_BUDGET_BYTES = 256 << 20
#: The resample's working set (`working_set`: float32 crops, resampling matrices, products) per group, as a
#: multiple of the decode budget (2 GiB by default): one group per chunk, and so a fixed number of calls, for
#: ordinary batches (256 crops of up to 500 x 500 pixels to 224 x 224 take 1.9 GB).
RESAMPLE_PER_BUDGET = 8


# ---- crop, resize, flip on the device: a whole chunk in a few kernels ----------------------------------

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
    h, w = heights, widths
    meta = np.empty((h.shape[0], 6), np.int64)
    size = np.multiply(3 * h, w, dtype=np.int64)
    meta[:, BASE] = np.add.accumulate(size) - size
    if layout == "hwc":
        meta[:, SC], meta[:, SY], meta[:, SX] = 1, 3 * w, 3
    else:
        meta[:, SC], meta[:, SY], meta[:, SX] = size // 3, w, 1
    meta[:, IMG_H], meta[:, IMG_W] = h, w
    return meta


class PlacedChunk:
    """A decoded chunk as columns: its images' pixels in one flat uint8 tensor on the device (`flat`),
    image i (row i of `batch`, the chunk's rows that were placed) at `meta[i]` (`layout_meta`: start,
    strides, height, width; the column stride is the same for every image, the decoder's layout), its
    crop's source window `src[i]` inside the image and target window `dst[i]` (int64 [k, 4]). No object
    per image: the resample reads the columns. Iterating (for tests and error paths) gives `_Placed`
    records, each image a strided view of `flat`."""

    __slots__ = ("batch", "flat", "meta", "src", "dst")

    def __init__(self, batch: GpuBatch, flat: torch.Tensor, meta: np.ndarray, src: np.ndarray,
                 dst: np.ndarray) -> None:
        self.batch, self.flat, self.meta, self.src, self.dst = batch, flat, meta, src, dst

    def __len__(self) -> int:
        return len(self.meta)

    def __iter__(self) -> Iterator[_Placed]:
        flat = self.flat
        return iter([_Placed(job, flat.as_strided((3, m[IMG_H], m[IMG_W]), (m[SC], m[SY], m[SX]), m[BASE]),
                             tuple(s), tuple(d), (s[1] - s[0], s[3] - s[2]))
                     for job, m, s, d in zip(self.batch, self.meta.tolist(), self.src.tolist(),
                                             self.dst.tolist())])

    def take(self, sel: np.ndarray) -> "PlacedChunk":
        """The images at positions `sel` (int64), in that order."""
        return PlacedChunk(self.batch.take(sel), self.flat, self.meta[sel], self.src[sel], self.dst[sel])

    def jobs(self) -> list[GpuJob]:
        return list(self.batch)

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
        return PlacedChunk(batch, flat, meta, np.array([p.src for p in placed], np.int64).reshape(n, 4),
                           np.array([p.dst for p in placed], np.int64).reshape(n, 4))


def working_set(k: Any, ch: Any, cw: Any, out_h: int, out_w: int) -> Any:
    """Bytes `resample_into` holds at its peak for k crops padded to ch x cw pixels resampled to out_h x
    out_w (elementwise over NumPy arrays too): both axes' float32 resampling matrices (in one tensor of
    max(out_h, out_w) x max(ch, cw) each), the crops in float32 and, while converting, uint8, the y matrices
    repeated over the 3 channels and the first product (the first matrix product's operands and result),
    and the gather's row index (int64 per crop row). Beside the chunk's decoded images, not counting them."""
    n_out = out_h if out_h > out_w else out_w
    return k * (8 * n_out * np.maximum(ch, cw) + 15 * ch * cw + 12 * out_h * (ch + cw) + 24 * ch)


#: rows of the parameters `resample_into` uploads, float64 [_NP, 2, k] (axis 0 the output's y, 1 its x):
#: each axis's resampling matrix, then each crop's gather (integers, read from the y axis)
_A, _B, _INV, _LO_IN, _HI_IN, _LO_OUT, _HI_OUT, _START, _SC, _SY, _ROW, _NP = range(12)
_X_ONLY = np.array([[0], [1]])  # [2, 1]: 1 on the x axis, the one a flip mirrors


def _params(cols: PlacedChunk, ch: int, cw: int, out_w: int, pinned: bool) -> torch.Tensor:
    """float64 [_NP, 2, k] on the host (pinned when `pinned`): per axis and sample, the numbers the
    resampling matrices are made of, and each crop's gather. Output index i of an axis, at position j
    inside its target window [lo, hi) (j = i - lo, or hi - 1 - i on a mirrored axis), samples the crop
    around c = scale * (j + 0.5) - 0.5 (torch's `align_corners=False`) with the antialiasing triangle
    widened to the shrink factor, support = max(scale, 1): input pixel x weighs max(0, 1 - |x - c| /
    support), normalized over the crop's pixels. A crop starts at column `shift` of its gathered windows:
    0, unless they would read past the end of `flat`; then they end at the crop's right edge. That stays
    inside `flat`: the windows can overrun only if the widest crop's image lies before this one's, and
    they move back less than its size."""
    src, dst, meta, k = cols.src, cols.dst, cols.meta, cols.src.shape[0]
    crop = (src[:, 1::2] - src[:, ::2]).T          # [2, k]: the crops' heights, widths (input pixels)
    size = (dst[:, 1::2] - dst[:, ::2]).T          # the target windows' heights, widths (output pixels)
    corner = dst[:, ::2].T                          # their top, left
    mirrored = cols.batch.flip * _X_ONLY
    lo = corner + mirrored * (out_w - size - 2 * corner)   # the window's first output index, as mirrored
    scale = crop / size
    inv = 1 / np.maximum(scale, 1)
    sx = meta[:, SX]
    start = meta[:, BASE] + src[:, 0] * meta[:, SY] + src[:, 2] * sx   # the crop's first pixel in `flat`
    last = start + 2 * meta[:, SC] + (crop[0] - 1) * meta[:, SY]        # its last channel's last row
    shift = _X_ONLY * ((last + (cw - 1) * sx >= cols.flat.shape[0]) * (cw - crop[1]))
    host = torch.empty((_NP, 2, k), dtype=torch.float64, pin_memory=pinned)
    par = host.numpy()
    off = mirrored * (2 * lo + size - 1) - lo       # j = (1 - 2 * mirrored) * i + off
    par[_A] = scale * (1 - 2 * mirrored) * inv      # i * A + B: c / support, in window columns
    par[_B] = (scale * (off + 0.5) - 0.5 + shift) * inv
    par[_INV] = inv
    par[_LO_IN], par[_HI_IN] = shift, shift + crop
    par[_LO_OUT], par[_HI_OUT] = lo, lo + size
    par[_START], par[_SC], par[_SY], par[_ROW] = start - shift[1] * sx, meta[:, SC], meta[:, SY], cols.batch.rows
    return host


def resample_into(placed: "PlacedChunk | Sequence[_Placed]", out: torch.Tensor, crop_max: Any = None) -> None:
    """Crop, resize (torch's antialiased bilinear, `F.interpolate(antialias=True)`, which is plain
    bilinear where an axis grows), round, flip and store every sample of `placed` into its row of `out`
    (uint8 [B, 3, H, W], any strides) in a fixed number of kernels and Python calls (15), never one per
    sample or per axis: the samples' parameters (`_params`) uploaded in one copy; every crop row gathered
    from the flat buffer by one indexed read of a view of it as overlapping windows of the widest crop's
    width (rows past a crop's height read its rows again; columns past its width, whatever follows; their
    weights are zero); both axes' resampling matrices built together, with tensor operators, in place
    where they can be (no Python call, no temporary of their size); two batched matrix products; one
    rounded store (where the rows are consecutive, as a chunk's are, a copy into a slice of `out` that
    converts as it copies). Samples whose target window does not cover the output (padded CenterCrop) get
    zeros around it, as on the CPU path; a flip is a mirrored target window. Its memory is `working_set`.
    `crop_max`: the largest crop's (height, width), where the caller has it (`resample_chunk`)."""
    cols = placed if type(placed) is PlacedChunk else PlacedChunk.of(placed)
    k = cols.src.shape[0]
    if not k:
        return
    dev, out_h, out_w = out.device, out.shape[2], out.shape[3]
    ch, cw = np.maximum.reduce(cols.src[:, 1::2] - cols.src[:, ::2]) if crop_max is None else crop_max
    g = _params(cols, ch, cw, out_w, dev.type == "cuda").to(dev, non_blocking=True)
    n_out, n_in = (out_h if out_h > out_w else out_w), (ch if ch > cw else cw)
    ar = torch.arange(n_out + n_in + 3, device=dev)   # every index below is under this
    gi = g.long()[:, 0, :, None, None]                 # the gather's columns, [k, 1, 1] each
    rows = gi[_START] + ar[:3, None] * gi[_SC] + (ar[:ch] % gi[_HI_IN]) * gi[_SY]   # [k, 3, ch]
    sx = int(cols.meta[0, SX])
    windows = cols.flat.as_strided((cols.flat.shape[0] - (cw - 1) * sx, cw), (1, sx))
    # the matrices, [2, k, n_out, n_in]: output index i takes sum_x W[i, x] * crop[x]
    p, i, x = g.float()[:, :, :, None, None], ar[:n_out, None], ar[:n_in]
    w = (x * p[_INV] - (i * p[_A] + p[_B])).abs_()   # distance to the sampled point, in supports
    w *= -1
    w += 1
    w = w.clamp_min_(0)                               # the triangle filter
    w *= (x >= p[_LO_IN]) & (x < p[_HI_IN])           # over the crop's own pixels
    total = w.sum(-1, keepdim=True)
    inside = (i >= p[_LO_OUT]) & (i < p[_HI_OUT])
    w *= inside / (total + ~inside)                   # normalized; rows outside the window zero (total 0 there)
    pixels = w[0, :, None, :out_h, :ch] @ windows[rows].float() @ w[1, :, None, :out_w, :cw].mT
    dest = cols.batch.rows
    if True in (dest[1:] - dest[:-1] != 1):   # rows in any order: one indexed store
        out[gi[_ROW, :, 0, 0]] = pixels.round_().to(torch.uint8)
    else:   # consecutive rows (as a chunk's are): a slice of `out`, converted to uint8 as it is copied
        out[int(dest[0]):int(dest[0]) + k].copy_(pixels.round_())


class GpuBatchDecoder:
    """Decode a batch's JPEGs on the GPU and write each, cropped, resized and flipped, into its row.

    Memory: jobs are decoded in chunks whose decoded size (3 * height * width bytes per image, from
    the stored sizes; the crop's window only, when the decoder decodes `regions`) stays under
    `budget_bytes` (at least one image per chunk); a chunk's images are released before the next
    chunk is decoded. The chunk's crops are then resampled together (`resample_into`) in groups whose
    working set (`working_set`: the gathered crops, the resampling matrices, the products) stays under
    `resample_budget_bytes` (at least one image per group; RESAMPLE_PER_BUDGET x budget_bytes by
    default, so an ordinary chunk is one group). Peak GPU memory of one `run` is therefore about
    2 x budget_bytes (the decoded images and the flat buffer they are joined into; or a single large
    image's share) plus the resample's working set, plus the decoder library's own work buffers (nvJPEG
    keeps them between calls).

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

    def chunks(self, jobs: "GpuBatch | Sequence[GpuJob]") -> list[GpuBatch]:
        """Consecutive runs of rows whose decoded bytes (3*h*w each; the crop's window with `regions`, where
        planned) sum to at most budget_bytes; a row larger than the budget on its own gets a chunk of its
        own. Each run is a `GpuBatch`; a batch under the budget is one, as it is."""
        if type(jobs) is not GpuBatch:
            if not jobs:   # a batch the CPU renders whole
                return []
            jobs = GpuBatch.of_jobs(jobs)
        batch = jobs
        nbytes = 3 * np.maximum(batch.heights, 0) * np.maximum(batch.widths, 0)
        if self.regions:
            src = batch.src
            nbytes += batch.planned * (3 * (src[:, 1] - src[:, 0]) * (src[:, 3] - src[:, 2]) - nbytes)
        budget = self.budget_bytes
        if np.add.reduce(nbytes) <= budget:
            return [batch] if nbytes.shape[0] else []
        out: list[GpuBatch] = []
        start, size = 0, 0
        for k, n in enumerate(nbytes.tolist()):
            if k > start and size + n > budget:
                out.append(batch.take(slice(start, k)))
                start, size = k, 0
            size += n
        out.append(batch.take(slice(start, len(nbytes))))
        return out

    def groups(self, placed: "PlacedChunk | Sequence[_Placed]", out_h: int, out_w: int) -> list[PlacedChunk]:
        """`placed` as groups whose `working_set` stays under the resample budget (`resample_budget_bytes`):
        the whole chunk, as it is, while it fits (a fixed number of calls); else sorted by crop size and cut,
        each group's bound taken at its last crop's height and the widest crop so far."""
        cols = placed if type(placed) is PlacedChunk else PlacedChunk.of(placed)
        k = cols.src.shape[0]
        if not k:
            return []
        crop = cols.src[:, 1::2] - cols.src[:, ::2]   # [k, 2]: heights, widths
        ch, cw = np.maximum.reduce(crop)
        if working_set(k, ch, cw, out_h, out_w) <= self.resample_budget_bytes:
            return [cols]
        return self._cut(cols, crop, out_h, out_w)

    def _cut(self, cols: PlacedChunk, crop: np.ndarray, out_h: int, out_w: int) -> list[PlacedChunk]:
        """`groups` of a chunk over the budget, its crops' (height, width) `crop` [k, 2]."""
        k, budget = crop.shape[0], self.resample_budget_bytes
        order = np.lexsort((crop[:, 1], crop[:, 0]))   # by (height, width)
        per = working_set(1, crop[order, 0], np.maximum.accumulate(crop[order, 1]), out_h, out_w).tolist()
        cut, start = [0], 0
        for i, one in enumerate(per):   # nondecreasing: a group's bound is its size times its last
            if i > start and (i + 1 - start) * one > budget:
                cut.append(i)
                start = i
        cut.append(k)
        return [cols.take(order[a:b]) for a, b in zip(cut[:-1], cut[1:])]

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
        if type(chunk) is not GpuBatch:
            chunk = GpuBatch.of_jobs(chunk)
        if 0 in chunk.planned:
            chunk = chunk.copy()
            self._plan(chunk, out_h, out_w)
        src = chunk.src
        if self.regions:
            hw = src[:, 1::2] - src[:, ::2]   # what is decoded: the crop's window, (height, width)
            at = src - src[:, [0, 0, 2, 2]]   # the crop's window inside it: (0, height, 0, width)
        else:
            hw, at = chunk.geo[:, [HEIGHT, WIDTH]], src
        if self._columns is not None and chunk.data is not None:
            outs, layout = _columns_each(self._columns, chunk.data, chunk.spans, src if self.regions else None), \
                self.layout
        else:
            outs, layout = self._decode_list(chunk), "chw"
        # attributes only: an image of the shape expected, already on the device, is taken as it is;
        # anything else goes through `_one` (checks, grayscale, moves) or fails. As a rule every result is
        # as expected: one comparison of the records, made in C (no Python per image), says so; otherwise
        # one pass finds the others
        dev, u8, tensor = self.device, torch.uint8, torch.Tensor
        dims = hw[:, [0, 1, 1]] if layout == "hwc" else hw[:, [0, 0, 1]]
        dims[:, 2 if layout == "hwc" else 0] = 3
        shapes = list(map(tuple, dims.tolist()))
        try:
            fine = list(map(_RECORD, outs)) == list(zip(repeat(tensor), repeat(u8), shapes, repeat(dev)))
        except Exception:   # a result that is not a tensor (an exception for its image)
            fine = False
        bad = [] if fine else [k for k, (o, want) in enumerate(zip(outs, shapes))
                               if not (o.__class__ is tensor and o.dtype == u8 and o.shape == want and o.device == dev)]
        failures: list[tuple[GpuJob, Exception]] = []
        if bad:
            at = at.copy()
            for k in bad:
                job = chunk.job(k)
                try:
                    outs[k], at[k] = self._one(job, outs[k], chunk, k, layout)
                except Exception as exc:
                    failures.append((job, self._failure(job, exc)))
                    outs[k] = None
            keep = np.array([k for k, o in enumerate(outs) if o is not None], np.int64)
            chunk, hw, at, outs = chunk.take(keep), hw[keep], at[keep], [outs[k] for k in keep.tolist()]
        flat = _join_flat(outs) if outs else torch.empty(0, dtype=torch.uint8, device=dev)
        return PlacedChunk(chunk, flat, layout_meta(hw[:, 0], hw[:, 1], layout), at, chunk.dst), failures

    def _decode_list(self, chunk: GpuBatch) -> list:
        """The decoder's results for `chunk`, one per row, through its list API (`decode`): [3, H, W]
        images ("chw"). For decoders without `decode_columns`, and rows made one at a time."""
        wins = list(map(tuple, chunk.src.tolist())) if self.regions else None
        # Backends already retry a failed batch one image at a time; this covers any other decoder.
        return _decode_each(self.decoder.decode, chunk.datas, wins)

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
        under the budget; the samples of a group that fails (e.g. out of GPU memory) are returned. A chunk
        that fits is one group, resampled with the crop sizes found here (`groups` cuts the others)."""
        cols = placed if type(placed) is PlacedChunk else PlacedChunk.of(placed)
        k = cols.src.shape[0]
        if not k:
            return []
        out_h, out_w = out.shape[2], out.shape[3]
        crop = cols.src[:, 1::2] - cols.src[:, ::2]   # [k, 2]: the crops' heights, widths
        crop_max = np.maximum.reduce(crop)   # [2]: the largest crop's height, width
        if working_set(k, crop_max[0], crop_max[1], out_h, out_w) <= self.resample_budget_bytes:
            groups, biggest = [cols], crop_max
        else:   # `groups`, without finding again what is found here
            groups, biggest = self._cut(cols, crop, out_h, out_w), None
        failures: list[tuple[GpuJob, Exception]] = []
        for group in groups:
            try:
                resample_into(group, out, biggest)
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
