"""The GPU decode path's per-chunk passes (`gpu_decode`, `gpu_backends._decode_each`): inputs checked, decoded
images checked and placed, crop windows and strides gathered over the whole chunk at once. Each fast
pass must give exactly what the per-image path gives: the same pixels, the same failures naming the
same samples, in the same order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoker.device import gpu_decode
from stoker.device.gpu_backends import _decode_each
from stoker.device.gpu_decode import GpuBatchDecoder, _dense, _flats, _Placed, resample_into
from stoker.errors import CorruptImageError
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


def test_flats_match_dense_for_every_layout() -> None:
    """`_flats` (two calls per image when every image is CHW or interleaved HWC) reads the same pixels
    at the same strides as `_dense` per image, also for chunks that take `_dense`'s path."""
    rng = np.random.default_rng(0)
    imgs = [torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)) for h, w in [(5, 7), (9, 4), (1, 6)]]
    for names in (["chw", "hwc", "offset"], ["chw", "strided", "gray", "hwc"]):
        chunk = [layouts(img)[name] for img, name in zip(imgs * 2, names)]
        flats, meta = _flats(chunk)
        assert meta.shape == (len(chunk), 4) and meta.dtype == np.int64
        for img, flat, (sc, sy, sx, n) in zip(chunk, flats, meta.tolist()):
            want, strides = _dense(img)
            assert (sc, sy, sx) == strides and n == want.numel() == flat.numel()
            assert torch.equal(flat, want)
            c, h, w = img.shape
            idx = torch.arange(c).view(c, 1, 1) * sc + torch.arange(h).view(1, h, 1) * sy + torch.arange(w) * sx
            assert torch.equal(flat[idx], img)


def test_resample_is_the_same_whatever_the_layouts_and_grouping() -> None:
    """One chunk with its images in mixed layouts (all taking the two-call path, or one forcing
    `_dense`'s) resamples to the same pixels as each image alone, made contiguous."""
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
