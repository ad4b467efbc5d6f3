"""The GPU's rows of a batch prepared a chunk at a time by the worker threads (`Filler.queue_gpu_rows`):
each row planned and its crop windows computed by one native call (`native.plan_gpu_rows`), or without
the native planner from the batch's NumPy plan (`jobs.crop_windows`), the JPEG bytes gathered into the
slot's staging buffer by one more (`native.gather_spans`). The native planner gives the NumPy path's
integers on many random sizes and plans; either way the same jobs, so the same pixels, bit for bit, as
a reference that makes each row's job one at a time (`per_row` here: the sample read, its
`crop_window`, a private copy of its bytes), with the stand-in decoders here and nvImageCodec's CPU
backend where it is installed; and the worker threads' Python per batch does not grow with the batch."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stoker
from conftest import jpeg_bytes
from stoker import DeviceOptions, Loader, Workers, native
from stoker.device.gpu_decode import GpuBatchDecoder
from stoker.errors import ConfigError
from stoker.loading import render
from stoker.loading.jobs import GEO_COLUMNS, GpuBatch, GpuJob, JpegStaging, _planned_rows, crop_windows
from stoker.order import TAG_DRAW, TAG_SAMPLE, sample_keys, stream_key, uniforms
from gpu_standin import FixedRateDecoder
from stoker.transforms import (CenterCrop, CoverCrop, Pipeline, RandomHorizontalFlip, RandomResizedCrop, Resize,
                               crop_window)
from stoker.transforms.kinds import engine_program
from test_gpu_decode import CpuDecoder, textured, textured_pack

CROP = [RandomResizedCrop(64), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return textured_pack(tmp_path_factory.mktemp("gpurows"), 5, 20, lambda i: (40 + 7 * i, 60 + 5 * i))


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 JPEGs, all kept as JPEGs by the packer."""
    root = tmp_path_factory.mktemp("gpurows-jpegs")
    rng = np.random.default_rng(6)
    (root / "src" / "c0").mkdir(parents=True)
    for i in range(80):
        data = jpeg_bytes(textured(rng, 120 + i, 150 + i), quality=75)
        (root / "src" / "c0" / f"{i:02d}.jpg").write_bytes(data)
    stoker.pack(str(root / "src"), str(root / "packed"))
    return root / "packed"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JPEGs with PNG, raw and two damaged rows among them."""
    from test_native_rows import build

    return build(tmp_path_factory.mktemp("gpurows-mixed") / "ds", seed=2, bad=(3, 20))


class _RowJobs:
    """Jobs made one row at a time, standing as one chunk of a plan's GPU rows (`BatchPlan.gpu_rows`)."""

    def __init__(self, jobs: list) -> None:
        self.jobs = jobs

    def batch(self) -> GpuBatch:
        return GpuBatch.of_jobs(self.jobs)


def per_row(self: Any, plan: Any, r0: int, r1: int, slot: Any, scratch: dict, times: Any, found: Any = None) -> list:
    """The reference for `Filler.queue_gpu_rows`: each GPU row's job made on its own (the sample read, its
    crop window by `transforms.crop_window`, a private copy of its bytes); rows that are not JPEGs rendered
    on the CPU through `fill`. The spans the caller found (`found`) are not used: each row is read itself."""
    jobs, errors = [], []
    self.complete(plan)   # the batch's NumPy plan (deferred where the native planner serves the GPU's rows)
    for row in range(r0, r1):
        idx = int(plan.indices[row])
        s = self.ds.sample(idx)
        if s.encoding != "jpeg":
            errors += self.fill_rows(plan, [row], slot, scratch, times)
            continue
        box, flip = tuple(plan.geometry.box[row].tolist()), bool(plan.geometry.flip[row])
        win = crop_window(box, s.height, s.width, s.height, s.width, self.out_h, self.out_w)
        jobs.append(GpuJob(row, torch.frombuffer(bytearray(s.data), dtype=torch.uint8), box, flip, s.height,
                           s.width, s.key, win))
    if jobs:
        plan.gpu_rows.append(_RowJobs(jobs))
    return errors


def run(path: Path, device: DeviceOptions, ops: list, monkeypatch: pytest.MonkeyPatch, rows_at_once: bool,
        threads: int = 2, batch: int = 8, native_plan: bool = True, **options: Any) -> tuple[list, list]:
    """(batches, every job the decoder was handed: its row, bytes, box, flip, window, sizes and key, per chunk)."""
    seen: list = []
    decode_chunk = GpuBatchDecoder.decode_chunk

    def spy(self: Any, chunk: Any, out_h: int, out_w: int) -> Any:
        seen.append([(j.row, bytes(j.data.numpy()), tuple(j.box), bool(j.flip), j.window, j.height, j.width, j.key)
                     for j in chunk])
        return decode_chunk(self, chunk, out_h, out_w)

    with monkeypatch.context() as m:
        m.setattr(GpuBatchDecoder, "decode_chunk", spy)
        if not rows_at_once:
            m.setattr(render.Filler, "queue_gpu_rows", per_row)
        if not native_plan:   # the GPU's rows planned from the batch's NumPy plan
            m.setattr(native, "plans_rows", lambda: False)
        planned = []
        plan_gpu_rows = native.plan_gpu_rows
        m.setattr(native, "plan_gpu_rows", lambda *a: planned.append(1) or plan_gpu_rows(*a))
        loader = Loader(path, batch, transforms=ops, seed=11, device=device,
                        workers=Workers(num_threads=threads, on_error="skip"), **options)
        try:
            batches = [(x.clone(), y.clone()) for x, y in loader]
        finally:
            loader.close()
    # the native planner prepares the GPU's rows wherever it is there, and only then
    assert bool(planned) == (rows_at_once and native_plan and native.plans_rows() and bool(seen))
    return batches, seen


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(la, lb) for (x, la), (y, lb) in zip(a, b))


# ---- the crop windows: transforms.crop_window's integers, a chunk at a time ---------------------------------------

def test_crop_windows_are_crop_windows_integers_for_every_row() -> None:
    """Boxes inside and outside the image, degenerate ones, and halves (the rounding ties): every row's
    windows and padding are exactly `crop_window`'s."""
    rng = np.random.default_rng(0)
    n = 4000
    h = rng.integers(1, 600, n)
    w = rng.integers(1, 600, n)
    box = np.stack([rng.uniform(-80, 500, n), rng.uniform(-80, 500, n), rng.uniform(0, 700, n),
                    rng.uniform(0, 700, n)], 1)
    box[::3] = np.round(box[::3] * 2) / 2   # halves: round() and np.rint both round them to even
    box[::7, 2:] = 0.0                        # degenerate
    for out_h, out_w in ((64, 64), (224, 160), (1, 3)):
        src, dst, padded = crop_windows(box, h, w, out_h, out_w)
        for i in range(n):
            want = crop_window(box[i].tolist(), int(h[i]), int(w[i]), int(h[i]), int(w[i]), out_h, out_w)
            assert (tuple(src[i].tolist()), tuple(dst[i].tolist()), bool(padded[i])) == (
                want.src, want.dst, want.padded), (i, box[i], h[i], w[i], out_h, out_w)
    assert padded.any() and not padded.all()


# ---- the native planner: the NumPy plan's boxes, flips and windows, in one call ---------------------------------------

needs_planner = pytest.mark.skipif(not native.plans_rows(), reason="the native extension is not built")

#: plans whose windows are inside the image, padded past its border (a crop larger than the image, alone or
#: after a resize), cut from a resized image (fractional boxes, rounding ties), and RandomResizedCrop with a
#: scale above 1 (its tries fail: the central fallback)
#: (ops, whether some of its windows are padded)
PLANS = [([RandomResizedCrop(64), RandomHorizontalFlip()], False),
         ([RandomResizedCrop((40, 56), scale=(0.01, 1.0), ratio=(0.2, 5.0))], False),
         ([RandomResizedCrop(32, scale=(1.2, 3.0))], False),
         ([CenterCrop(120)], True),
         ([CenterCrop((7, 300)), RandomHorizontalFlip(0.5)], True),
         ([Resize(50), CenterCrop(64)], True),
         ([Resize((33, 17)), CenterCrop((40, 9))], True),
         ([Resize(48), CenterCrop(48), RandomHorizontalFlip()], False),
         ([CoverCrop((64, 96)), RandomHorizontalFlip()], False)]


def random_sizes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Stored sizes from 1 pixel up: tiny, thin, very wide and large images, and a few zero sizes (not taken)."""
    h, w = rng.integers(1, 1500, n), rng.integers(1, 1500, n)
    h[:40], w[40:80] = rng.integers(1, 4, 40), rng.integers(1, 3, 40)
    h[80:90] = w[80:90] = 1
    w[90:130] = h[90:130] * rng.integers(5, 12, 40)
    h[130:135], w[135:140] = 0, 0
    return h.astype(np.int64), w.astype(np.int64)


@needs_planner
@pytest.mark.parametrize("ops, pads", PLANS, ids=[f"plan{i}" for i in range(len(PLANS))])
@pytest.mark.parametrize("by_position", [False, True], ids=["by-index", "by-position"])
def test_the_native_planner_gives_the_numpy_plans_rows(ops: list, pads: bool, by_position: bool) -> None:
    """`native.plan_gpu_rows` against `Pipeline.plan` + `jobs.crop_windows` (the NumPy path, `_planned_rows`) on
    the same random streams: every taken row's geo columns (rows, flips, sizes, windows, padding, indices), box
    and bytes' spans, the same rows taken (JPEG bytes and a stored size), whatever the chunk's first row; and
    a sample of rows against `crop_window` itself."""
    pipe = Pipeline(ops)
    prog = engine_program(pipe.prefix, pipe.offsets)
    assert prog is not None
    out_size = tuple(int(v) for v in pipe.plan(np.array([100]), np.array([100]), np.zeros((1, max(pipe.draws, 1))))
                     .size[0])
    rng = np.random.default_rng(len(ops) * 7 + by_position)
    n, k, r0 = 3000, 700, 37
    heights, widths = random_sizes(rng, n)
    index = rng.permutation(n)[:k].astype(np.int64)
    positions = np.arange(k, dtype=np.int64) + 1000 + r0
    spans = np.empty((k, 3), np.int64)
    spans[:, 0] = rng.integers(0, 3, k)
    spans[:, 1] = rng.integers(0, 10_000, k)
    spans[:, 2] = spans[:, 1] + rng.integers(0, 50_000, k)
    spans[rng.random(k) < 0.1, 0] = -1                  # not JPEGs: left for the caller
    tag, ids = (TAG_DRAW, positions) if by_position else (TAG_SAMPLE, index)
    u = uniforms(sample_keys(9, 3, ids, tag=tag), max(pipe.draws, 1))
    # the batch's NumPy plan, rows r0.. of it the chunk's (zero sizes planned as 1: never taken)
    geometry = pipe.plan(np.maximum(heights[index], 1), np.maximum(widths[index], 1), u)
    pad = lambda a: np.concatenate([np.zeros((r0,) + a.shape[1:], a.dtype), a])  # noqa: E731
    geometry.box, geometry.flip = pad(geometry.box), pad(geometry.flip)
    want = [np.empty((k, GEO_COLUMNS), np.int64), np.empty((k, 4)), np.empty((k, 2), np.int64),
            np.empty((k, 3), np.int64)]
    got = [np.empty_like(a) for a in want]
    wn, wtotal = _planned_rows(spans, index, r0, geometry, heights, widths, out_size, *want)
    gn, gtotal = native.plan_gpu_rows(spans, ids, index, heights, widths, int(stream_key(9, 3, tag)[0]), prog, r0,
                                      out_size, *got)
    assert (gn, gtotal) == (wn, wtotal) and 0 < gn < k
    for name, a, b in zip(("geo", "box", "at", "src"), want, got):
        assert np.array_equal(a[:gn], b[:gn]), (name, np.flatnonzero((a[:gn] != b[:gn]).reshape(gn, -1).any(1))[:5])
    geo, box = got[0][:gn], got[1][:gn]
    assert geo[:, 12].any() == pads and (geo[:, 13] == 1).all()  # windows padded where the plan pads; all planned
    for i in rng.choice(gn, 100, replace=False).tolist():
        g = geo[i].tolist()
        win = crop_window(box[i].tolist(), g[2], g[3], g[2], g[3], *out_size)
        assert (tuple(g[4:8]), tuple(g[8:12]), bool(g[12])) == (win.src, win.dst, win.padded), (i, box[i], g)


@needs_planner
def test_the_native_planner_checks_its_arrays() -> None:
    pipe = Pipeline(CROP)
    prog = engine_program(pipe.prefix, pipe.offsets)
    sizes = np.full(4, 50, np.int64)
    spans = np.array([[0, 0, 10], [0, 10, 30], [-1, 0, 0], [0, 30, 31]], np.int64)
    idx = np.arange(4, dtype=np.int64)
    outs = lambda k: [np.empty((k, GEO_COLUMNS), np.int64), np.empty((k, 4)), np.empty((k, 2), np.int64),  # noqa: E731
                      np.empty((k, 3), np.int64)]
    geo, box, at, src = outs(4)
    assert native.plan_gpu_rows(spans, idx, idx, sizes, sizes, 5, prog, 8, (64, 64), geo, box, at, src) == (3, 31)
    assert geo[:3, 0].tolist() == [8, 9, 11] and at[:3].tolist() == [[0, 10], [10, 30], [30, 31]]
    assert src[:3].tolist() == spans[[0, 1, 3]].tolist() and geo[:3, 14].tolist() == [0, 1, 3]
    with pytest.raises(IndexError, match="index 6 outside the 4 sizes"):
        native.plan_gpu_rows(spans, idx, idx + 6, sizes, sizes, 5, prog, 0, (64, 64), geo, box, at, src)
    with pytest.raises(ValueError, match="geo int64"):
        native.plan_gpu_rows(spans, idx, idx, sizes, sizes, 5, prog, 0, (64, 64), *outs(3))
    with pytest.raises(ValueError, match="geo int64"):   # an int32 index
        native.plan_gpu_rows(spans, idx, idx.astype(np.int32), sizes, sizes, 5, prog, 0, (64, 64), geo, box, at, src)
    with pytest.raises(ValueError, match="end .* before they start"):
        native.plan_gpu_rows(np.ascontiguousarray(spans[:, [0, 2, 1]]), idx, idx, sizes, sizes, 5, prog, 0, (64, 64), geo, box, at, src)


# ---- the bytes: one native call for the chunk -----------------------------------------------------------------------

@pytest.mark.parametrize("native_on", [True, False])
def test_gather_spans_copies_each_rows_bytes_to_its_offset(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if native_on and not (native.ON and hasattr(native._mod, "gather_spans")):
        pytest.skip("the native extension is not built")
    if not native_on:
        monkeypatch.setattr(native, "ON", False)
    rng = np.random.default_rng(1)
    blocks = [rng.integers(0, 256, 5000, dtype=np.uint8), bytes(rng.integers(0, 256, 300, dtype=np.uint8)),
              np.zeros(0, np.uint8)]
    spans = np.array([[0, 10, 900], [-1, 0, 0], [1, 0, 300], [0, 4000, 5000], [0, 7, 7], [1, 299, 300]], np.int64)
    lengths = np.where(spans[:, 0] >= 0, spans[:, 2] - spans[:, 1], 0)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) + 3
    out = np.full(int(lengths.sum()) + 6, 77, np.uint8)
    assert native.gather_spans(blocks, spans, out, offsets) == int(lengths.sum())
    again = np.full_like(out, 77)
    pairs = np.stack([offsets, offsets + lengths], 1)   # offsets of any stride: the first column of (start, end) spans
    assert native.gather_spans(blocks, spans, again, pairs[:, 0]) == int(lengths.sum()) and np.array_equal(again, out)
    for (block, lo, hi), at in zip(spans.tolist(), offsets.tolist()):
        if block >= 0:
            assert bytes(out[at:at + hi - lo]) == bytes(np.frombuffer(blocks[block], np.uint8)[lo:hi])
    assert (out[:3] == 77).all() and (out[-3:] == 77).all()   # nothing written outside the rows
    if native_on:
        with pytest.raises(ValueError, match="row 3's bytes 4000..5000"):
            native.gather_spans(blocks, spans, out, offsets + 7)
        with pytest.raises(IndexError, match="names block 5 of 3"):
            native.gather_spans(blocks, np.array([[5, 0, 1]], np.int64), out, np.zeros(1, np.int64))
        with pytest.raises(ValueError, match="spans int64"):
            native.gather_spans(blocks, spans[:2], out, offsets)


def test_a_batch_of_one_chunk_is_its_columns_as_the_general_path_makes_them() -> None:
    """`plan_columns` hands over a batch of one `GpuRows` (decode="gpu": one claim per batch) as its columns,
    without joining or sorting: the rows, boxes, bytes and jobs of the general path (a chunk it does not
    know as a `GpuRows`); rows past the batch's first `n` still left out."""
    from types import SimpleNamespace

    from stoker.loading.jobs import GpuRows, ROW, plan_columns

    k = 5
    geo = np.arange(k * GEO_COLUMNS, dtype=np.int64).reshape(k, GEO_COLUMNS) % 7
    geo[:, ROW] = [1, 2, 4, 6, 7]
    box = np.arange(k * 4, dtype=np.float64).reshape(k, 4) / 3
    data = torch.arange(50, dtype=torch.uint8)
    spans = np.array([[0, 10], [10, 12], [12, 30], [30, 31], [31, 50]], np.int64)
    chunk = GpuRows(data, spans, geo, box, "the dataset")

    class Other:   # the same chunk, as the general path takes it
        def batch(self) -> GpuBatch:
            return chunk.batch()

    for n in (8, 7, 3):
        fast, slow = plan_columns(SimpleNamespace(gpu_rows=[chunk]), n), plan_columns(SimpleNamespace(gpu_rows=[Other()]), n)
        assert np.array_equal(fast.geo, slow.geo) and np.array_equal(fast.box, slow.box)
        assert fast.data is slow.data is data and np.array_equal(fast.spans, slow.spans)
        assert fast.rows.tolist() == [r for r in [1, 2, 4, 6, 7] if r < n]
        assert [j.row for j in fast] == [j.row for j in slow] and fast._datasets == slow._datasets
    assert plan_columns(SimpleNamespace(gpu_rows=[chunk]), 8).geo is geo   # as it is: no copy


def test_a_chunk_that_does_not_fit_the_staging_buffer_is_counted() -> None:
    st = JpegStaging(torch.zeros(100, dtype=torch.uint8))
    assert st.reserve(60) == 0 and st.reserve(30) == 60
    assert st.reserve(20) is None and st.overflow == 20 and st.used == 90
    st.reset()
    assert st.reserve(100) == 0 and st.overflow == 0


# ---- the same jobs and pixels as the per-row path --------------------------------------------------------------------

@pytest.mark.parametrize("decode,share", [("gpu", None), ("auto", 0.5), ("auto", 1.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_at_once_hand_the_decoder_the_per_row_paths_jobs(packed: Path, monkeypatch: pytest.MonkeyPatch,
                                                              decode: str, share: float | None, threads: int) -> None:
    """Real pixels (a simplejpeg decoder): the batches bit for bit, and each chunk's jobs (rows, bytes,
    boxes, flips, windows, sizes, keys) those of the per-row path."""
    device = DeviceOptions("cpu", decode=decode, gpu_share=share, gpu_decoder=CpuDecoder())
    want, want_jobs = run(packed, device, CROP, monkeypatch, rows_at_once=False, threads=threads)
    device = DeviceOptions("cpu", decode=decode, gpu_share=share, gpu_decoder=CpuDecoder())
    got, got_jobs = run(packed, device, CROP, monkeypatch, rows_at_once=True, threads=threads)
    assert same(want, got)
    assert got_jobs == want_jobs and sum(len(c) for c in got_jobs) >= (12 if share == 0.5 else 30)


@pytest.mark.parametrize("decode,share", [("gpu", None), ("auto", 0.5)])
def test_the_native_planner_and_the_numpy_plan_hand_the_decoder_the_same_jobs(packed: Path,
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             decode: str, share: float | None) -> None:
    """The GPU's rows planned natively (the batch's NumPy plan deferred) and from the NumPy plan (no native
    planner): the same batches and jobs, padded windows among them, at one and three threads."""
    if not native.plans_rows():
        pytest.skip("the native extension is not built")
    ops = [RandomResizedCrop(48, scale=(0.05, 1.0)), RandomHorizontalFlip()]
    for ops in (ops, [Resize(30), CenterCrop(44)]):
        mk = lambda: DeviceOptions("cpu", decode=decode, gpu_share=share, gpu_decoder=CpuDecoder())  # noqa: E731
        want, want_jobs = run(packed, mk(), ops, monkeypatch, True, threads=1, native_plan=False)
        for threads in (1, 3):
            got, got_jobs = run(packed, mk(), ops, monkeypatch, True, threads=threads)
            assert same(want, got) and got_jobs == want_jobs and sum(len(c) for c in got_jobs) >= 12


def test_weighted_draws_hand_the_decoder_the_per_row_paths_jobs(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weighted sampling keys each draw's stream by its position (`key_by_draw`): the native planner too."""
    from stoker import Sampling

    weights = np.linspace(1.0, 4.0, len(stoker.open_dataset(packed)))
    mk = lambda: DeviceOptions("cpu", decode="gpu", gpu_decoder=CpuDecoder())  # noqa: E731
    want, want_jobs = run(packed, mk(), CROP, monkeypatch, False, batch=7, sampling=Sampling(weights=weights))
    got, got_jobs = run(packed, mk(), CROP, monkeypatch, True, batch=7, sampling=Sampling(weights=weights))
    assert same(want, got) and got_jobs == want_jobs and sum(len(c) for c in got_jobs) >= 30


def test_a_split_the_engine_does_not_serve_matches_the_per_row_path(packed: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """STOKER_ENGINE=off: the CPU's share on the Python path, the GPU's a chunk at a time."""
    monkeypatch.setenv("STOKER_ENGINE", "off")
    mk = lambda: DeviceOptions("cpu", decode="auto", gpu_share=0.5, gpu_decoder=CpuDecoder())  # noqa: E731
    want, want_jobs = run(packed, mk(), CROP, monkeypatch, False)
    got, got_jobs = run(packed, mk(), CROP, monkeypatch, True)
    assert same(want, got) and got_jobs == want_jobs and sum(len(c) for c in got_jobs) >= 12


def test_padded_windows_and_region_decode_match_the_per_row_path(packed: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A CenterCrop larger than most images (padded windows), decoded whole and as regions (the stand-in
    decodes the windows it is asked for)."""
    ops = [CenterCrop(120)]
    for dec in (lambda: CpuDecoder(), lambda: FixedRateDecoder(regions=True)):
        want, want_jobs = run(packed, DeviceOptions("cpu", decode="gpu", gpu_decoder=dec()), ops, monkeypatch, False)
        got, got_jobs = run(packed, DeviceOptions("cpu", decode="gpu", gpu_decoder=dec()), ops, monkeypatch, True)
        assert same(want, got) and got_jobs == want_jobs
        assert any(job[4].padded for chunk in got_jobs for job in chunk)


@pytest.mark.skipif(not native.engine_available(), reason="the native extension or its libjpeg is missing")
def test_png_raw_and_damaged_rows_take_the_per_row_path_with_the_same_results(mixed: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that are not JPEGs are rendered on the CPU, damaged JPEGs fail on the GPU stand-in and are
    replaced (on_error="skip") as on the per-row path."""
    for share in (None, 0.5):
        mk = lambda: DeviceOptions("cpu", decode="gpu" if share is None else "auto", gpu_share=share,  # noqa: E731
                                   gpu_decoder=CpuDecoder())
        want, want_jobs = run(mixed, mk(), CROP, monkeypatch, False)
        got, got_jobs = run(mixed, mk(), CROP, monkeypatch, True)
        assert same(want, got) and got_jobs == want_jobs


def test_nvimagecodec_cpu_backend_gives_the_per_row_paths_pixels(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.device.gpu_backends import NvImageCodecDecoder

    for regions in (False, True):
        try:
            want, _ = run(packed, DeviceOptions("cpu", decode="gpu", gpu_decoder=NvImageCodecDecoder(
                "cpu", regions=regions)), CROP, monkeypatch, False)
            got, _ = run(packed, DeviceOptions("cpu", decode="gpu", gpu_decoder=NvImageCodecDecoder(
                "cpu", regions=regions)), CROP, monkeypatch, True)
        except ConfigError as exc:
            pytest.skip(f"nvImageCodec's CPU backend is not usable here: {exc}")
        assert same(want, got)


# ---- the worker threads' Python per batch ----------------------------------------------------------------------------

def worker_calls(path: Path, batch: int, monkeypatch: pytest.MonkeyPatch, rows_at_once: bool) -> float:
    """Python calls per batch on the threads named stoker-worker-* (`threading.setprofile`), decode="gpu",
    one worker thread."""
    counts: dict[int, int] = {}

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call") and threading.current_thread().name.startswith("stoker-worker"):
            counts[threading.get_ident()] = counts.get(threading.get_ident(), 0) + 1

    with monkeypatch.context() as m:
        if not rows_at_once:
            m.setattr(render.Filler, "queue_gpu_rows", per_row)
        loader = Loader(path, batch, transforms=CROP, seed=0, workers=Workers(num_threads=1),
                        device=DeviceOptions("cpu", decode="gpu", gpu_decoder=FixedRateDecoder()))
        threading.setprofile(hook)
        try:
            it = iter(loader)
        finally:
            threading.setprofile(None)   # type: ignore[arg-type]
        n = sum(1 for _ in it)
        loader.close()
    return sum(counts.values()) / n


def test_the_workers_python_per_batch_does_not_grow_with_the_batch(jpegs: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Going from batches of 4 to batches of 20 JPEGs adds 16 rows per batch: the per-row path pays tens
    of calls for each, the chunk path a few for all of them."""
    assert all(stoker.open_dataset(jpegs).sample(i).encoding == "jpeg" for i in range(80))
    small, large = worker_calls(jpegs, 4, monkeypatch, True), worker_calls(jpegs, 20, monkeypatch, True)
    small_rows, large_rows = worker_calls(jpegs, 4, monkeypatch, False), worker_calls(jpegs, 20, monkeypatch, False)
    assert (large_rows - small_rows) / 16 > 20, (small_rows, large_rows)
    assert (large - small) / 16 < 3, (small, large)
