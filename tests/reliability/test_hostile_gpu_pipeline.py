"""The pipelined GPU decode path (device/gpu_pipeline.py) with decoders that misbehave, on the CPU.

Decoders through the `gpu_decoder=` object API (`tests/gpu_standin.FixedRateDecoder` underneath)
that raise on some images, return the wrong shape, the wrong count, the wrong type or dtype, an
exception object, nothing at all; that hang; that raise while batches are in flight. Each bad image
is decoded again on the CPU (the log names it), a sample the CPU cannot decode either is a
SampleError (or a named replacement), a hang is a LoaderTimeoutError naming the decoder and the
timeout, and stopping mid-pipeline (break, an exception in the consumer, a dropped iterator) leaves
no stoker thread behind.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from stoker import DeviceOptions, Loader, Workers
from stoker.errors import ConfigError, ImageError, LoaderTimeoutError, SampleError
from gpu_standin import FixedRateDecoder
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

from .rhelpers import jpeg_bytes, run_child, smooth_rgb, write_pack

CROP = [RandomResizedCrop(48), RandomHorizontalFlip()]
N = 40


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(7)
    rows = []
    for i in range(N):
        h, w = 64 + 3 * i, 80 + 2 * i
        rows.append((f"img/{i:02d}", jpeg_bytes(smooth_rgb(rng, h, w), quality=90), h, w))
    return write_pack(tmp_path_factory.mktemp("gpu-hostile") / "pack", rows)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of pack with two rows whose bytes no decoder reads (a truncated JPEG, text)."""
    rng = np.random.default_rng(8)
    rows = []
    for i in range(N):
        h, w = 64 + 3 * i, 80 + 2 * i
        data = jpeg_bytes(smooth_rgb(rng, h, w), quality=90)
        if i == 13:
            data = data[:40]
        elif i == 27:
            data = b"text stored as a JPEG row\n" * 8
        rows.append((f"img/{i:02d}", data, h, w))
    return write_pack(tmp_path_factory.mktemp("gpu-damaged") / "pack", rows)


def _stoker_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("stoker"))


def _no_stoker_thread_left(timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while _stoker_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return _stoker_threads()


def _loader(path: Path, decoder, on_error: str = "raise", timeout: float = 30.0, split: bool = False) -> Loader:
    device = (DeviceOptions("cpu", decode="auto", gpu_decoder=decoder, gpu_share=0.5) if split else
              DeviceOptions("cpu", decode="gpu", gpu_decoder=decoder))
    return Loader(path, 8, transforms=CROP, seed=3, workers=Workers(num_threads=2, on_error=on_error, timeout=timeout),
                  device=device)


def _epoch(loader: Loader) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for x, y in loader:
        xs.append(x.numpy().copy())
        ys.append(y.numpy().copy())
    return np.concatenate(xs), np.concatenate(ys)


# ---- decoders that fail some or all images ----------------------------------------------------------

class RaisesOnSome(FixedRateDecoder):
    """Any call holding one of the images 5, 6, 7 (by size) raises; each image is then tried alone."""

    def decode(self, datas, regions=None):
        out = super().decode(datas, regions)
        if any(isinstance(o, torch.Tensor) and o.shape[1] in (79, 82, 85) for o in out):
            raise RuntimeError("the decoder library failed on this batch")
        return out


class WrongShape(FixedRateDecoder):
    def decode(self, datas, regions=None):
        out = super().decode(datas, regions)
        out[0] = out[0][:, :5, :7]
        return out


class WrongCount(FixedRateDecoder):
    def decode(self, datas, regions=None):
        out = super().decode(datas, regions)
        return out[:-1] if len(out) > 1 else out


class WrongTypes(FixedRateDecoder):
    """A NumPy array, None and an exception object in place of three images of each call."""

    def decode(self, datas, regions=None):
        out = super().decode(datas, regions)
        for k, bad in zip(range(len(out)), (out[0].numpy() if out else None, None, ValueError("no image"))):
            out[k] = bad
        return out


class FloatImages(FixedRateDecoder):
    def decode(self, datas, regions=None):
        return [o.float() for o in super().decode(datas, regions)]


class NotAList(FixedRateDecoder):
    def decode(self, datas, regions=None):
        super().decode(datas, regions)
        return None


@pytest.mark.parametrize("decoder, fails", [(RaisesOnSome, "some"), (WrongShape, "some"), (WrongCount, "none"),
                                            (WrongTypes, "some"), (FloatImages, "all"), (NotAList, "all")],
                         ids=["raises-on-some", "wrong-shape", "wrong-count", "wrong-types", "float", "not-a-list"])
def test_images_a_decoder_gets_wrong_are_decoded_on_the_cpu_and_named(packed, decoder, fails, caplog):
    """Each image the decoder got wrong is decoded again on the CPU, and the log names it; a call that
    returns one image too few is retried one image at a time (then every image comes back)."""
    with caplog.at_level(logging.INFO, logger="stoker.loader"):
        with _loader(packed, decoder()) as loader:
            x, y = _epoch(loader)
            stats = loader.stats
    assert len(x) == N and sorted(y.tolist()) == list(range(N))
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GPU decode failed for")]
    assert len(named) == stats.gpu_fallbacks and stats.gpu_decoded + stats.gpu_fallbacks == N
    assert (stats.gpu_fallbacks > 0) == (fails != "none")
    assert all("'img/" in line for line in named), named[:3]
    if fails == "all":   # nothing decoded on the "GPU": the batches are the CPU path's, bit for bit
        assert stats.gpu_decoded == 0
        with Loader(packed, 8, transforms=CROP, seed=3, workers=Workers(num_threads=2),
                    device=DeviceOptions("cpu", decode="cpu")) as cpu:
            want = _epoch(cpu)
        assert np.array_equal(y, want[1]) and np.array_equal(x, want[0])
    assert _no_stoker_thread_left() == []


@pytest.mark.parametrize("split", [False, True], ids=["gpu", "split-half"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_row_neither_decoder_reads_is_a_named_sample_error_or_a_named_replacement(damaged, on_error, split, caplog):
    """Whether the damaged row went to the GPU decoder (then the device thread's CPU fallback) or to the
    worker threads (a split batch), it is named the same way."""
    with caplog.at_level(logging.WARNING, logger="stoker.loader"):
        loader = _loader(damaged, FixedRateDecoder(), on_error=on_error, split=split)
        if on_error == "raise":
            with pytest.raises(SampleError) as info:
                _epoch(loader)
            assert info.value.key in ("img/13", "img/27") and isinstance(info.value.__cause__, ImageError)
            assert f"(shard {info.value.shard}, row {info.value.row}" in str(info.value)
        else:
            x, _ = _epoch(loader)
            assert len(x) == N and loader.stats.skipped == 2
            skipped = sorted(r.getMessage().split("'")[3] for r in caplog.records if "replaced by" in r.getMessage())
            assert skipped == ["img/13", "img/27"]
        loader.close()
    assert _no_stoker_thread_left() == []


# ---- hangs, and failures while batches are in flight ---------------------------------------------------

class HangsOnCall(FixedRateDecoder):
    """Call `at` blocks until `release` is set (a library stuck in its driver)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.n = at, 0
        self.release = threading.Event()

    def decode(self, datas, regions=None):
        self.n += 1
        if self.n == self.at:
            self.release.wait(60)
        return super().decode(datas, regions)


def test_a_hung_decoder_is_a_timeout_naming_it_and_its_thread_ends_once_it_returns(packed):
    dec = HangsOnCall(at=2)
    loader = _loader(packed, dec, timeout=2.0)
    with pytest.raises(LoaderTimeoutError) as info:
        _epoch(loader)
    # the consumer's wait or the device thread's, whichever ends first: both name the decoder
    assert "GPU decoder (fixed-rate stand-in" in str(info.value) and " 2 s" in str(info.value), str(info.value)
    loader.close()
    dec.release.set()   # a thread inside a library call cannot be stopped from Python: it ends when the call does
    assert _no_stoker_thread_left() == []


class FailsMidway(FixedRateDecoder):
    """Call 3 raises `exc` out of the decoder: batches before and after it are in flight."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(latency_s=0.01)
        self.exc, self.n = exc, 0

    def decode(self, datas, regions=None):
        self.n += 1
        if self.n == 3:
            raise self.exc
        return super().decode(datas, regions)


def test_a_decoder_raising_once_mid_pipeline_costs_nothing(packed):
    """An Exception out of one whole call while other batches are in flight: that call's images are
    tried again one at a time (and decode), every other batch is untouched."""
    dec = FailsMidway(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with _loader(packed, dec) as loader:
        x, y = _epoch(loader)
        assert len(x) == N and sorted(y.tolist()) == list(range(N))
        assert loader.stats.gpu_fallbacks == 0 and loader.stats.gpu_decoded == N and len(dec.calls) > 5
    assert _no_stoker_thread_left() == []


def test_a_base_exception_out_of_the_decoder_reaches_the_consumer_and_stops_the_pipeline(packed):
    """What is not an Exception (KeyboardInterrupt, SystemExit raised inside a library's callback) is not
    retried per image: the consumer gets it, in order, and close() leaves no thread."""
    loader = _loader(packed, FailsMidway(KeyboardInterrupt()))
    got = 0
    with pytest.raises(KeyboardInterrupt):
        for x, _ in loader:
            got += len(x)
    loader.close()
    assert got < N
    assert _no_stoker_thread_left() == []


@pytest.mark.parametrize("how", ["break", "consumer-exception", "dropped-iterator"])
def test_stopping_mid_pipeline_leaves_no_thread(packed, how):
    """A slow decoder (each call 50 ms) keeps a batch in the decode thread and another in the device
    thread when the consumer stops after its first batch."""
    loader = _loader(packed, FixedRateDecoder(latency_s=0.05))
    it = iter(loader)
    next(it)
    assert "stoker-decode" in _stoker_threads()
    if how == "break":
        for _ in it:
            break
    elif how == "consumer-exception":
        with pytest.raises(ZeroDivisionError):
            for _ in it:
                raise ZeroDivisionError("the training step failed")
    del it
    gc.collect()
    if how != "dropped-iterator":
        loader.close()
    assert _no_stoker_thread_left() == []
    if how == "dropped-iterator":
        loader.close()


def test_a_decoder_object_without_a_name_is_refused_when_the_loader_is_made(packed):
    """DeviceOptions accepts any object with decode(); the stats, the log and every error that names the
    decoder read its `name`: it was an AttributeError at the end of the first batch."""
    class Nameless:
        def decode(self, datas):
            return FixedRateDecoder().decode(datas)

    with pytest.raises(ConfigError, match="Nameless object has no `name`"):
        _loader(packed, Nameless())
    assert _no_stoker_thread_left() == []


_EXIT = """
import sys, time
sys.path.insert(0, sys.argv[2])   # tests/, where the stand-in decoder lives
from stoker import DeviceOptions, Loader, Workers
from gpu_standin import FixedRateDecoder
from stoker.transforms import RandomResizedCrop
class Hangs(FixedRateDecoder):
    n = 0
    def decode(self, datas, regions=None):
        self.n += 1
        if self.n >= 2:
            time.sleep(600)
        return super().decode(datas, regions)
loader = Loader(sys.argv[1], 8, transforms=[RandomResizedCrop(32)], workers=Workers(num_threads=2),
                device=DeviceOptions("cpu", decode="gpu", gpu_decoder=Hangs()))
it = iter(loader)
next(it)
print("EXITING", flush=True)
"""


def test_the_interpreter_exits_while_the_decoder_hangs(packed):
    """The script ends, without close(), while the decode thread is inside a decoder call that never
    returns: the process still exits, with the script's status."""
    proc = run_child(_EXIT, str(packed), str(Path(__file__).resolve().parents[1]), timeout=60)
    assert "EXITING" in proc.stdout and proc.returncode == 0, proc.stderr[-2000:]


class DecodesNothing(FixedRateDecoder):
    """Every call fails: each image is then tried alone, fails again, and the CPU decodes it."""

    def decode(self, datas, regions=None):
        raise RuntimeError("this decoder decodes nothing")


def test_a_decoder_that_decodes_nothing_loses_its_share_under_auto(packed: Path) -> None:
    """decode="auto" measures the GPU side by what it decoded, its CPU fallbacks on its own time: a
    decoder whose every image falls back is left with no rows (it was rated as if it had decoded them)."""
    loader = Loader(packed, 4, transforms=CROP, seed=3, workers=Workers(num_threads=2),
                    device=DeviceOptions("cpu", decode="auto", gpu_decoder=DecodesNothing()))
    want = [x.numpy().copy() for x, _ in Loader(packed, 4, transforms=CROP, seed=3, workers=Workers(num_threads=2))]
    for epoch in range(2):
        got = [x.numpy().copy() for x, _ in loader]
        assert len(got) == len(want) and loader.stats.gpu_fallbacks > 0 and loader.stats.gpu_decoded == 0
        if epoch == 0:
            assert all(np.array_equal(a, b) for a, b in zip(got, want))   # every image decoded on the CPU
        # at most the floor a probe window of the split keeps (it was rated at its calls' speed: 0.5-0.65)
        assert loader.stats.gpu_share <= 0.02, loader.stats.gpu_split
    loader.close()
