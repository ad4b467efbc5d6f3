"""stoker.Loader end to end on small packed datasets written at test time."""

from __future__ import annotations

import _thread
import gc
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import psutil
import pytest
import simplejpeg
import torch

from stoker.codecs import encode_jpeg
from stoker.errors import ConfigError, CorruptImageError, SampleError
from stoker.loader import Loader
from stoker.reader import open_dataset
from stoker.shards import Manifest, ShardWriter, write_manifest
from stoker.sources import open_source
from stoker.transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize
from stoker.loader.options import Sampling, Workers

TRAIN = [RandomResizedCrop(32), RandomHorizontalFlip()]


def photo(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
    img = rng.uniform(0, 255, (1, 1, 3)) + rng.uniform(-120, 120, (1, 1, 3)) * np.sin(4 * x + 3 * y)
    img = img + rng.normal(0, 8, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def build_packed(out: Path, n: int = 60, *, shards: int = 2, seed: int = 0, corrupt: tuple[int, ...] = (),
                 sizes: tuple[int, int] = (40, 130)) -> Path:
    """n samples, label = index, extra column "weight" = index / 10. Mostly JPEGs of varied
    sizes; every 7th a grayscale JPEG, every 11th raw pixels, every 13th a PNG."""
    from PIL import Image
    import io

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    infos, per = [], -(-n // shards)
    for s in range(shards):
        w = ShardWriter(out, s, label_type="int64", extra_columns={"weight": "float64"})
        for i in range(s * per, min(n, (s + 1) * per)):
            h, wd = (int(v) for v in rng.integers(sizes[0], sizes[1], 2))
            img = photo(rng, h, wd)
            if i in corrupt:
                data, enc = b"\xff\xd8\xff\xe0" + bytes(rng.integers(0, 255, 300, dtype=np.uint8)), "jpeg"
            elif i % 11 == 5:
                data, enc = img.tobytes(), "raw"
            elif i % 13 == 6:
                buf = io.BytesIO()
                Image.fromarray(img).save(buf, "PNG")
                data, enc = buf.getvalue(), "png"
            elif i % 7 == 3:
                data, enc = simplejpeg.encode_jpeg(img[:, :, :1].copy(), colorspace="GRAY", quality=90), "jpeg"
            else:
                data, enc = encode_jpeg(img, 90), "jpeg"
            w.add(f"img/{i:04d}.x", data, enc, h, wd, i, {"weight": i / 10})
        infos.append(w.finish())
    write_manifest(out, Manifest(num_samples=n, shards=infos, classes=None, label_type="int64",
                                 extra_columns={"weight": "float64"}))
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("packed") / "ds")


@pytest.fixture(scope="module")
def packed_bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("bad") / "ds", n=40, corrupt=(9, 17))


def run_epoch(loader: Loader) -> tuple[np.ndarray, np.ndarray]:
    imgs, labels = [], []
    for batch in loader:
        imgs.append(batch[0].permute(0, 2, 3, 1).numpy().copy())  # NHWC, to compare with decoded pixels
        labels.append(batch[1].numpy().copy())
    return np.concatenate(imgs), np.concatenate(labels)


def settle(baseline: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    return threading.active_count()


def test_batches_have_the_promised_shape_and_labels(packed: Path) -> None:
    with Loader(packed, 16, transforms=TRAIN, seed=3) as loader:
        assert len(loader) == 4
        batches = list(loader)  # batches stay valid while held
        assert [b[0].shape[0] for b in batches] == [16, 16, 16, 12]
        images, labels = batches[0]
        assert images.dtype == torch.uint8 and images.shape == (16, 3, 32, 32)
        assert images.is_contiguous(memory_format=torch.channels_last)  # a view of NHWC memory, no copy
        assert labels.dtype == torch.int64
        seen = np.concatenate([b[1].numpy() for b in batches])
        assert sorted(seen.tolist()) == list(range(60))  # every sample once (label = index)
        assert np.array_equal(seen, loader.epoch_indices(0))
        assert loader.stats.samples == 60 and loader.stats.batches == 4


def test_the_common_loop_reuses_a_ring_of_prefetch_plus_two_slots(packed: Path) -> None:
    """The loop variable holds batch k while k+1 is fetched, so k's slot returns one step later:
    prefetch + 2 slots, the same four buffers in turn, and no allocation after the first pass."""
    loader = Loader(packed, 4, transforms=TRAIN, workers=Workers(prefetch=2))
    for epoch in range(3):
        ptrs = []
        for images, labels in loader:
            ptrs.append(images.data_ptr())
        assert len(set(ptrs)) == 4 and ptrs[0] == ptrs[4] == ptrs[8], epoch
        assert loader.stats.slots_allocated == 4
    assert next(iter(loader))[0].is_pinned() == torch.cuda.is_available()


def test_sequential_order_and_drop_last(packed: Path) -> None:
    loader = Loader(packed, 16, transforms=[Resize((24, 24))], order="sequential", drop_last=True)
    imgs, labels = run_epoch(loader)
    assert len(loader) == 3 and labels.tolist() == list(range(48))
    # Grayscale, raw and PNG samples come out as RGB like the others.
    ds = open_dataset(packed)
    assert ds.sample(3).encoding == "jpeg" and ds.sample(5).encoding == "raw" and ds.sample(6).encoding == "png"
    gray = imgs[3]
    assert np.array_equal(gray[..., 0], gray[..., 1]) and np.array_equal(gray[..., 0], gray[..., 2])
    loader.close()


def test_shuffle_is_dataloaders_spelling_of_order(packed: Path) -> None:
    loader = Loader(packed, 16, transforms=[Resize((24, 24))], shuffle=False)
    assert loader.order == "sequential" and loader.epoch_indices().tolist() == list(range(len(loader.dataset)))
    assert Loader(packed, 16, transforms=[Resize((24, 24))], shuffle=True).order == "random"
    with pytest.raises(ConfigError, match="pass the order once"):
        Loader(packed, 16, transforms=[Resize((24, 24))], shuffle=True, order="shard_random")


@pytest.mark.parametrize("tf", [TRAIN, [Resize(40), CenterCrop(32)]])
def test_same_seed_same_bits_for_any_thread_count_and_prefetch(packed: Path, tf: list) -> None:
    ref = run_epoch(Loader(packed, 8, transforms=tf, seed=11, workers=Workers(num_threads=1, prefetch=1)))
    for threads, prefetch in [(2, 2), (8, 1), (8, 4), (3, 3)]:
        got = run_epoch(Loader(packed, 8, transforms=tf, seed=11, workers=Workers(num_threads=threads, prefetch=prefetch)))
        assert np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1]), (threads, prefetch)
    other = run_epoch(Loader(packed, 8, transforms=tf, seed=12, workers=2))
    assert not np.array_equal(ref[1], other[1])


@pytest.mark.parametrize("order", ["shard_random", "shard_window"])
def test_shard_aware_orders_give_the_same_bits_for_any_thread_count(packed: Path, order: str) -> None:
    ref = run_epoch(Loader(packed, 8, transforms=TRAIN, seed=11, order=order, workers=Workers(num_threads=1, prefetch=1)))
    got = run_epoch(Loader(packed, 8, transforms=TRAIN, seed=11, order=order, workers=Workers(num_threads=3, prefetch=3)))
    assert np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1])


def test_epochs_advance_and_set_epoch_replays(packed: Path) -> None:
    loader = Loader(packed, 16, transforms=TRAIN, seed=1)
    e0 = run_epoch(loader)
    assert loader.epoch == 1
    e1 = run_epoch(loader)
    assert not np.array_equal(e0[1], e1[1])
    loader.set_epoch(0)
    again = run_epoch(loader)
    assert np.array_equal(e0[0], again[0]) and np.array_equal(e0[1], again[1])
    # A pass left part-way does not advance the epoch: the next iter() reads it again from its start.
    loader.set_epoch(5)
    first = next(iter(loader))[1]
    again = next(iter(loader))[1]
    assert loader.epoch == 5 and loader.state_dict()["batch"] == 1 and np.array_equal(first, again)
    assert np.array_equal(run_epoch(loader)[1][:16], first) and loader.epoch == 6


@pytest.mark.parametrize("persistent", [False, True])
def test_state_records_where_a_pass_stopped_and_only_load_state_dict_resumes_there(packed: Path,
                                                                                  persistent: bool) -> None:
    """The rule: state_dict() records the position of the latest pass (during it, after a break,
    after an exception); a plain iter() always reads a whole epoch; load_state_dict() makes the
    next iter() continue from the recorded position, in this Loader or a fresh one."""
    loader = Loader(packed, 8, transforms=TRAIN, seed=9, workers=Workers(num_threads=2, persistent=persistent))
    whole = [y for _, y in loader]
    loader.set_epoch(0)
    for k, (images, labels) in enumerate(loader):
        if k == 4:
            break
    state = loader.state_dict()
    assert (state["epoch"], state["batch"], state["sample"]) == (0, 5, 40)
    again = [y for _, y in loader]   # a whole pass of epoch 0 again
    assert len(again) == len(loader) and all(np.array_equal(a, b) for a, b in zip(again, whole))
    assert loader.epoch == 1 and loader.state_dict()["batch"] == 0
    fresh = Loader(packed, 8, transforms=TRAIN, seed=9, workers=1)
    fresh.load_state_dict(state)
    rest_there = [y for _, y in fresh]
    loader.load_state_dict(state)
    rest_here = [y for _, y in loader]
    assert len(rest_here) == len(loader) - 5 and len(rest_here) == len(rest_there)
    assert all(np.array_equal(a, b) for a, b in zip(rest_here, rest_there))
    assert all(np.array_equal(a, b) for a, b in zip(rest_here, whole[5:]))
    assert len([y for _, y in loader]) == len(loader)   # the resume applied to that one pass only

    with pytest.raises(KeyError):   # an exception in the training step: its position is recorded too
        for k, (images, labels) in enumerate(loader):
            if k == 2:
                raise KeyError("step failed")
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["batch"] == 3


@pytest.mark.parametrize("new_size", [5, 16, 60])
def test_resume_with_a_different_batch_size_yields_exactly_the_samples_left(packed: Path, new_size: int) -> None:
    def labels_of(loader: Loader) -> list[int]:
        return [v for _, y in loader for v in y.tolist()]

    whole = Loader(packed, 8, transforms=TRAIN, seed=3)
    whole.set_epoch(1)
    epoch = labels_of(whole)
    first = Loader(packed, 8, transforms=TRAIN, seed=3)
    first.set_epoch(1)
    it = iter(first)
    seen = [v for _ in range(3) for v in next(it)[1].tolist()]
    state = first.state_dict()
    first.close()
    resumed = Loader(packed, new_size, transforms=TRAIN, seed=3)
    resumed.load_state_dict(state)
    batches = [y.tolist() for _, y in resumed]
    assert seen + [v for b in batches for v in b] == epoch   # same samples, same order, none twice
    assert all(len(b) == new_size for b in batches[:-1])
    assert resumed.epoch == 2
    img_whole = Loader(packed, 8, transforms=TRAIN, seed=3)
    img_whole.set_epoch(1)
    ref = np.concatenate([x.numpy().copy() for x, _ in img_whole])[24:]
    again = Loader(packed, new_size, transforms=TRAIN, seed=3)
    again.load_state_dict(state)
    got = np.concatenate([x.numpy().copy() for x, _ in again])
    assert np.array_equal(ref, got)   # and the same pixels: random draws follow the sample, not the batch


@pytest.mark.parametrize("threads,stop_after", [(1, 1), (2, 2), (3, 3)])
def test_resume_mid_epoch_yields_exactly_the_rest(packed: Path, threads: int, stop_after: int) -> None:
    full = Loader(packed, 8, transforms=TRAIN, seed=4, workers=threads)
    full.set_epoch(2)
    ref = [(x.numpy().copy(), y.numpy().copy()) for x, y in full]
    first = Loader(packed, 8, transforms=TRAIN, seed=4, workers=threads)
    first.set_epoch(2)
    it = iter(first)
    for _ in range(stop_after):
        next(it)
    state = first.state_dict()
    assert state["epoch"] == 2 and state["batch"] == stop_after
    first.close()
    resumed = Loader(packed, 8, transforms=TRAIN, seed=4, workers=Workers(num_threads=2, prefetch=3))
    resumed.load_state_dict(state)
    rest = [(x.numpy().copy(), y.numpy().copy()) for x, y in resumed]
    assert len(rest) == len(ref) - stop_after
    for (a, b), (c, d) in zip(ref[stop_after:], rest):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    assert resumed.state_dict()["epoch"] == 3 and resumed.state_dict()["batch"] == 0


def test_state_from_a_different_setup_is_refused(packed: Path) -> None:
    state = Loader(packed, 8, transforms=TRAIN, drop_last=True).state_dict()
    with pytest.raises(ConfigError, match="batch_size=8 vs 16.*only with drop_last=False"):
        Loader(packed, 16, transforms=TRAIN, drop_last=True).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed=0 vs 1"):
        Loader(packed, 8, transforms=TRAIN, seed=1, drop_last=True).load_state_dict(state)
    with pytest.raises(ConfigError, match="not a stoker Loader state"):
        Loader(packed, 8, transforms=TRAIN).load_state_dict({"epoch": 1})


def test_extra_columns_come_along(packed: Path) -> None:
    loader = Loader(packed, 10, transforms=TRAIN, columns=["weight"], seed=2)
    for images, labels, extras in loader:
        assert extras["weight"] == pytest.approx([i / 10 for i in labels.tolist()])
    with pytest.raises(ConfigError, match="no column"):
        Loader(packed, 10, transforms=TRAIN, columns=["nope"])


def test_failing_sample_names_key_shard_and_row(packed_bad: Path) -> None:
    base = threading.active_count()
    loader = Loader(packed_bad, 8, transforms=TRAIN, order="sequential", workers=2)
    got = []
    with pytest.raises(SampleError) as info:
        for _, labels in loader:
            got.extend(labels.tolist())
    err = info.value
    assert got == list(range(8))  # batches before the failing one arrive, in order
    assert err.key == "img/0009.x" and err.shard == "shard-00000.arrow" and err.row == 9 and err.index == 9
    assert "img/0009.x" in str(err) and "on_error='skip'" in str(err)
    assert isinstance(err.__cause__, CorruptImageError)
    frames = "".join(traceback.format_tb(err.__cause__.__traceback__))
    assert "decode_rgb" in frames  # the worker's traceback came home
    assert settle(base) == base


def test_skip_replaces_deterministically_and_counts(packed_bad: Path) -> None:
    runs = []
    for threads in (1, 2, 8):
        loader = Loader(packed_bad, 8, transforms=TRAIN, seed=5, workers=Workers(on_error="skip", num_threads=threads))
        runs.append(run_epoch(loader))
        assert loader.stats.skipped == 2
        assert sorted(loader.stats.skipped_keys) == ["img/0009.x", "img/0017.x"]
    for imgs, labels in runs[1:]:
        assert np.array_equal(imgs, runs[0][0]) and np.array_equal(labels, runs[0][1])
    labels = runs[0][1]
    assert 9 not in labels and 17 not in labels and len(labels) == 40


def test_loose_folder_gives_the_same_batches_as_its_pack(image_folder: Path, tmp_path: Path) -> None:
    src = open_source(image_folder)
    w = ShardWriter(tmp_path / "p", 0, label_type="int64")
    (tmp_path / "p").mkdir()
    for item in src.items:
        data = item.read()
        h, wd = simplejpeg.decode_jpeg_header(data)[:2]
        w.add(item.key, data, "jpeg", h, wd, item.label)
    write_manifest(tmp_path / "p", Manifest(num_samples=len(src.items), shards=[w.finish()], classes=src.classes))
    a = run_epoch(Loader(image_folder, 5, transforms=TRAIN, seed=9, workers=2))
    b = run_epoch(Loader(tmp_path / "p", 5, transforms=TRAIN, seed=9, workers=2))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_user_callables_apply_and_their_rng_does_not_depend_on_threads(packed: Path) -> None:
    def invert(img: np.ndarray) -> np.ndarray:
        np.subtract(255, img, out=img)
        return img

    def jitter(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return np.clip(img.astype(np.int16) + rng.integers(-3, 4), 0, 255).astype(np.uint8)

    plain = run_epoch(Loader(packed, 16, transforms=TRAIN, seed=1))
    inv = run_epoch(Loader(packed, 16, transforms=[*TRAIN, invert], seed=1))
    assert np.array_equal(inv[0], 255 - plain[0])
    a = run_epoch(Loader(packed, 16, transforms=[*TRAIN, jitter], seed=1, workers=1))
    b = run_epoch(Loader(packed, 16, transforms=[*TRAIN, jitter], seed=1, workers=4))
    assert np.array_equal(a[0], b[0]) and not np.array_equal(a[0], plain[0])


def test_mismatched_sizes_need_a_fixed_size_transform(packed: Path) -> None:
    with pytest.raises(ConfigError, match="differ in size"):
        Loader(packed, 4, transforms=[Resize(32)])
    with pytest.raises(ConfigError, match="on_error"):
        Loader(packed, 4, transforms=TRAIN, workers=Workers(on_error="ignore"))


def test_shutdown_on_exhaustion_break_exception_and_gc(packed: Path) -> None:
    base = threading.active_count()
    loader = Loader(packed, 4, transforms=TRAIN, workers=3)
    run_epoch(loader)
    assert settle(base) == base
    for _ in loader:
        break
    assert settle(base) == base
    with pytest.raises(RuntimeError, match="boom"):
        for _ in loader:
            raise RuntimeError("boom")
    assert settle(base) == base
    for _ in range(40):  # abandoned iterators are collected and their threads stop
        it = iter(loader)
        next(it)
        del it
    assert settle(base) == base
    first = iter(loader)
    next(first)
    second = iter(loader)  # a pass beside a running one: its own threads and ring, both whole
    assert len(list(second)) == len(loader) and len(list(first)) == len(loader) - 1
    del first, second
    gc.collect()
    assert settle(base) == base


def test_ctrl_c_stops_the_threads(packed: Path) -> None:
    def slow(img: np.ndarray) -> np.ndarray:
        time.sleep(0.05)
        return img

    base = threading.active_count()
    loader = Loader(packed, 30, transforms=[*TRAIN, slow], workers=2)
    timer = threading.Timer(0.2, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    timer.join()
    assert time.monotonic() - t0 < 30.0   # a hang guard: the interrupt ends the pass
    assert settle(base) == base


def test_memory_stays_flat_over_20_epochs(packed: Path) -> None:
    proc = psutil.Process()
    loader = Loader(packed, 16, transforms=TRAIN, workers=2)
    rss = []
    for _ in range(20):
        for _ in loader:
            pass
        rss.append(proc.memory_info().rss)
    assert rss[-1] - rss[2] < 40 * 2**20, [r >> 20 for r in rss]


def test_time_out_names_the_batch(packed: Path) -> None:
    def stuck(img: np.ndarray) -> np.ndarray:
        time.sleep(1.0)
        return img

    loader = Loader(packed, 4, transforms=[*TRAIN, stuck], timeout=0.3, workers=1)
    with pytest.raises(TimeoutError, match="batch 0"):
        next(iter(loader))


def test_a_bug_in_a_user_transform_is_named_and_never_skipped(packed: Path) -> None:
    from stoker.errors import UserTransformError

    def buggy(img: np.ndarray) -> np.ndarray:
        scale = {"low": 0.5}["high"]   # a user's mistake: a key that is not there
        return (img * scale).astype(np.uint8)

    for on_error in ("raise", "skip"):
        loader = Loader(packed, 8, transforms=[*TRAIN, buggy], workers=Workers(num_threads=2, on_error=on_error))
        with pytest.raises(UserTransformError) as info:
            next(iter(loader))
        loader.close()
        exc = info.value
        assert exc.transform == "buggy" and exc.key is not None and exc.index is not None
        assert str(exc).startswith("transform buggy raised KeyError: 'high'")
        assert "error in the transform's code, not in the data: fix buggy" in str(exc)
        assert "re-pack" not in str(exc)
        assert isinstance(exc.__cause__, KeyError)   # the transform's own exception and traceback


def test_corrupt_data_still_gets_the_data_advice(tmp_path: Path) -> None:
    bad = build_packed(tmp_path / "bad", 20, shards=1, corrupt=(3,))
    with Loader(bad, 20, transforms=TRAIN, order="sequential") as loader:
        with pytest.raises(SampleError) as info:
            next(iter(loader))
    assert type(info.value) is SampleError
    assert "Pass workers=stoker.Workers(on_error='skip') to replace failing samples, or re-pack" in str(info.value)


def test_pin_memory_without_cuda_warns_as_dataloader_does(packed: Path) -> None:
    """A script written for the GPU node (pin_memory=True, as torchvision's references and pytorch/examples
    pass it) runs on a laptop: a warning naming pin_memory=None, unpinned batches, the same values."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: pinned memory works here")
    with pytest.warns(UserWarning, match=r"pin_memory=True: torch finds no CUDA device.*pin_memory=None"):
        pinned = Loader(packed, 8, transforms=TRAIN, pin_memory=True, seed=4)
    plain = Loader(packed, 8, transforms=TRAIN, seed=4)
    assert pinned.pin_memory is False
    for (a, y), (b, z) in zip(pinned, plain):
        assert torch.equal(a, b) and torch.equal(y, z)
    pinned.close(), plain.close()


def _epoch(loader: Loader) -> list[np.ndarray]:
    with loader:
        return [images.numpy().copy() for images, *_ in loader]


@pytest.mark.parametrize("transforms", [TRAIN, [Resize(40), CenterCrop(36)]], ids=["train", "val"])
def test_region_decoder_changes_no_pixel(packed, monkeypatch, transforms):
    """Decoding only the crop's rectangle gives the batches a whole decode gives, byte for byte."""
    from stoker import _libjpeg, codecs

    if not codecs.region_decode_available():
        pytest.skip(_libjpeg.describe())
    with_region = _epoch(Loader(packed, 8, transforms=transforms, seed=3, workers=2))
    monkeypatch.setattr(_libjpeg, "_state", (None, "turned off for this test"))
    assert not codecs.region_decode_available()
    whole = _epoch(Loader(packed, 8, transforms=transforms, seed=3, workers=1))
    assert len(with_region) == len(whole)
    for a, b in zip(with_region, whole):
        np.testing.assert_array_equal(a, b)


def test_fast_decode_quality_is_close_and_deterministic(packed):
    accurate = _epoch(Loader(packed, 8, transforms=TRAIN, seed=4, workers=2))
    fast = _epoch(Loader(packed, 8, transforms=TRAIN, seed=4, workers=Workers(num_threads=2, decode_quality="fast")))
    fast_again = _epoch(Loader(packed, 8, transforms=TRAIN, seed=4, workers=Workers(num_threads=1, decode_quality="fast")))
    for a, f, g in zip(accurate, fast, fast_again):
        np.testing.assert_array_equal(f, g)
    a, f = np.concatenate(accurate).astype(np.float64), np.concatenate(fast)
    mse = np.mean((a - f) ** 2)
    assert 0 < mse and 10 * np.log10(255**2 / mse) > 30  # PSNR, dB
    with pytest.raises(ConfigError, match="decode_quality must be one of"):
        Loader(packed, 8, transforms=TRAIN, workers=Workers(decode_quality="turbo"))


def test_the_loose_loader_keeps_libtiff_and_pillow_chatter_off_stderr(tmp_path: Path, pillow_corpus: Path) -> None:
    """A folder of odd TIFFs: libtiff's warnings/errors and Pillow's per-tag UserWarnings used to print
    hundreds of lines; only stoker's own report of each replaced sample (a log record) may remain."""
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "loose" / "scans"
    folder.mkdir(parents=True)
    for name in ("16bit.deflate.tif", "hopper_webp.tif", "tiff_overflow_rows_per_strip.tif", "seek_too_large.tif",
                 "tiff_wrong_bits_per_sample.tiff", "hopper_g4.tif", "tiff_strip_raw.tif", "hopper.tif"):
        if (pillow_corpus / name).exists():
            shutil.copy(pillow_corpus / name, folder / name)
    for p in sorted(pillow_corpus.glob("crash-*.tif"))[:6] + sorted(pillow_corpus.glob("*tag*.tif"))[:6]:
        shutil.copy(p, folder / p.name)
    script = (f"from stoker import Loader, RandomResizedCrop, Workers\n"
              f"with Loader({str(tmp_path / 'loose')!r}, 4, transforms=[RandomResizedCrop(16)],"
              f" workers=Workers(num_threads=2, on_error='skip')) as loader:\n"
              f"    print(sum(1 for _ in loader), loader.stats.skipped)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    batches, skipped = map(int, done.stdout.split())
    assert batches > 0 and skipped > 0   # the folder does hold files libtiff complains about
    chatter = [line for line in done.stderr.splitlines() if not line.startswith("on_error='skip': sample ")]
    assert len(chatter) <= 2, chatter   # Pillow's own C code may still print a line for a broken TIFF
    assert not any("TIFF" in line or "Warning" in line for line in chatter), chatter


def test_num_workers_is_dataloaders_name_for_worker_threads(packed: Path) -> None:
    assert Loader(packed, 8, transforms=TRAIN, num_workers=3).num_threads == 3
    assert Loader(packed, 8, transforms=TRAIN, num_workers=0).num_threads == 1   # "main process": one thread
    assert Loader(packed, 8, transforms=TRAIN, workers=3).num_threads == 3
    with pytest.raises(ConfigError, match="num_threads is set twice"):
        Loader(packed, 8, transforms=TRAIN, num_workers=2, workers=3)
    with pytest.raises(ConfigError, match="stoker's spelling is workers=N"):
        Loader(packed, 8, transforms=TRAIN, num_workers=-1)


def test_indices_read_only_that_subset_each_epoch(packed: Path) -> None:
    subset = [3, 7, 11, 19, 23, 29, 31, 41, 43, 47, 53]
    loader = Loader(packed, 4, transforms=TRAIN, seed=2, sampling=Sampling(indices=subset))
    assert len(loader) == 3
    epochs = [[v for _, y in loader for v in y.tolist()] for _ in range(2)]   # label = dataset index
    assert sorted(epochs[0]) == subset and sorted(epochs[1]) == subset and epochs[0] != epochs[1]
    seq = Loader(packed, 4, transforms=TRAIN, order="sequential", sampling=Sampling(indices=np.array(subset)))
    assert [v for _, y in seq for v in y.tolist()] == subset
    # the same subset gives the same pixels as the full dataset for those samples (keys follow the sample)
    one = Loader(packed, 1, transforms=TRAIN, order="sequential", seed=5, sampling=Sampling(indices=[7]))
    full = Loader(packed, 60, transforms=TRAIN, order="sequential", seed=5)
    assert np.array_equal(next(iter(one))[0][0], next(iter(full))[0][7])
    for bad, match in (([60], "outside the dataset's 0..59"), ([], "non-empty"), ([1.5], "ints")):
        with pytest.raises(ConfigError, match=match):
            Loader(packed, 4, transforms=TRAIN, sampling=Sampling(indices=bad))
    with pytest.raises(ConfigError, match="shard_random.*use order='random'"):
        Loader(packed, 4, transforms=TRAIN, order="shard_random", sampling=Sampling(indices=subset))


def test_a_state_from_another_subset_is_refused(packed: Path) -> None:
    state = Loader(packed, 4, transforms=TRAIN, sampling=Sampling(indices=[1, 2, 3])).state_dict()
    with pytest.raises(ConfigError, match="pool="):
        Loader(packed, 4, transforms=TRAIN, sampling=Sampling(indices=[1, 2, 4])).load_state_dict(state)
    Loader(packed, 4, transforms=TRAIN, sampling=Sampling(indices=[1, 2, 3])).load_state_dict(state)


def test_weights_draw_with_replacement_deterministically(packed: Path) -> None:
    weights = np.zeros(60)
    weights[[5, 6]] = [1.0, 3.0]
    loader = Loader(packed, 20, transforms=TRAIN, seed=1, sampling=Sampling(weights=weights), workers=2)
    assert len(loader) == 3   # an epoch is len(weights) draws, as WeightedRandomSampler(weights, len(weights))
    images, labels = [], []
    for x, y in loader:
        images.append(x.numpy().copy())
        labels += y.tolist()
    assert set(labels) == {5, 6} and 30 < labels.count(6) < 58   # 3:1, with replacement
    again = Loader(packed, 20, transforms=TRAIN, seed=1, sampling=Sampling(weights=weights.tolist()), workers=1)
    assert np.array_equal(np.concatenate(images), np.concatenate([x.numpy().copy() for x, _ in again]))
    rows = np.concatenate(images)[np.array(labels) == 6]
    assert len({r.tobytes() for r in rows}) > len(rows) // 2   # each draw of a sample gets its own crop
    sub = Loader(packed, 10, transforms=TRAIN, sampling=Sampling(indices=[8, 9], weights=[0.0, 1.0]))
    assert {v for _, y in sub for v in y.tolist()} == {9} and len(sub) == 1
    with pytest.raises(ConfigError, match="one number per dataset sample \\(60\\)"):
        Loader(packed, 4, transforms=TRAIN, sampling=Sampling(weights=[1.0, 2.0]))
    with pytest.raises(ConfigError, match="positive sum"):
        Loader(packed, 4, transforms=TRAIN, sampling=Sampling(weights=np.zeros(60)))
    with pytest.raises(ConfigError, match="leave order='random'"):
        Loader(packed, 4, transforms=TRAIN, order="sequential", sampling=Sampling(weights=np.ones(60)))


def test_collate_fn_batches_the_extra_columns(packed: Path) -> None:
    def to_tensor(extras: dict[str, list]) -> torch.Tensor:
        return torch.tensor(extras["weight"], dtype=torch.float32)

    loader = Loader(packed, 8, transforms=TRAIN, columns=["weight"], collate_fn=to_tensor, order="sequential")
    for images, labels, weight in loader:
        assert isinstance(weight, torch.Tensor) and weight.shape == labels.shape
        assert torch.allclose(weight, labels.float() / 10)
    with pytest.raises(ConfigError, match="name the columns in columns="):
        Loader(packed, 8, transforms=TRAIN, collate_fn=to_tensor)
