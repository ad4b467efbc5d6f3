"""The engine's float output (engine.FloatOut, csrc/engine.c's map_levels): the pool's threads write
each row they render through per-channel tables into the float batch, instead of a pass over the whole
uint8 batch afterwards. Batches are bit for bit those of the two-pass path (`STOKER_ENGINE=off`: the
chunk path's uint8 rows, then the Normalize batch op or `convert`), with PNG, raw and damaged rows
(rendered in Python, then mapped the same way), at 1, 2 and 3 threads, NCHW and channels_last,
float32, float16 and bfloat16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stoker import DeviceOptions, Normalize, native
from stoker.loading import engine
from stoker.loader.loader import Loader
from stoker.loader.options import Workers
from test_engine import Counting, counted  # noqa: F401 - the fixture
from test_native_rows import TRAIN, VAL, build

pytestmark = pytest.mark.skipif(not native.engine_available(), reason="the native extension or its libjpeg is missing")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("floats") / "ds", bad=(3, 17))


def epoch(path: Path, transforms: list, threads: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    imgs, labels = [], []
    with Loader(path, 8, transforms=transforms, seed=5, device=device,
                workers=Workers(num_threads=threads, prefetch=1, on_error="skip")) as loader:
        for x, y in loader:
            imgs.append(x.clone(memory_format=torch.preserve_format))
            labels.append(y.clone())
    return torch.cat(imgs), torch.cat(labels)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = torch.int32 if a.element_size() == 4 else torch.int16
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def two_ways(path: Path, transforms: list, threads: int, device, monkeypatch: pytest.MonkeyPatch,
             made: list[Counting]) -> tuple[torch.Tensor, torch.Tensor]:
    fused = epoch(path, transforms, threads, device)
    assert sum(c.float_rows for c in made) > 30, "the engine wrote too few float rows"
    monkeypatch.setenv(engine.ENV, "off")
    two_pass = epoch(path, transforms, threads, device)
    monkeypatch.delenv(engine.ENV)
    assert torch.equal(fused[1], two_pass[1])
    assert fused[0].stride() == two_pass[0].stride(), "the layout differs"
    return fused[0], two_pass[0]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("transforms", [TRAIN, VAL], ids=["train", "val"])
def test_a_normalize_batch_op_is_written_by_the_pool_bit_for_bit(dataset, transforms, threads, counted,
                                                                 monkeypatch):
    fused, two_pass = two_ways(dataset, [*transforms, Normalize("imagenet")], threads, None, monkeypatch, counted)
    assert fused.dtype == torch.float32 and fused.is_contiguous()
    assert same_bits(fused, two_pass)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("transforms", [TRAIN, VAL], ids=["train", "val"])
def test_a_cpu_device_conversion_is_written_by_the_pool_bit_for_bit(dataset, transforms, layout, threads, counted,
                                                                    monkeypatch):
    opts = DeviceOptions(device="cpu", normalize="imagenet", memory_format=layout)
    fused, two_pass = two_ways(dataset, transforms, threads, opts, monkeypatch, counted)
    assert fused.dtype == torch.float32 and fused.is_contiguous(memory_format=layout)
    assert same_bits(fused, two_pass)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("normalize", ["imagenet", None])
def test_half_outputs_and_a_plain_scale_are_the_conversions_bit_for_bit(dataset, dtype, normalize, counted,
                                                                        monkeypatch):
    opts = DeviceOptions(device="cpu", normalize=normalize, dtype=dtype, memory_format=torch.channels_last)
    fused, two_pass = two_ways(dataset, TRAIN, 2, opts, monkeypatch, counted)
    assert fused.dtype == dtype
    assert same_bits(fused, two_pass)


def test_a_uint8_pass_writes_no_floats(dataset, counted):
    x, _ = epoch(dataset, TRAIN, 2)
    assert x.dtype == torch.uint8
    assert sum(c.rows for c in counted) > 30 and sum(c.float_rows for c in counted) == 0


def test_map_levels_maps_every_level_of_each_channel():
    images = np.arange(2 * 16 * 16 * 3, dtype=np.uint8).reshape(2, 16, 16, 3)
    levels = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    nchw = np.zeros((2, 3, 16, 16), np.float32)
    nhwc = np.zeros((2, 16, 16, 3), np.float32)
    native.map_levels(images, np.array([1], np.int64), levels, nchw, True)
    native.map_levels(images, np.array([0, 1], np.int64), levels, nhwc, False)
    want = levels[np.arange(3), images]   # [2, 16, 16, 3]
    assert np.array_equal(nhwc, want)
    assert np.array_equal(nchw[1], want[1].transpose(2, 0, 1)) and not nchw[0].any()
    with pytest.raises(ValueError, match="floats must be"):
        native.map_levels(images, np.array([0], np.int64), levels, np.zeros((2, 16, 16, 3), np.float64), False)


@pytest.mark.parametrize("device", [None, DeviceOptions(device="cpu", normalize="imagenet")], ids=["host", "cpu"])
def test_batches_the_caller_keeps_are_never_written_again(dataset, device, counted, monkeypatch):
    transforms = [*TRAIN, Normalize("imagenet")] if device is None else TRAIN
    monkeypatch.setattr(engine, "KEEP_FLOATS", 2)
    with Loader(dataset, 4, transforms=transforms, seed=5, device=device,
                workers=Workers(num_threads=2, prefetch=1, on_error="skip")) as loader:
        kept = [x for x, _ in loader]   # more batches than the engine keeps for reuse
        assert len(kept) > 2 * engine.KEEP_FLOATS
        fused = torch.cat(kept)
    monkeypatch.setenv(engine.ENV, "off")
    two_pass, _ = epoch(dataset, TRAIN if device else transforms, 2, device)
    assert same_bits(fused, two_pass)


def test_float_batches_are_reused_across_passes_once_let_go(dataset, counted, monkeypatch):
    made = []
    new = engine.FloatOut.new
    monkeypatch.setattr(engine.FloatOut, "new", lambda self, *shape: made.append(shape) or new(self, *shape))
    with Loader(dataset, 8, transforms=TRAIN, seed=5, device=DeviceOptions(device="cpu", normalize="imagenet"),
                workers=Workers(num_threads=2, prefetch=1, on_error="skip")) as loader:
        for _ in range(5):   # per pass, the two coordinators' first batches at least: 10 if none were reused
            batches = sum(1 for _ in loader)
    assert batches >= 5 and 0 < len(made) <= engine.KEEP_FLOATS


@pytest.mark.parametrize("mean, std", [([float("nan")] * 3, [1, 1, 1]), ([float("inf")] * 3, [1, 1, 1]),
                                       ([0, 0, 0], [float("inf")] * 3), ([0, 0, 0], [0, 1, 1])])
def test_normalize_refuses_statistics_that_make_every_value_meaningless(mean: list, std: list) -> None:
    """A NaN or infinite mean or std turned every output value NaN or inf, silently (the engine's float
    output and the two-pass path alike): refused when the op is made."""
    from stoker.errors import ConfigError
    from stoker.transforms import Normalize

    with pytest.raises(ConfigError, match="finite"):
        Normalize(mean=mean, std=std)
