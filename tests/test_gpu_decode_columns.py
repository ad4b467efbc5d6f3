"""The GPU decode path's per-chunk passes (`gpu_decode`, `gpu_backends._decode_each`): inputs checked, decoded
images checked and placed, crop windows and strides gathered over the whole chunk at once. Each fast
pass must give exactly what the per-image path gives: the same pixels, the same failures naming the
same samples, in the same order."""

from __future__ import annotations

import gc
import sys
from typing import Any

import numpy as np
import pytest
import torch

from stoker.device import gpu_decode
from stoker.device.gpu_backends import _decode_each, as_layout, spans_views
from stoker.device.gpu_decode import GpuBatchDecoder, _Placed, layout_meta, resample_into
from stoker.errors import CorruptImageError
from stoker.loading.jobs import GpuBatch
from stoker.transforms import Pipeline, RandomHorizontalFlip, RandomResizedCrop, crop_window
from test_gpu_decode import SIZES, CpuDecoder, jobs_for, make_jpegs


def layouts(img: torch.Tensor) -> dict[str, torch.Tensor]:
    """One CHW uint8 image in the layouts a decoder may return (same pixels)."""
    c, h, w = img.shape
    padded = torch.zeros((c, h + 3, w + 5), dtype=torch.uint8)
    padded[:, 1:h + 1, 2:w + 2] = img
    big = torch.zeros(7 + img.numel(), dtype=torch.uint8)  # a view at a storage offset
    big[7:] = img.reshape(-1)
    return {"chw": img.contiguous(), "hwc": img.permute(1, 2, 0).contiguous().permute(2, 0, 1),
            "strided": padded[:, 1:h + 1, 2:w + 2], "offset": big[7:].view(c, h, w),
            "gray": img[:1].expand(3, h, w)}


@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_layout_meta_reads_each_image_back_from_the_joined_buffer(layout: str) -> None:
    """`layout_meta`'s starts and strides, over images joined back to back in one buffer (as
    `decode_chunk` joins a decoder's results), read every image's pixels back as [3, h, w]."""
    rng = np.random.default_rng(0)
    imgs = [torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)) for h, w in [(5, 7), (9, 4), (1, 6)]]
    stored = [img.permute(1, 2, 0).contiguous() if layout == "hwc" else img for img in imgs]
    flat = torch.cat([t.reshape(-1) for t in stored])
    meta = layout_meta(np.array([5, 9, 1]), np.array([7, 4, 6]), layout)
    assert meta.shape == (3, 6) and meta.dtype == np.int64
    for img, (base, sc, sy, sx, h, w) in zip(imgs, meta.tolist()):
        assert torch.equal(flat.as_strided((3, h, w), (sc, sy, sx), base), img)


def test_resample_is_the_same_whatever_the_layouts_and_grouping() -> None:
    """One chunk with its images in mixed layouts (CHW, interleaved, strided, at an offset, grayscale
    expanded) resamples to the same pixels as each image alone, made contiguous."""
    pipe = Pipeline([RandomResizedCrop(40), RandomHorizontalFlip()])
    jobs, _ = jobs_for(pipe, make_jpegs(seed=5), SIZES, seed=2)
    dec = CpuDecoder()
    placed, failures = GpuBatchDecoder(dec, "cpu").decode_chunk(jobs, 40, 40)
    assert failures == [] and len(placed) == len(jobs)
    alone = torch.zeros((len(jobs), 3, 40, 40), dtype=torch.uint8)
    for p in placed:
        resample_into([_Placed(p.job, p.img.contiguous(), p.src, p.dst, p.crop)], alone)
    assert any(p.job.flip for p in placed) and alone.float().std() > 10
    names = ["chw", "hwc", "offset"], ["chw", "hwc", "strided", "gray"]
    for k, pick in enumerate(names):
        out = torch.zeros_like(alone)
        mixed = [_Placed(p.job, layouts(p.img)[pick[i % len(pick)]], p.src, p.dst, p.crop)
                 for i, p in enumerate(placed)]
        resample_into(mixed, out)
        for p in mixed:   # each against itself alone, contiguous (the grayscale one has its own pixels)
            ref = torch.zeros_like(alone)
            resample_into([_Placed(p.job, p.img.contiguous(), p.src, p.dst, p.crop)], ref)
            assert torch.equal(out[p.job.row], ref[p.job.row]), (k, p.job.row)
        if k == 0:
            assert torch.equal(out, alone)


class MixedDecoder(CpuDecoder):
    """Returns, by position: a good image, a wrong size, grayscale, a float tensor, an exception, HWC;
    with `regions`, each cut to its window first; all good when `mix` is off."""

    mix = True

    def decode(self, datas: list[torch.Tensor], regions: list | None = None) -> list:
        out: list = []
        for i, d in enumerate(datas):
            img = self.one(d)
            if regions is not None:
                y0, y1, x0, x1 = regions[i]
                img = img[:, y0:y1, x0:x1]
            img = img.contiguous()
            kind = i % 6 if self.mix else 0
            out.append(img if kind == 0 else img[:, 1:] if kind == 1 else img[:1].contiguous() if kind == 2
                       else img.float() if kind == 3 else RuntimeError(f"bad {i}") if kind == 4
                       else img.permute(1, 2, 0).contiguous().permute(2, 0, 1))
        return out


@pytest.mark.parametrize("regions", [False, True])
def test_decoded_images_checked_in_one_pass_as_one_at_a_time(regions: bool, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """A chunk whose results are all fine is placed in one pass; a chunk with bad ones places the
    good ones the same way and fails the others with `_place`'s errors, naming each sample, in order."""
    pipe = Pipeline([RandomResizedCrop(32)])
    jobs, _ = jobs_for(pipe, make_jpegs(seed=9) * 2, SIZES * 2, seed=4)
    for i, j in enumerate(jobs):
        j.row, j.key = i, f"img/{i}"
        j.window = crop_window(j.box, j.height, j.width, j.height, j.width, 32, 32)

    dec = MixedDecoder()
    dec.regions = regions
    gpu = GpuBatchDecoder(dec, "cpu")
    slow: list = []
    place = GpuBatchDecoder._place

    def spy(self, job, img, win):
        slow.append(job.row)
        return place(self, job, img, win)

    monkeypatch.setattr(GpuBatchDecoder, "_place", spy)
    placed, failures = gpu.decode_chunk(jobs, 32, 32)
    kinds = [i % 6 for i in range(len(jobs))]
    assert [p.job.row for p in placed] == [i for i, k in enumerate(kinds) if k in (0, 2, 5)]
    assert [j.row for j, _ in failures] == [i for i, k in enumerate(kinds) if k in (1, 3, 4)]
    assert all(isinstance(e, CorruptImageError) and e.key == j.key for j, e in failures)
    # only the grayscale and the failing images went through `_place` (plus the exceptions' raise)
    assert slow == [i for i, k in enumerate(kinds) if k in (1, 2, 3)]
    for p in placed:
        win = p.job.window
        h, w = (win.src[1] - win.src[0], win.src[3] - win.src[2]) if regions else (p.job.height, p.job.width)
        assert p.img.shape == (3, h, w) and p.dst == win.dst
        assert p.src == ((0, h, 0, w) if regions else win.src) and p.crop == (p.src[1] - p.src[0], p.src[3] - p.src[2])
    # an all-good chunk: one pass, nothing through `_place`
    slow.clear()
    dec.mix = False
    placed, failures = gpu.decode_chunk(jobs, 32, 32)
    assert failures == [] and [p.job for p in placed] == jobs and slow == []


def test_decode_each_checks_inputs_in_one_pass_with_the_same_errors() -> None:
    """Valid inputs (a tensor subclass too) are decoded; each invalid one gets its own error, in place."""
    class Sub(torch.Tensor):
        pass

    good = torch.frombuffer(bytearray(b"\xff\xd8abc"), dtype=torch.uint8)
    datas = [good, torch.zeros(0, dtype=torch.uint8), good.as_subclass(Sub), torch.zeros(4), b"raw",
             torch.zeros((2, 2), dtype=torch.uint8), good]
    seen: list = []

    def call(batch):
        seen.append(len(batch))
        return [int(d.numel()) for d in batch]

    out = _decode_each(call, datas)
    assert seen == [3] and out[0] == 5 and out[2] == 5 and out[6] == 5
    assert [type(o).__name__ for o in out] == ["int", "ValueError", "int", "ValueError", "ValueError",
                                              "ValueError", "int"]
    assert "empty" in str(out[1]) and "float32" in str(out[3]) and "bytes" in str(out[4])
    assert _decode_each(call, [good, good]) == [5, 5] and seen[-1] == 2
    assert gpu_decode._decode_each is _decode_each


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> "Path":
    import stoker
    from conftest import jpeg_bytes
    from test_gpu_decode import textured

    root = tmp_path_factory.mktemp("gpucolumns")
    rng = np.random.default_rng(12)
    (root / "src" / "c0").mkdir(parents=True)
    for i in range(24):
        data = jpeg_bytes(textured(rng, 50 + 3 * i, 70 + 2 * i), quality=85)
        (root / "src" / "c0" / f"{i:02d}.jpg").write_bytes(data)
    stoker.pack(str(root / "src"), str(root / "packed"))
    return root / "packed"


class PickyDecoder(CpuDecoder):
    """Fails every input whose byte length is in `refuse`."""

    def __init__(self, refuse: set[int]) -> None:
        super().__init__()
        self.refuse = refuse

    def decode(self, datas: list[torch.Tensor]) -> list:
        out = super().decode(datas)
        return [RuntimeError("refused") if int(d.shape[0]) in self.refuse else img for d, img in zip(datas, out)]


def test_the_device_side_makes_a_job_only_for_a_row_that_fails(packed: "Path", monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The rows prepared a chunk at a time stay columns through decode and resample: an epoch that
    decodes every row makes no `GpuJob`; one whose decoder refuses some makes one per refused row,
    and its error (logged, then the CPU decode) names that sample. The pixels are the CPU path's for
    the refused rows, the same as the all-good epoch's GPU pixels elsewhere."""
    from stoker import DeviceOptions, Loader
    from stoker.loading import jobs
    from stoker.reader import open_dataset

    made: list[int] = []
    init = jobs.PlannedJob.__init__

    def spy(self, row, *args, **kwargs):
        made.append(row)
        init(self, row, *args, **kwargs)

    monkeypatch.setattr(jobs.PlannedJob, "__init__", spy)
    ops = [RandomResizedCrop(32), RandomHorizontalFlip()]
    good = Loader(packed, 8, transforms=ops, seed=3, order="sequential",
                  device=DeviceOptions("cpu", decode="gpu", gpu_decoder=CpuDecoder()))
    first = [x.clone() for x, _ in good]
    assert made == [] and good.stats.gpu_decoded >= 20 and good.stats.gpu_fallbacks == 0
    with open_dataset(packed) as ds:   # two rows the GPU decodes (stored as JPEGs, of lengths no other has)
        datas = [bytes(ds.sample(i).data) for i in range(24)]
        keys = [ds.sample(i).key for i in range(24)]
    lengths = [len(d) for d in datas]
    picked = [i for i in range(24) if datas[i][:2] == b"\xff\xd8" and lengths.count(lengths[i]) == 1][1::9][:2]
    assert len(picked) == 2
    refuse = {lengths[i] for i in picked}
    picky = Loader(packed, 8, transforms=ops, seed=3, order="sequential",
                   device=DeviceOptions("cpu", decode="gpu", gpu_decoder=PickyDecoder(refuse)))
    with caplog.at_level("INFO", logger="stoker"):
        second = [x.clone() for x, _ in picky]
    failed = [r.getMessage() for r in caplog.records if "GPU decode failed" in r.getMessage()]
    assert len(failed) == 2 and all(repr(keys[i]) in m for i, m in zip(picked, failed)), failed
    assert picky.stats.gpu_fallbacks == 2 and sorted(made) == sorted(i % 8 for i in picked)
    for b, (x, y) in enumerate(zip(first, second)):
        for r in range(x.shape[0]):
            if 8 * b + r not in picked:
                assert torch.equal(x[r], y[r]), (b, r)


class ColumnsDecoder(CpuDecoder):
    """`CpuDecoder` with the columns form (`GpuDecoder.decode_columns`), its images in `layout` order."""

    def decode_columns(self, data: torch.Tensor, spans: np.ndarray, regions: np.ndarray | None = None) -> list:
        return as_layout(self.decode(spans_views(data, spans)), self.layout)


def columns_of(jobs: list) -> GpuBatch:
    """`jobs` as columns: their bytes back to back in one buffer, each row's span in it."""
    batch = GpuBatch.of_jobs(jobs)
    sizes = np.array([j.data.numel() for j in jobs], np.int64)
    spans = np.stack([np.cumsum(sizes) - sizes, np.cumsum(sizes)], 1)
    return GpuBatch(batch.geo, batch.box, torch.cat([j.data for j in jobs]), spans, list(jobs), [None] * len(jobs))


@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_the_columns_form_gives_the_list_forms_pixels(layout: str) -> None:
    """A decoder's `decode_columns`, its images planar or interleaved, decodes and resamples a chunk to the
    same pixels as its list form (`decode`), one call for the whole chunk."""
    pipe = Pipeline([RandomResizedCrop(40), RandomHorizontalFlip()])
    jobs, _ = jobs_for(pipe, make_jpegs(seed=3), SIZES, seed=6)
    want = torch.zeros((len(jobs), 3, 40, 40), dtype=torch.uint8)
    assert GpuBatchDecoder(CpuDecoder(), "cpu").run(jobs, want) == []
    dec = ColumnsDecoder(layout)
    gpu = GpuBatchDecoder(dec, "cpu")
    placed, failures = gpu.decode_chunk(columns_of(jobs), 40, 40)
    assert failures == [] and dec.calls == [len(jobs)] and placed.meta[0, 2] == (3 * SIZES[0][1] if layout == "hwc"
                                                                                  else SIZES[0][1])
    got = torch.zeros_like(want)
    assert gpu.resample_chunk(placed, got) == []
    assert torch.equal(got, want) and want.float().std() > 10


def test_the_columns_form_fails_only_the_bad_rows() -> None:
    """An empty row fails without reaching the decoder; a call that raises is retried one row at a time."""
    pipe = Pipeline([RandomResizedCrop(32)])
    jobs, _ = jobs_for(pipe, make_jpegs(seed=9)[:4], SIZES[:4], seed=1)
    for i, j in enumerate(jobs):
        j.row, j.key = i, f"img/{i}"
    cols = columns_of(jobs)
    cols.spans[2, 1] = cols.spans[2, 0]   # row 2: no bytes

    class Raises(ColumnsDecoder):
        def decode_columns(self, data, spans, regions=None):
            if len(spans) > 1:
                raise RuntimeError("one bad image fails the whole call")
            return super().decode_columns(data, spans, regions)

    placed, failures = GpuBatchDecoder(Raises(), "cpu").decode_chunk(cols, 32, 32)
    assert placed.batch.rows.tolist() == [0, 1, 3] and [j.key for j, _ in failures] == ["img/2"]
    assert "empty" in str(failures[0][1])


def _calls_in(fn: Any) -> tuple[int, Any]:
    """The Python calls (functions, and C functions called from Python) `fn()` makes, those of a method
    named `decode_columns` (the decoder library's own) aside, and what it returns. The garbage of earlier
    tests is collected first and the collector kept off meanwhile: a collection in the middle would count
    the weak references it clears."""
    n = [-2]   # fn's own call, and the call that ends the count

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call") and frame.f_code.co_name != "decode_columns":
            n[0] += 1

    gc.collect()
    gc.disable()
    sys.setprofile(hook)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return n[0], result


def test_a_chunk_costs_the_same_calls_whatever_its_rows() -> None:
    """The chunk cut and decode_chunk, and resample_chunk, on columns make as many Python calls for 32 rows
    as for 8, and at most 11 and 18 (the decoder's own calls aside: the stand-in's work is in C)."""
    pipe = Pipeline([RandomResizedCrop(24), RandomHorizontalFlip()])
    jobs, _ = jobs_for(pipe, make_jpegs(seed=4) * 4, SIZES * 4, seed=2)
    for i, j in enumerate(jobs):   # planned as the workers plan them (`jobs.crop_windows`)
        j.row, j.window = i, crop_window(j.box, j.height, j.width, j.height, j.width, 24, 24)

    class Instant:   # decodes nothing: grey images of the stored sizes, made beforehand
        name, layout = "instant", "chw"

        def decode_columns(self, data, spans, regions=None):
            return list(grey[: len(spans)])

    counts = []
    for n in (8, 32):
        cols = columns_of(jobs[:n])
        grey = [torch.full((3, j.height, j.width), 9, dtype=torch.uint8) for j in jobs[:n]]
        gpu = GpuBatchDecoder(Instant(), "cpu")
        out = torch.zeros((n, 3, 24, 24), dtype=torch.uint8)
        cut, chunks = _calls_in(lambda: gpu.chunks(cols))
        decode, (placed, failures) = _calls_in(lambda: gpu.decode_chunk(chunks[0], 24, 24))
        resample, failed = _calls_in(lambda: gpu.resample_chunk(placed, out))
        assert len(chunks) == 1 and failures == failed == [] and int(out.min()) == int(out.max()) == 9
        counts.append((cut + decode, resample))
    assert counts[0] == counts[1], counts
    assert counts[1][0] <= 11 and counts[1][1] <= 18, counts
