"""The GPU decode path on the CPU: GpuBatchDecoder driven by stand-in decoders (simplejpeg), checked
against the CPU crop path; crop_window's geometry as a property; make_decoder's errors.

tests/cuda/test_gpu_decode_cuda.py runs the real backends (TorchCodec, nvImageCodec) on a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import types
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker
from conftest import BrokenImport, jpeg_bytes, smooth_rgb
from stoker.device import gpu_backends, gpu_decode
from stoker.errors import ConfigError, CorruptImageError
from stoker.device.gpu_decode import GpuBatchDecoder, make_decoder
from stoker.loading.jobs import GpuJob
from stoker.order import sample_keys, uniforms
from stoker.transforms import (CenterCrop, Pipeline, RandomHorizontalFlip, RandomResizedCrop, Resize,
                               crop_resize_into, crop_window)


class CpuDecoder:
    """The GpuDecoder protocol with simplejpeg: CHW uint8 tensors on the CPU, a per-sample exception
    for bytes it cannot decode. Records the batch sizes it is called with."""

    name = "simplejpeg stand-in"

    def __init__(self, layout: str = "chw") -> None:
        self.calls: list[int] = []
        self.layout = layout

    def one(self, data: torch.Tensor) -> torch.Tensor:
        hwc = torch.from_numpy(simplejpeg.decode_jpeg(data.numpy(), colorspace="RGB"))
        return hwc.permute(2, 0, 1)  # a view, like nvImageCodec's interleaved images

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        self.calls.append(len(datas))
        out: list[torch.Tensor | Exception] = []
        for d in datas:
            try:
                img = self.one(d)
                out.append(img.contiguous() if self.layout == "chw" else img)
            except Exception as exc:
                out.append(exc)
        return out


class BatchRaisingDecoder(CpuDecoder):
    """Like TorchCodec: one bad image in a batch fails the whole call."""

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        out = super().decode(datas)
        bad = [o for o in out if isinstance(o, Exception)]
        if bad:
            raise RuntimeError(f"Error while decoding JPEG images: {bad[0]}")
        return out


def textured(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A photo-like gradient plus stripes (period ~10 px) and an off-centre blob: a one-pixel shift of
    the crop or a wrong mirror changes it a lot, while two bilinear resamplers agree closely."""
    base = smooth_rgb(rng, height, width).astype(np.float32)
    y = np.arange(height, dtype=np.float32)[:, None, None]
    x = np.arange(width, dtype=np.float32)[None, :, None]
    phase = rng.uniform(0, 2 * math.pi, size=(1, 1, 3))
    stripes = 35 * np.sin(2 * math.pi * (x / 10.0 + y / 23.0) + phase)
    blob = 60 * np.exp(-(((x - 0.2 * width) / (0.1 * width)) ** 2 + ((y - 0.3 * height) / (0.1 * height)) ** 2))
    return (0.6 * base + 50 + stripes + blob).clip(0, 255).astype(np.uint8)


def textured_pack(root: Path, seed: int, per_class: int, size: Callable[[int], tuple[int, int]]) -> Path:
    """Two classes of `per_class` textured JPEGs (quality 90), image i of size `size(i)` (height, width),
    packed into `root / "packed"`."""
    rng = np.random.default_rng(seed)
    for c in range(2):
        (root / "src" / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            data = jpeg_bytes(textured(rng, *size(i)), quality=90)
            (root / "src" / f"c{c}" / f"{i:02d}.jpg").write_bytes(data)
    stoker.pack(str(root / "src"), str(root / "packed"))
    return root / "packed"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 99.0 if mse == 0 else 10 * math.log10(255 ** 2 / mse)


SIZES = [(180, 240), (240, 180), (300, 300), (120, 400), (96, 64), (333, 250), (64, 64), (257, 199)]


def make_jpegs(seed: int = 0, sizes: list[tuple[int, int]] = SIZES) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [jpeg_bytes(textured(rng, h, w), quality=92) for h, w in sizes]


def jobs_for(pipe: Pipeline, jpegs: list[bytes], sizes: list[tuple[int, int]], seed: int = 0
             ) -> tuple[list[GpuJob], list[np.ndarray]]:
    """GpuJobs from the pipeline's plan, and the CPU path's rendering of each (from a full decode)."""
    n = len(jpegs)
    heights = np.array([h for h, _ in sizes])
    widths = np.array([w for _, w in sizes])
    u = uniforms(sample_keys(seed, 0, np.arange(n)), max(pipe.draws, 1))
    plan = pipe.plan(heights, widths, u)
    out_h, out_w = int(plan.size[0, 0]), int(plan.size[0, 1])
    jobs, refs = [], []
    for i, data in enumerate(jpegs):
        box = tuple(float(v) for v in plan.box[i])
        jobs.append(GpuJob(i, torch.frombuffer(bytearray(data), dtype=torch.uint8), box, bool(plan.flip[i]),
                           int(heights[i]), int(widths[i]), f"img-{i}.jpg"))
        full = simplejpeg.decode_jpeg(data, colorspace="RGB")
        ref = np.full((out_h, out_w, 3), 77, np.uint8)
        crop_resize_into(full, box, ref, bool(plan.flip[i]), int(heights[i]), int(widths[i]), plan.clip[i],
                         plan.grid[i])
        refs.append(ref)
    return jobs, refs


def rows(out: torch.Tensor) -> np.ndarray:
    return out.permute(0, 2, 3, 1).numpy()


def test_gpu_path_matches_the_cpu_crop_path() -> None:
    pipe = Pipeline([RandomResizedCrop(224), RandomHorizontalFlip()])
    jpegs = make_jpegs()
    jobs, refs = jobs_for(pipe, jpegs, SIZES, seed=3)
    assert 0 < sum(j.flip for j in jobs) < len(jobs)  # both mirrored and plain samples
    out = torch.zeros((len(jobs), 3, 224, 224), dtype=torch.uint8)
    failures = GpuBatchDecoder(CpuDecoder(), "cpu").run(jobs, out)
    assert failures == []
    got = rows(out)
    for i, (job, ref) in enumerate(zip(jobs, refs)):
        same = psnr(got[i], ref)
        assert same > 40, f"sample {i}: {same:.1f} dB against the CPU path"
        # The test can tell a wrong mirror or a crop one source pixel off from the right answer.
        assert psnr(got[i], ref[:, ::-1]) < 25, f"sample {i}: a mirrored crop would pass too"
        top, left, h, w = job.box
        for dy, dx in ((1, 0), (0, 1), (-1, 0), (0, -1)):
            shifted = np.zeros_like(ref)
            full = simplejpeg.decode_jpeg(jpegs[i], colorspace="RGB")
            crop_resize_into(full, (top + dy, left + dx, h, w), shifted, job.flip, job.height, job.width)
            if not np.array_equal(shifted, ref):  # a shift clamped at the image border changes nothing
                assert psnr(got[i], shifted) < same - 3, f"sample {i}: a crop off by ({dy}, {dx}) would pass too"


def test_interleaved_views_and_channels_last_output() -> None:
    # nvImageCodec hands back [H, W, 3] viewed as [3, H, W]; the Loader's batch is a channels_last view.
    pipe = Pipeline([RandomResizedCrop((96, 128)), RandomHorizontalFlip()])
    jpegs = make_jpegs(seed=1)
    jobs, refs = jobs_for(pipe, jpegs, SIZES, seed=5)
    nhwc = torch.zeros((len(jobs), 96, 128, 3), dtype=torch.uint8)
    out = nhwc.permute(0, 3, 1, 2)
    assert GpuBatchDecoder(CpuDecoder(layout="hwc"), "cpu").run(jobs, out) == []
    for i, ref in enumerate(refs):
        assert psnr(nhwc[i].numpy(), ref) > 30


@pytest.mark.parametrize("ops", [
    [CenterCrop(64)],
    [CenterCrop((70, 61)), RandomHorizontalFlip(p=1.0)],  # odd padding: the mirror moves the borders
    [Resize(30), CenterCrop(48), RandomHorizontalFlip(p=1.0)],  # padded and resized
])
def test_padded_center_crop_has_zero_borders_where_the_cpu_path_has_them(ops: list) -> None:
    sizes = [(41, 51), (40, 33), (64, 20)]
    jpegs = make_jpegs(seed=2, sizes=sizes)
    pipe = Pipeline(ops)
    jobs, refs = jobs_for(pipe, jpegs, sizes)
    oh, ow = refs[0].shape[:2]
    out = torch.full((len(jobs), 3, oh, ow), 200, dtype=torch.uint8)
    assert GpuBatchDecoder(CpuDecoder(), "cpu").run(jobs, out) == []
    got = rows(out)
    resized = any(isinstance(op, Resize) for op in ops)
    for i, ref in enumerate(refs):
        assert np.array_equal(got[i].max(axis=2) == 0, ref.max(axis=2) == 0) or resized
        ref_zero = (ref == 0).all(axis=2)
        got_zero = (got[i] == 0).all(axis=2)
        # Padding (whole zero rows/columns) sits in the same place on both paths.
        assert np.array_equal(ref_zero.all(axis=1), got_zero.all(axis=1))
        assert np.array_equal(ref_zero.all(axis=0), got_zero.all(axis=0))
        assert ref_zero.any(), "the case must pad"
        if not resized:  # a pure crop moves pixels without resampling: bit-identical
            assert np.array_equal(got[i], ref)
        else:
            assert psnr(got[i], ref) > 30


def test_chunks_stay_under_the_budget() -> None:
    sizes = [(100, 100), (200, 150), (50, 80), (400, 300), (120, 90), (90, 120), (300, 400), (60, 60)]
    jpegs = make_jpegs(seed=4, sizes=sizes)
    jobs, refs = jobs_for(Pipeline([CenterCrop(40)]), jpegs, sizes)
    budget = 3 * 200 * 200  # 120000 bytes: (400, 300) = 360000 is larger than the whole budget
    dec = CpuDecoder()
    gpu = GpuBatchDecoder(dec, "cpu", budget_bytes=budget)
    chunks = list(gpu.chunks(jobs))
    assert [j for c in chunks for j in c] == jobs  # every job once, in order
    for c in chunks:
        nbytes = sum(3 * j.height * j.width for j in c)
        assert nbytes <= budget or len(c) == 1
    assert [len(c) for c in chunks] == [2, 1, 1, 2, 1, 1]
    out = torch.zeros((len(jobs), 3, 40, 40), dtype=torch.uint8)
    assert gpu.run(jobs, out) == []
    assert dec.calls == [len(c) for c in chunks]
    for i, ref in enumerate(refs):
        assert np.array_equal(rows(out)[i], ref)


def test_a_chunk_is_released_before_the_next_is_decoded() -> None:
    class Watching(CpuDecoder):
        def __init__(self) -> None:
            super().__init__()
            self.previous: list[weakref.ref] = []
            self.alive_at_call: list[int] = []

        def decode(self, datas):
            gc.collect()
            self.alive_at_call.append(sum(r() is not None for r in self.previous))
            out = super().decode(datas)
            self.previous = [weakref.ref(t) for t in out if isinstance(t, torch.Tensor)]
            return out

    sizes = [(64, 64)] * 6
    jobs, _ = jobs_for(Pipeline([CenterCrop(32)]), make_jpegs(seed=6, sizes=sizes), sizes)
    dec = Watching()
    GpuBatchDecoder(dec, "cpu", budget_bytes=2 * 3 * 64 * 64).run(jobs, torch.zeros((6, 3, 32, 32), dtype=torch.uint8))
    assert dec.calls == [2, 2, 2]
    assert dec.alive_at_call == [0, 0, 0]


@pytest.mark.parametrize("decoder_cls", [CpuDecoder, BatchRaisingDecoder])
def test_a_bad_sample_fails_alone(decoder_cls: type) -> None:
    pipe = Pipeline([RandomResizedCrop(64), RandomHorizontalFlip()])
    jobs, refs = jobs_for(pipe, make_jpegs(seed=7), SIZES)
    jobs[2].data = torch.frombuffer(bytearray(b"\xff\xd8\xff" + b"not really a jpeg" * 20), dtype=torch.uint8)
    jobs[5].data = torch.zeros(0, dtype=torch.uint8)  # empty bytes: refused before reaching the decoder
    dec = decoder_cls()
    out = torch.full((len(jobs), 3, 64, 64), 9, dtype=torch.uint8)
    failures = GpuBatchDecoder(dec, "cpu").run(jobs, out)
    assert [job.row for job, _ in failures] == [2, 5]
    for job, exc in failures:
        assert isinstance(exc, CorruptImageError) and exc.key == job.key and job.key in str(exc)
    assert "empty" in str(failures[1][1])
    got = rows(out)
    for i, ref in enumerate(refs):
        if i in (2, 5):
            assert (got[i] == 9).all()  # left for the CPU fallback to write
        else:
            assert psnr(got[i], ref) > 30
    if decoder_cls is BatchRaisingDecoder:
        assert dec.calls[0] == len(jobs) - 1 and dec.calls[1:] == [1] * (len(jobs) - 1)  # then one at a time
    else:
        assert dec.calls == [len(jobs) - 1]


def test_a_decoder_that_raises_for_everything_fails_every_sample_without_raising() -> None:
    class Broken(CpuDecoder):
        def decode(self, datas):
            raise RuntimeError("nvjpeg exploded")

    sizes = SIZES[:3]
    jobs, _ = jobs_for(Pipeline([CenterCrop(16)]), make_jpegs(sizes=sizes), sizes)
    failures = GpuBatchDecoder(Broken(), "cpu").run(jobs, torch.zeros((3, 3, 16, 16), dtype=torch.uint8))
    assert [j.row for j, _ in failures] == [0, 1, 2]
    assert all("nvjpeg exploded" in str(e) and "simplejpeg stand-in" in str(e) for _, e in failures)


def test_size_mismatch_is_a_failure_naming_both_sizes() -> None:
    sizes = SIZES[:3]
    jobs, refs = jobs_for(Pipeline([CenterCrop(32)]), make_jpegs(sizes=sizes), sizes)
    jobs[1].height, jobs[1].width = 999, 77  # the dataset's stored size disagrees with the bytes
    out = torch.zeros((3, 3, 32, 32), dtype=torch.uint8)
    failures = GpuBatchDecoder(CpuDecoder(), "cpu").run(jobs, out)
    assert len(failures) == 1
    job, exc = failures[0]
    assert job is jobs[1] and isinstance(exc, CorruptImageError) and exc.key == "img-1.jpg"
    assert f"{sizes[1][0]}x{sizes[1][1]}" in str(exc) and "999x77" in str(exc)
    assert np.array_equal(rows(out)[0], refs[0]) and np.array_equal(rows(out)[2], refs[2])


def test_grayscale_and_odd_decoder_results() -> None:
    class Odd(CpuDecoder):
        def decode(self, datas):
            out = super().decode(datas)
            return [out[0][:1], "not a tensor", out[2].float()]  # 1 channel, junk, wrong dtype

    gray = np.asarray(smooth_rgb(np.random.default_rng(0), 48, 40)[..., 0])
    data = [jpeg_bytes(gray), jpeg_bytes(gray), jpeg_bytes(gray)]
    sizes = [(48, 40)] * 3
    jobs, _ = jobs_for(Pipeline([CenterCrop(24)]), data, sizes)
    out = torch.zeros((3, 3, 24, 24), dtype=torch.uint8)
    failures = GpuBatchDecoder(Odd(), "cpu").run(jobs, out)
    assert [j.row for j, _ in failures] == [1, 2]
    one = out[0]
    assert torch.equal(one[0], one[1]) and torch.equal(one[1], one[2]) and one.float().mean() > 10


def test_run_checks_its_output_tensor() -> None:
    jobs, _ = jobs_for(Pipeline([CenterCrop(8)]), make_jpegs(sizes=[(16, 16)]), [(16, 16)])
    gpu = GpuBatchDecoder(CpuDecoder(), "cpu")
    with pytest.raises(ValueError, match="uint8"):
        gpu.run(jobs, torch.zeros((1, 3, 8, 8), dtype=torch.float32))
    with pytest.raises(ValueError, match="outside the batch"):
        jobs[0].row = 4
        gpu.run(jobs, torch.zeros((1, 3, 8, 8), dtype=torch.uint8))
    assert gpu.run([], torch.zeros((1, 3, 8, 8), dtype=torch.uint8)) == []
    with pytest.raises(ConfigError, match="budget_bytes"):
        GpuBatchDecoder(CpuDecoder(), "cpu", budget_bytes=0)


def test_make_decoder_errors_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"one of \('auto', 'torchcodec', 'nvimgcodec'\)"):
        make_decoder("nvdec", "cuda")
    with pytest.raises(ConfigError, match="'torchvision' is no longer offered: torchvision deprecated .* use 'torchcodec'"):
        make_decoder("torchvision", "cuda")
    with pytest.raises(ConfigError, match="'nvimgcodec-cuda' is no longer offered: 'nvimgcodec' uses the CUDA"):
        make_decoder("nvimgcodec-cuda", "cuda")
    # No library importable (whatever this machine has installed).
    monkeypatch.setitem(sys.modules, "torchcodec", None)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)
    with pytest.raises(ConfigError) as info:
        make_decoder("auto", "cuda")
    msg = str(info.value)
    assert "pip install 'nvidia-nvimgcodec-cu" in msg and "decode='cpu'" in msg
    assert "pip install torchcodec (0.16 or newer" in msg
    with pytest.raises(ConfigError, match="pip install torchcodec"):
        make_decoder("torchcodec", "cuda")
    with pytest.raises(ConfigError, match="pip install 'nvidia-nvimgcodec-cu"):
        make_decoder("nvimgcodec", 0)


def test_make_decoder_needs_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_decode.TorchCodecDecoder, "load", staticmethod(lambda: None))
    with pytest.raises(ConfigError, match="needs a CUDA device, got cpu"):
        make_decoder("torchcodec", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA build of torch"):
            make_decoder("torchcodec", "cuda")


def test_decoder_protocol_is_satisfied_by_the_stand_in() -> None:
    assert isinstance(CpuDecoder(), gpu_decode.GpuDecoder)


# ---- crop_window ---------------------------------------------------------------------------------

@st.composite
def crop_cases(draw: st.DrawFn) -> tuple:
    full_h = draw(st.integers(1, 5000))
    full_w = draw(st.integers(1, 5000))
    n = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]))  # a DCT-scaled source, or the full image
    src_h, src_w = math.ceil(full_h * n / 8), math.ceil(full_w * n / 8)
    top = draw(st.floats(-2.0 * full_h, 2.0 * full_h))
    left = draw(st.floats(-2.0 * full_w, 2.0 * full_w))
    height = draw(st.floats(1e-3, 3.0 * full_h))
    width = draw(st.floats(1e-3, 3.0 * full_w))
    out_h, out_w = draw(st.integers(1, 1024)), draw(st.integers(1, 1024))
    return (top, left, height, width), src_h, src_w, full_h, full_w, out_h, out_w


@settings(max_examples=400, deadline=None)
@given(crop_cases())
def test_crop_windows_are_in_range_and_never_empty(case: tuple) -> None:
    box, src_h, src_w, full_h, full_w, out_h, out_w = case
    win = crop_window(box, src_h, src_w, full_h, full_w, out_h, out_w)
    sy0, sy1, sx0, sx1 = win.src
    dy0, dy1, dx0, dx1 = win.dst
    assert 0 <= sy0 < sy1 <= src_h and 0 <= sx0 < sx1 <= src_w
    assert 0 <= dy0 < dy1 <= out_h and 0 <= dx0 < dx1 <= out_w
    assert all(isinstance(v, int) for v in (*win.src, *win.dst))
    if not win.padded:
        assert win.dst == (0, out_h, 0, out_w)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 3000), st.integers(2, 3000), st.data())
def test_planned_boxes_inside_the_image_never_pad(full_h: int, full_w: int, data: st.DataObject) -> None:
    # Boxes that the planner makes for RandomResizedCrop/Resize lie inside the image.
    bh = data.draw(st.integers(1, full_h))
    bw = data.draw(st.integers(1, full_w))
    top = data.draw(st.integers(0, full_h - bh))
    left = data.draw(st.integers(0, full_w - bw))
    win = crop_window((float(top), float(left), float(bh), float(bw)), full_h, full_w, full_h, full_w, 224, 224)
    assert not win.padded
    assert win.src == (top, top + bh, left, left + bw)


# ---- the backend wrappers, driven by stand-in modules -------------------------------------------------

def decode_or_raise(data: torch.Tensor) -> np.ndarray:
    return simplejpeg.decode_jpeg(data.numpy(), colorspace="RGB")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """CUDA streams and device contexts as no-ops that log what the wrappers ask for."""
    log: list[str] = []

    class Stream:
        cuda_stream = 1234

        def __init__(self, name: str = "caller", device: object = None) -> None:
            self.name = name

        def synchronize(self) -> None:
            log.append("sync")

        def wait_stream(self, other: "Stream") -> None:
            log.append(f"{self.name} waits {other.name}")

    @contextlib.contextmanager
    def on(stream: Stream):
        log.append(f"on {stream.name}")
        yield

    class Event:
        def record(self, stream: Stream) -> None:
            log.append(f"event on {stream.name}")

        def synchronize(self) -> None:
            log.append("sync")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream("decode", device))
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(f"record {s.name}"), raising=False)
    monkeypatch.setattr(gpu_backends, "_cuda_device", lambda device: torch.device("cpu"))
    return log


def fake_decode_jpeg(log: list[str], rgb: object):
    """A library decode_jpeg(list, mode=..., device=...) on a CUDA device (CPU tensors here) that logs
    its calls and, like TorchCodec, fails the whole call for one bad image."""
    def decode_jpeg(batch, mode, device):
        assert isinstance(batch, list) and mode == rgb and device == torch.device("cuda", 0)
        log.append(f"decode {len(batch)}")
        try:  # no partial results
            return [torch.from_numpy(decode_or_raise(d)).permute(2, 0, 1).contiguous() for d in batch]
        except Exception as exc:
            raise RuntimeError(f"Error while decoding JPEG images: {exc}") from None
    return decode_jpeg


def fake_torchcodec(monkeypatch: pytest.MonkeyPatch, log: list[str]) -> None:
    decoders = types.SimpleNamespace(decode_jpeg=fake_decode_jpeg(log, "RGB"))
    monkeypatch.setitem(sys.modules, "torchcodec", types.SimpleNamespace(__version__="0.17.0", decoders=decoders))
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", decoders)


def test_the_torchcodec_wrapper_batches_and_retries_on_its_own_stream_without_host_syncs(
        monkeypatch: pytest.MonkeyPatch, fake_cuda: list[str]) -> None:
    monkeypatch.setattr(gpu_backends, "_cuda_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # whatever this machine has installed
    fake_torchcodec(monkeypatch, fake_cuda)
    dec = make_decoder("auto", "cuda")  # probes once with a tiny JPEG
    assert isinstance(dec, gpu_decode.TorchCodecDecoder) and dec.name == "TorchCodec 0.17.0 nvJPEG"
    one = ["on decode", "decode 1", "caller waits decode", "record caller"]
    assert fake_cuda == one
    fake_cuda.clear()
    jpegs = make_jpegs(sizes=[(32, 40), (24, 24)])
    datas = [torch.frombuffer(bytearray(jpegs[0]), dtype=torch.uint8), torch.frombuffer(bytearray(b"junk" * 9),
             dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8), torch.frombuffer(bytearray(jpegs[1]),
                                                                                     dtype=torch.uint8)]
    outs = dec.decode(datas)
    assert [type(o).__name__ for o in outs] == ["Tensor", "RuntimeError", "ValueError", "Tensor"]
    assert tuple(outs[0].shape) == (3, 32, 40) and tuple(outs[3].shape) == (3, 24, 24)
    # Every call runs on the decode stream (whatever the library synchronizes waits for the decode alone),
    # the caller's stream waits for it on the GPU, and each output is recorded on the caller's stream
    # (pytorch/vision#9606); a failed batch goes one by one.
    assert fake_cuda == ["on decode", "decode 3"] + one + ["on decode", "decode 1"] + one
    assert "sync" not in fake_cuda


def test_a_torchcodec_without_image_decoding_names_the_version_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchcodec", types.SimpleNamespace(__version__="0.9.0"))
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", types.SimpleNamespace())  # video only
    with pytest.raises(ConfigError, match=r"TorchCodec 0.9.0 cannot decode images; 0.16 or newer can.*pip install torchcodec"):
        make_decoder("torchcodec", "cuda")


def on_fake_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nvImageCodec wrapper as on a CUDA device (a torch.device("cuda", 0) that holds no memory here):
    the fake library's host arrays become CPU tensors where the real one's device images would become
    CUDA tensors."""
    monkeypatch.setattr(gpu_backends, "_cuda_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(gpu_decode.NvImageCodecDecoder, "_tensor",
                        lambda self, img: torch.from_numpy(np.asarray(img)).permute(2, 0, 1))


def test_nvimgcodec_wrapper_handles_none_and_dropped_images(monkeypatch: pytest.MonkeyPatch,
                                                            fake_cuda: list[str]) -> None:
    """An early release (no BackendKind, ColorSpec.RGB, failed images dropped or None) on a CUDA device:
    decoded on the caller's current stream. tests/test_nvimgcodec.py runs the real library."""
    on_fake_cuda_device(monkeypatch)
    class ColorSpec:
        RGB = "rgb-spec"

    class DecodeParams:
        def __init__(self, apply_exif_orientation: bool = True, color_spec: str = "", allow_any_depth: bool = False):
            self.apply_exif_orientation, self.color_spec = apply_exif_orientation, color_spec

    class Decoder:
        drop_failed = False  # releases before None entries dropped failed images from the list

        def __init__(self, device_id: int | None = None, max_num_cpu_threads: int = 0) -> None:
            self.calls: list[int] = []

        def decode(self, srcs, params, cuda_stream):
            assert params.color_spec == "rgb-spec" and not params.apply_exif_orientation and cuda_stream == 1234
            assert all(isinstance(s, np.ndarray) and s.dtype == np.uint8 for s in srcs)
            self.calls.append(len(srcs))
            out = []
            for s in srcs:
                try:
                    out.append(simplejpeg.decode_jpeg(s, colorspace="RGB"))  # HWC, like nvimgcodec.Image
                except Exception:
                    if not self.drop_failed:
                        out.append(None)
            return out

    fake = types.SimpleNamespace(__version__="0.6.0", Decoder=Decoder, DecodeParams=DecodeParams, ColorSpec=ColorSpec)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    jpegs = make_jpegs(sizes=[(32, 40), (24, 24)])
    datas = [torch.frombuffer(bytearray(jpegs[0]), dtype=torch.uint8),
             torch.frombuffer(bytearray(b"junk" * 9), dtype=torch.uint8),
             torch.frombuffer(bytearray(jpegs[1]), dtype=torch.uint8)]
    for drop in (False, True):
        Decoder.drop_failed = drop
        dec = make_decoder("nvimgcodec", "cuda")
        assert dec.name == "nvImageCodec 0.6.0"
        outs = dec.decode(datas)
        assert [type(o).__name__ for o in outs] == ["Tensor", "RuntimeError", "Tensor"]
        assert tuple(outs[0].shape) == (3, 32, 40) and tuple(outs[2].shape) == (3, 24, 24)
        assert dec._decoder.calls == ([1, 3] if not drop else [1, 3, 1, 1, 1])  # probe, batch, (retries)
    # queued on the current stream; no host wait here (GpuBatchDecoder orders the chunks: see below)
    assert fake_cuda == [] and dec.writes_at_call


def fake_nvimgcodec_09(log: list[str]) -> types.SimpleNamespace:
    """nvImageCodec 0.9's Python API as the wrapper calls it on a CUDA device: backends by kind,
    ColorSpec.SRGB, a Decoder that logs its decode calls (host arrays here, device images there)."""
    class Decoder:
        def __init__(self, device_id: int = -1, backends: list | None = None, max_num_cpu_threads: int = 0) -> None:
            self.kinds = [b.kind for b in backends or []]
            self.threads = max_num_cpu_threads

        def decode(self, srcs, params, cuda_stream):
            assert cuda_stream == 1234
            log.append(f"decode {len(srcs)}")
            return [simplejpeg.decode_jpeg(s, colorspace="RGB") for s in srcs]

    kinds = types.SimpleNamespace(HW_GPU_ONLY="hw", GPU_ONLY="gpu", HYBRID_CPU_GPU="hybrid", CPU_ONLY="cpu")
    return types.SimpleNamespace(
        __version__="0.9.0", Decoder=Decoder, BackendKind=kinds, Backend=lambda kind: types.SimpleNamespace(kind=kind),
        ColorSpec=types.SimpleNamespace(SRGB="srgb"), NVIMGCODEC_DEVICE_CPU_ONLY=-99,
        DecodeParams=lambda **kw: types.SimpleNamespace(**kw))


def test_nvimgcodec_takes_the_hardware_engines_first_with_few_threads_and_no_host_wait(
        monkeypatch: pytest.MonkeyPatch, fake_cuda: list[str]) -> None:
    """The engines first, the CUDA decoders for the rest; its CPU stages bounded (the library's default is one
    thread per core, beside the Loader's workers); the wrapper itself never waits on the host (it used to
    wait for the whole stream before every decode)."""
    on_fake_cuda_device(monkeypatch)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake_nvimgcodec_09(fake_cuda))
    dec = make_decoder("nvimgcodec", "cuda")
    assert dec._decoder.kinds == ["hw", "gpu", "hybrid"]
    assert dec._decoder.threads == gpu_decode.NVIMGCODEC_CPU_THREADS <= 4
    assert dec.writes_at_call and dec.name == "nvImageCodec 0.9.0 hardware JPEG first"
    fake_cuda.clear()
    jpegs = make_jpegs(sizes=[(32, 40), (24, 24)])
    outs = dec.decode([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in jpegs])
    assert [tuple(o.shape) for o in outs] == [(3, 32, 40), (3, 24, 24)]
    assert fake_cuda == ["decode 2"]


def test_a_decoder_that_writes_when_called_waits_for_the_previous_chunks_reads_only(
        fake_cuda: list[str]) -> None:
    """The hardware engines may be handed memory freed by the previous chunk's images while the resampling
    still reads it: before each decode the host waits for an event recorded after those reads (the
    previous batch's last chunk included), not for everything queued on the stream."""
    class Engines(CpuDecoder):
        writes_at_call = True

        def decode(self, datas):
            fake_cuda.append(f"decode {len(datas)}")
            return super().decode(datas)

    sizes = [(64, 64)] * 6
    jobs, _ = jobs_for(Pipeline([CenterCrop(32)]), make_jpegs(seed=6, sizes=sizes), sizes)
    gpu = GpuBatchDecoder(Engines(), "cpu", budget_bytes=2 * 3 * 64 * 64)  # three chunks of two
    out = torch.zeros((6, 3, 32, 32), dtype=torch.uint8)
    assert gpu.run(jobs, out) == []
    chunk = ["decode 2", "event on caller"]
    assert fake_cuda == chunk + ["sync"] + chunk + ["sync"] + chunk
    fake_cuda.clear()
    assert gpu.run(jobs[:2], out) == []
    assert fake_cuda == ["sync"] + chunk
    fake_cuda.clear()
    assert GpuBatchDecoder(CpuDecoder(), "cpu").run(jobs, out) == [] and fake_cuda == []  # in stream order: no wait


def test_a_backend_that_fails_its_probe_is_skipped_by_auto(monkeypatch: pytest.MonkeyPatch,
                                                           fake_cuda: list[str]) -> None:
    def decode_jpeg(batch, mode, device):
        raise RuntimeError("DecodeJpegCuda: torchcodec not compiled with nvJPEG support")

    decoders = types.SimpleNamespace(decode_jpeg=decode_jpeg)
    monkeypatch.setitem(sys.modules, "torchcodec", types.SimpleNamespace(__version__="0.17.0", decoders=decoders))
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", decoders)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)
    with pytest.raises(ConfigError) as info:
        make_decoder("auto", "cuda")
    msg = str(info.value)
    assert "not compiled with nvJPEG support" in msg and "pip install 'nvidia-nvimgcodec-cu" in msg


# ---- the batched resample against the per-sample path it replaced ---------------------------------------

def per_sample_write(job: GpuJob, img: torch.Tensor, dst: torch.Tensor) -> None:
    """The former per-sample GPU path (about eight dispatched ops a sample): crop, F.interpolate
    bilinear (antialiased when shrinking in either axis), round, clamp, flip, store."""
    import torch.nn.functional as F

    _, h, w = img.shape
    out_h, out_w = dst.shape[1], dst.shape[2]
    win = crop_window(job.box, h, w, h, w, out_h, out_w)
    sy0, sy1, sx0, sx1 = win.src
    dy0, dy1, dx0, dx1 = win.dst
    if job.flip:
        dx0, dx1 = out_w - dx1, out_w - dx0
    if win.padded:
        dst.zero_()
    region = img[:, sy0:sy1, sx0:sx1]
    th, tw = dy1 - dy0, dx1 - dx0
    if region.shape[1] == th and region.shape[2] == tw:
        result = region
    else:
        shrink = region.shape[1] > th or region.shape[2] > tw
        x = F.interpolate(region.unsqueeze(0).float(), size=(th, tw), mode="bilinear", align_corners=False,
                          antialias=shrink)
        result = x[0].round_().clamp_(0, 255)
    if job.flip:
        result = result.flip(-1)
    dst[:, dy0:dy1, dx0:dx1].copy_(result)


# Tolerance: the batched path computes the same interpolation weights but sums in another order
# (two matrix products instead of torch's separable kernels), so a value that lands within ~1e-5 of
# a .5 boundary may round the other way: at most 1 level, on well under 1% of the values.
@pytest.mark.parametrize("ops, sizes", [
    ([RandomResizedCrop(224), RandomHorizontalFlip()], SIZES),
    ([RandomResizedCrop((96, 128), scale=(0.02, 1.0)), RandomHorizontalFlip()], SIZES),
    ([Resize(300), CenterCrop(280), RandomHorizontalFlip(p=1.0)], SIZES[:4]),  # upscaling
    ([Resize(30), CenterCrop(48), RandomHorizontalFlip(p=1.0)], [(41, 51), (40, 33), (64, 20)]),  # padded
    ([CenterCrop((70, 61)), RandomHorizontalFlip(p=0.5)], [(41, 51), (40, 33), (64, 20), (90, 90)]),
])
def test_batched_resample_matches_the_per_sample_path(ops: list, sizes: list) -> None:
    pipe = Pipeline(ops)
    jpegs = make_jpegs(seed=12, sizes=sizes)
    jobs, refs = jobs_for(pipe, jpegs, sizes, seed=4)
    oh, ow = refs[0].shape[:2]
    imgs = [CpuDecoder().one(j.data).contiguous() for j in jobs]
    want = torch.full((len(jobs), 3, oh, ow), 5, dtype=torch.uint8)
    for job, img in zip(jobs, imgs):
        per_sample_write(job, img, want[job.row])
    got = torch.full_like(want, 5)
    assert GpuBatchDecoder(CpuDecoder(), "cpu").run(jobs, got) == []
    diff = (got.int() - want.int()).abs()
    assert int(diff.max()) <= 1, f"max difference {int(diff.max())} levels"
    assert float((diff > 0).float().mean()) < 0.01


def test_batched_resample_respects_its_budget_and_row_order() -> None:
    pipe = Pipeline([RandomResizedCrop(32), RandomHorizontalFlip()])
    jobs, refs = jobs_for(pipe, make_jpegs(seed=13), SIZES, seed=1)
    groups: list[tuple[int, int]] = []
    real = gpu_decode.resample_into

    def spy(group, out, crop_max=None):
        ch, cw = (group.src[:, 1::2] - group.src[:, ::2]).max(0)
        assert crop_max is None or tuple(crop_max) == (ch, cw)
        groups.append((len(group), gpu_decode.working_set(len(group), ch, cw, 32, 32)))
        real(group, out, crop_max)

    budget = int(3 * gpu_decode.working_set(1, 300, 400, 32, 32))   # any crop of SIZES fits alone
    gpu = GpuBatchDecoder(CpuDecoder(), "cpu", resample_budget_bytes=budget)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_decode, "resample_into", spy)
        small = torch.zeros((len(jobs), 3, 32, 32), dtype=torch.uint8)
        assert gpu.run(jobs, small) == []
    assert len(groups) > 1 and sum(n for n, _ in groups) == len(jobs)  # cut into groups under the budget
    assert all(need <= budget for _, need in groups), (groups, budget)
    whole = torch.zeros_like(small)
    assert GpuBatchDecoder(CpuDecoder(), "cpu").run(jobs, whole) == []
    assert torch.equal(small, whole)  # grouping changes nothing
    for i, ref in enumerate(refs):
        assert psnr(rows(whole)[i], ref) > 28



@pytest.mark.parametrize("backend, hint", [("torchcodec", "pip install torchcodec"),
                                           ("nvimgcodec", "pip install 'nvidia-nvimgcodec-cu")])
def test_a_backend_whose_import_raises_anything_is_a_config_error(monkeypatch: pytest.MonkeyPatch, backend: str,
                                                                  hint: str) -> None:
    for name in ("torchcodec", "torchcodec.decoders", "nvidia", "nvidia.nvimgcodec"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenImport("torchcodec", "torchcodec.decoders", "nvidia", "nvidia.nvimgcodec"),
                                           *sys.meta_path])
    with pytest.raises(ConfigError) as info:
        make_decoder(backend, "cuda")
    assert "RuntimeError" in str(info.value) and hint in str(info.value) and "decode='cpu'" in str(info.value)


def test_auto_takes_the_first_backend_that_works_and_makes_no_other(monkeypatch: pytest.MonkeyPatch,
                                                                    fake_cuda: list[str]) -> None:
    """Deterministic: TorchCodec, else nvImageCodec. The runtime timer it replaces kept every candidate
    alive (an nvJPEG state, a stream and a thread per core each) and synchronized the device."""
    made: list[str] = []
    fake = fake_nvimgcodec_09(fake_cuda)
    real = fake.Decoder
    fake.Decoder = lambda **kw: made.append("nvimgcodec") or real(**kw)
    on_fake_cuda_device(monkeypatch)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    for name in ("torchcodec", "torchcodec.decoders"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with monkeypatch.context() as broken:  # a TorchCodec built for another torch: passed over
        broken.setattr(sys, "meta_path", [BrokenImport("torchcodec", "torchcodec.decoders"), *sys.meta_path])
        assert isinstance(make_decoder("auto", "cuda"), gpu_decode.NvImageCodecDecoder) and made == ["nvimgcodec"]
    made.clear()
    fake_torchcodec(monkeypatch, fake_cuda)
    assert isinstance(make_decoder("auto", "cuda"), gpu_decode.TorchCodecDecoder) and made == []
    assert "sync" not in fake_cuda
