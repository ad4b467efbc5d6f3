"""The GPU half's batched resample (`gpu_decode.resample_into`) against torch's own antialiased resize,
`F.interpolate(antialias=True)`, one sample at a time: random crop and target windows, padded windows,
flips, mixed sizes, 1-pixel crops, grayscale expanded, planar and interleaved buffers, and the crops
whose gathered windows would read past the end of the chunk's buffer. Its working set is bounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stoker.device import gpu_decode
from stoker.device.gpu_decode import (DEFAULT_BUDGET_BYTES, RESAMPLE_PER_BUDGET, GpuBatchDecoder, PlacedChunk,
                                      _Placed, layout_meta, resample_into, working_set)
from stoker.loading.jobs import GpuBatch, GpuJob


def job(row: int, flip: bool, h: int, w: int) -> GpuJob:
    return GpuJob(row, torch.empty(0, dtype=torch.uint8), (0.0, 0.0, float(h), float(w)), flip, h, w, f"img/{row}")


def reference(img: torch.Tensor, src: tuple, dst: tuple, flip: bool, out_h: int, out_w: int) -> torch.Tensor:
    """One sample as torch resizes it: the crop resized by F.interpolate (antialiased bilinear), rounded,
    placed at its target window on a zero canvas, the canvas mirrored when flipped."""
    sy0, sy1, sx0, sx1 = src
    dy0, dy1, dx0, dx1 = dst
    region = img[:, sy0:sy1, sx0:sx1].float()[None]
    size = (dy1 - dy0, dx1 - dx0)
    # torch's CPU kernel gives every output row the first one's value where the output is one pixel wide
    # (but not one pixel high), so such a window is resized transposed
    turn = size[1] == 1
    if turn:
        region, size = region.mT, size[::-1]
    pixels = F.interpolate(region, size=size, mode="bilinear", align_corners=False, antialias=True)[0]
    pixels = (pixels.mT if turn else pixels).round().clamp(0, 255).to(torch.uint8)
    canvas = torch.zeros((3, out_h, out_w), dtype=torch.uint8)
    canvas[:, dy0:dy1, dx0:dx1] = pixels
    return canvas.flip(-1) if flip else canvas


def random_samples(rng: np.random.Generator, n: int, out_h: int, out_w: int, big: int = 60) -> list[_Placed]:
    """n samples of mixed sizes (1 to `big` pixels a side; some grayscale, expanded), each a random crop
    window resized to a random target window inside the output (often smaller: padded), half flipped."""
    placed = []
    for row in range(n):
        h, w = (int(v) for v in rng.integers(1, big + 1, 2))
        img = torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8))
        if row % 5 == 3:
            img = img[:1].expand(3, h, w)   # grayscale from a decoder that ignored the RGB request
        sy0, sx0 = int(rng.integers(0, h)), int(rng.integers(0, w))
        sy1, sx1 = int(rng.integers(sy0 + 1, h + 1)), int(rng.integers(sx0 + 1, w + 1))
        if row % 7 == 0:
            sy1, sx1 = sy0 + 1, sx0 + 1   # a 1-pixel crop
        th, tw = int(rng.integers(1, out_h + 1)), int(rng.integers(1, out_w + 1))
        if row % 4 == 0:
            th, tw = out_h, out_w   # the whole output
        if row % 6 == 1:
            th, tw = sy1 - sy0, sx1 - sx0   # the crop's own size, where it fits: a copy
            th, tw = min(th, out_h), min(tw, out_w)
        dy0, dx0 = int(rng.integers(0, out_h - th + 1)), int(rng.integers(0, out_w - tw + 1))
        placed.append(_Placed(job(row, bool(row % 2), h, w), img, (sy0, sy1, sx0, sx1),
                              (dy0, dy0 + th, dx0, dx0 + tw), (sy1 - sy0, sx1 - sx0)))
    return placed


def check_against_torch(got: torch.Tensor, placed: list[_Placed]) -> None:
    out_h, out_w = got.shape[2], got.shape[3]
    want = torch.stack([reference(p.img, p.src, p.dst, p.job.flip, out_h, out_w) for p in placed])
    diff = (got[[p.job.row for p in placed]].int() - want.int()).abs()
    assert int(diff.max()) <= 1, f"max difference {int(diff.max())} levels"
    assert float((diff > 0).float().mean()) < 0.01


@pytest.mark.parametrize("seed, out_h, out_w", [(0, 24, 24), (1, 17, 31), (2, 40, 9), (3, 1, 1)])
def test_the_resample_is_torchs_antialiased_resize_per_sample(seed: int, out_h: int, out_w: int) -> None:
    rng = np.random.default_rng(seed)
    placed = random_samples(rng, 40, out_h, out_w)
    got = torch.full((len(placed), 3, out_h, out_w), 7, dtype=torch.uint8)
    resample_into(placed, got)
    check_against_torch(got, placed)


def test_a_group_gives_each_sample_what_it_gets_alone() -> None:
    """The padding to the group's largest crop (rows and columns whose weights are zero) changes nothing
    but the order of the matrix products' sums: a value within ~1e-5 of a .5 may round the other way."""
    placed = random_samples(np.random.default_rng(7), 24, 20, 26)
    together = torch.zeros((len(placed), 3, 20, 26), dtype=torch.uint8)
    resample_into(placed, together)
    alone = torch.zeros_like(together)
    for p in placed:
        resample_into([p], alone)
    diff = (together.int() - alone.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.001


def test_rows_not_in_the_chunk_and_output_strides_are_kept() -> None:
    """Only the chunk's rows are written, into an output of any strides (channels-last here)."""
    placed = random_samples(np.random.default_rng(4), 6, 16, 16)
    placed = [p._replace(job=job(2 * p.job.row + 1, p.job.flip, p.job.height, p.job.width)) for p in placed]
    out = torch.full((12, 16, 16, 3), 200, dtype=torch.uint8).permute(0, 3, 1, 2)
    resample_into(placed, out)
    assert bool((out[0::2] == 200).all())
    check_against_torch(out, placed)


@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_windows_that_would_read_past_the_buffer_end_at_the_crops_edge(layout: str) -> None:
    """A narrow crop at the bottom right of the last image in the flat buffer, grouped with a wide crop:
    its gathered windows, as wide as the widest crop, start far enough back to stay inside the buffer,
    and the pixels are still torch's."""
    rng = np.random.default_rng(5)
    shapes = [(9, 61), (23, 7), (31, 12)]   # the widest first, the narrow ones last
    imgs = [torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)) for h, w in shapes]
    src = np.array([[0, 9, 0, 61], [0, 23, 0, 7], [20, 31, 5, 12]], np.int64)
    dst = np.array([[0, 16, 0, 20], [2, 14, 1, 19], [0, 16, 3, 20]], np.int64)
    jobs = [job(i, i == 2, h, w) for i, (h, w) in enumerate(shapes)]
    stored = [img.permute(1, 2, 0) if layout == "hwc" else img for img in imgs]
    flat = torch.cat([t.reshape(-1) for t in stored])
    meta = layout_meta(np.array([h for h, _ in shapes]), np.array([w for _, w in shapes]), layout)
    cols = PlacedChunk(GpuBatch.of_jobs(jobs), flat, meta, src, dst)
    params = gpu_decode._params(cols, 31, 61, 20, False).numpy()
    assert params[gpu_decode._LO_IN, 1].tolist() == [0, 0, 61 - 7]   # only the last crop's windows move
    got = torch.zeros((3, 3, 16, 20), dtype=torch.uint8)
    resample_into(cols, got)
    check_against_torch(got, [_Placed(j, img, tuple(s), tuple(d), (s[1] - s[0], s[3] - s[2]))
                              for j, img, s, d in zip(jobs, imgs, src.tolist(), dst.tolist())])


def test_an_imagenet_batch_is_one_group_under_the_default_budget() -> None:
    """256 crops of up to 500 x 500 pixels (ImageNet's largest sides) resampled to 224 x 224: one group,
    so a fixed number of calls; twice as many are cut in two, each group under the budget."""
    budget = RESAMPLE_PER_BUDGET * DEFAULT_BUDGET_BYTES
    assert working_set(256, 500, 500, 224, 224) <= budget < working_set(512, 500, 500, 224, 224)
    gpu = GpuBatchDecoder(object(), "cpu")

    def chunk(n: int) -> PlacedChunk:
        rng = np.random.default_rng(n)
        hs, ws = rng.integers(100, 501, n), rng.integers(100, 501, n)
        hs[0] = ws[1] = 500
        src = np.stack([0 * hs, hs, 0 * ws, ws], 1)
        dst = np.tile(np.array([0, 224, 0, 224], np.int64), (n, 1))
        jobs = [job(i, False, int(h), int(w)) for i, (h, w) in enumerate(zip(hs, ws))]
        return PlacedChunk(GpuBatch.of_jobs(jobs), torch.empty(0, dtype=torch.uint8), layout_meta(hs, ws, "chw"),
                           src, dst)

    one = chunk(256)
    assert gpu.groups(one, 224, 224) == [one]
    two = gpu.groups(chunk(512), 224, 224)
    assert len(two) == 2 and sum(len(g) for g in two) == 512
    for g in two:
        crop = g.src[:, 1::2] - g.src[:, ::2]
        assert working_set(len(g), *crop.max(0), 224, 224) <= budget
        assert (np.diff(crop[:, 0]) >= 0).all()   # sorted by height


def test_consecutive_rows_are_stored_as_rows_in_any_order_are() -> None:
    """Rows that follow one another are stored through a slice of the output (converted as copied), rows
    in any other order through one indexed store: the same pixels, bit for bit."""
    placed = random_samples(np.random.default_rng(9), 10, 18, 22)
    shifted = [p._replace(job=job(p.job.row + 3, p.job.flip, p.job.height, p.job.width)) for p in placed]
    sliced = torch.full((16, 3, 18, 22), 9, dtype=torch.uint8)
    resample_into(shifted, sliced)   # rows 3..12: the slice
    order = [2, 0, 1] + list(range(3, 10))
    indexed = torch.full_like(sliced, 9)
    resample_into([shifted[i] for i in order], indexed)   # the same rows out of order: the indexed store
    assert torch.equal(sliced, indexed)
    assert bool((sliced[:3] == 9).all()) and bool((sliced[13:] == 9).all())
    check_against_torch(sliced, shifted)
