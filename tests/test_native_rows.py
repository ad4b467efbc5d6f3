"""The route's native path against its Python path: batches bit-identical with the native extension on
and off, on the train and val pipelines, 1 and 2 threads, generated odd JPEGs (CMYK, EXIF-rotated,
progressive with restarts, thin strips) and, where the shared corpus sits beside the clone, its real
photographs; rows the engine refuses (PNG, raw, CMYK, corrupt) go through the Python path with the same
errors and replacements. Also the packs these tests share (`build`), and the mapped JPEG spans."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import PILLOW_CORPUS, smooth_rgb
from stoker import native
from stoker.codecs import encode_jpeg
from stoker.loader import Loader
from stoker.loader.options import Workers
from stoker.shards import Manifest, ShardWriter, write_manifest
from stoker.transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize

pytestmark = pytest.mark.skipif(not native.engine_available(), reason="the native extension or its libjpeg is missing")



@pytest.fixture(autouse=True)
def mixed_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packs here mix PNG and raw rows in (15%), which the engine refuses row by row: the native path
    takes them whatever their JPEG share."""
    from stoker.loading import route

    monkeypatch.setattr(route, "MIN_JPEG_SHARE", 0.0)


TRAIN = [RandomResizedCrop(64), RandomHorizontalFlip()]
VAL = [Resize(72), CenterCrop(64)]


def _exif_orientation(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


# generated odd JPEGs: (height, width, save options); "cmyk" is a CMYK JPEG (the per-sample path's)
ODD = [(1, 1, {}), (1, 300, {}), (300, 2, {"subsampling": 2}), (17, 23, {"subsampling": 1}),
       (131, 97, {"progressive": True, "restart_marker_blocks": 3}), (257, 129, {"subsampling": 0, "qtables": "web_high"}),
       (64, 48, {"exif": _exif_orientation(6)}), (48, 64, {"exif": _exif_orientation(3)}), (99, 101, {"optimize": True}),
       (333, 211, {"progressive": True, "subsampling": 0}), (9, 9, {"subsampling": 2}), (80, 60, {"cmyk": True})]


def _jpeg(rgb: np.ndarray, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=88, **save)
    return buf.getvalue()


def build(out: Path, seed: int = 0, corpus: bool = False, bad: tuple[int, ...] = (), shards: int = 2,
          batch_bytes: int = 32 * 2**20) -> Path:
    """JPEGs of varied size, subsampling and restart markers, a few PNG and raw rows, and (corpus=True)
    the shared corpus's JPEGs as they are (some CMYK, progressive, odd sizes)."""
    rng = np.random.default_rng(seed)
    items = []
    kinds = [{"subsampling": 2}, {"subsampling": 0}, {"subsampling": 1}, {"subsampling": 2, "restart_marker_rows": 1},
             {"progressive": True}]
    for i in range(36):
        h, w = (int(v) for v in rng.integers(20, 420, 2))
        rgb = smooth_rgb(rng, h, w)
        if i in bad:
            items.append((b"\xff\xd8\xff\xe0" + bytes(rng.integers(0, 255, 300, dtype=np.uint8)), "jpeg", h, w))
        elif i % 9 == 4:
            items.append((rgb.tobytes(), "raw", h, w))
        elif i % 10 == 7:
            buf = io.BytesIO()
            Image.fromarray(rgb).save(buf, "PNG")
            items.append((buf.getvalue(), "png", h, w))
        elif i % 8 == 5:
            items.append((_jpeg(rgb[:, :, 0]), "jpeg", h, w))
        else:
            items.append((_jpeg(rgb, **kinds[i % len(kinds)]), "jpeg", h, w))
    for i, (h, w, save) in enumerate(ODD):  # what the corpus brings, generated: any clone has these
        rgb = smooth_rgb(rng, h, w)
        if save.get("cmyk"):
            buf = io.BytesIO()
            Image.fromarray(rgb).convert("CMYK").save(buf, "JPEG", quality=85)
            items.append((buf.getvalue(), "jpeg", h, w))
            continue
        items.append((_jpeg(rgb, **save), "jpeg", h, w))
    if corpus:
        for path in sorted(PILLOW_CORPUS.glob("*.jpg")):
            data = path.read_bytes()
            try:
                with Image.open(io.BytesIO(data)) as im:
                    w, h = im.size
            except Exception:  # noqa: BLE001 - a file Pillow cannot open is not a JPEG row to compare
                continue
            items.append((data, "jpeg", h, w))
    out.mkdir(parents=True)
    infos, per = [], -(-len(items) // shards)
    for k in range(shards):
        writer = ShardWriter(out, k, label_type="int64", batch_bytes=batch_bytes)
        for i in range(k * per, min(len(items), (k + 1) * per)):
            data, enc, h, w = items[i]
            writer.add(f"img/{i:04d}", data, enc, h, w, i)
        infos.append(writer.finish())
    write_manifest(out, Manifest(num_samples=len(items), shards=infos, classes=None, label_type="int64"))
    return out


def epoch(path: Path, transforms: list, threads: int, on_error: str = "skip", native_path: bool = True
          ) -> tuple[np.ndarray, np.ndarray]:
    imgs, labels = [], []
    with Loader(path, 8, transforms=transforms, seed=5, device="numpy",
                workers=Workers(num_threads=threads, prefetch=1, on_error=on_error)) as loader:
        assert loader.route.native == native_path, loader.route.lines()
        for batch in loader:
            imgs.append(np.asarray(batch[0]).copy())
            labels.append(np.asarray(batch[1]).copy())
    return np.concatenate(imgs), np.concatenate(labels)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("native") / "ds", corpus=PILLOW_CORPUS.is_dir())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("transforms", [TRAIN, VAL], ids=["train", "val"])
def test_batches_are_the_same_with_the_native_path_on_and_off(dataset, transforms, threads, monkeypatch):
    on = epoch(dataset, transforms, threads)
    monkeypatch.setattr(native, "ON", False)
    off = epoch(dataset, transforms, threads, native_path=False)
    assert np.array_equal(on[1], off[1])
    bad = [i for i in range(len(on[0])) if not np.array_equal(on[0][i], off[0][i])]
    assert not bad, f"rows {bad[:10]} differ between the native and the per-sample path"


def test_a_failing_row_gets_the_per_sample_error(tmp_path, monkeypatch):
    path = build(tmp_path / "bad", seed=1, bad=(10,))
    with pytest.raises(Exception) as on:
        epoch(path, TRAIN, 2, on_error="raise")
    monkeypatch.setattr(native, "ON", False)
    with pytest.raises(Exception) as off:
        epoch(path, TRAIN, 2, on_error="raise", native_path=False)
    assert type(on.value) is type(off.value) and str(on.value) == str(off.value)
    assert "img/0010" in str(on.value)


@pytest.mark.parametrize("shards, batch_bytes", [(1, 32 * 2**20), (3, 32 * 2**20), (1, 20_000), (3, 20_000)])
def test_jpeg_spans_are_the_samples_bytes(tmp_path, shards, batch_bytes):
    """`PackedDataset.jpeg_spans` (the mapped blocks, one gather, one shard check per chunk) against
    `sample(i)`, and the generic `Dataset.jpeg_spans` the other datasets use; small `batch_bytes`
    gives shards of several record batches, each with its own encoding dictionary."""
    from stoker.dataset import Dataset
    from stoker.reader import open_dataset

    ds = open_dataset(build(tmp_path / "ds", seed=3, shards=shards, batch_bytes=batch_bytes))
    idx = np.random.default_rng(2).permutation(len(ds))[:30]
    want = [bytes(s.data) if s.encoding == "jpeg" else None for s in (ds.sample(int(i)) for i in idx)]
    assert any(w is None for w in want) and any(w is not None for w in want)
    for blocks, spans in (ds.jpeg_spans(idx), Dataset.jpeg_spans(ds, idx)):
        assert spans.dtype == np.int64 and spans.shape == (len(idx), 3) and spans.flags.c_contiguous
        got = [None if k < 0 else bytes(np.asarray(blocks[k]).reshape(-1)[lo:hi]) for k, lo, hi in spans.tolist()]
        assert got == want
    blocks = ds.jpeg_spans(idx)[0]  # the mapped blocks, not a view per row
    assert len(blocks) == shards if batch_bytes > 2**20 else len(blocks) > 2 * shards


def test_a_replaced_shard_sends_its_chunk_to_the_per_sample_path(tmp_path):
    """A shard whose file changed since it was opened: `jpeg_spans` raises ShardError naming it
    (the chunk then goes row by row, and each row's own read reports it)."""
    from stoker.errors import ShardError
    from stoker.reader import open_dataset

    path = build(tmp_path / "ds", seed=3, shards=2)
    ds = open_dataset(path)
    ds.jpeg_spans(np.arange(len(ds)))
    shard = sorted(path.glob("*.arrow"))[-1]
    with open(shard, "ab") as f:
        f.write(b"0" * 16)
    with pytest.raises(ShardError, match=shard.name):
        ds.jpeg_spans(np.arange(len(ds)))
    ds.jpeg_spans(np.arange(len(ds) // 4))  # rows of the first shard only: it alone is checked


def test_the_chunk_check_names_what_changed_as_the_per_sample_check_does(tmp_path):
    """A chunk's shard check (one stat per shard read) and a sample's read refuse a shard replaced by a
    rename, then deleted, with the same ShardError; a dataset handed the identities a parent process found
    (`loading.proc_child`) is checked against those."""
    import os
    import shutil

    from stoker.errors import ShardError
    from stoker.reader import open_dataset

    path = build(tmp_path / "ds", seed=3, shards=2)
    ds = open_dataset(path)
    last = sorted(path.glob("*.arrow"))[-1]
    everything, last_row = np.arange(len(ds)), len(ds) - 1
    for change, word in ((lambda: (shutil.copy(last, tmp_path / "copy"), os.replace(tmp_path / "copy", last)),
                          "replaced"), (last.unlink, "deleted")):
        change()
        with pytest.raises(ShardError, match=word) as chunk:
            ds.pixel_spans(everything)
        with pytest.raises(ShardError) as row:
            ds.sample(last_row)
        assert str(chunk.value) == str(row.value) and last.name in str(chunk.value)
        ds.jpeg_spans(np.arange(len(ds) // 4))   # rows of the first shard only: it alone is checked
    other = build(tmp_path / "other", seed=3, shards=2)
    ds = open_dataset(other)
    ds.jpeg_spans(everything)
    ds._identities = {name: (0, 0, size) for name, (*_, size) in ds._identities.items()}
    with pytest.raises(ShardError, match="replaced"):
        ds.jpeg_spans(everything)


def test_damaged_jpegs_give_the_same_batches(tmp_path, monkeypatch):
    """Bytes flipped inside the entropy data of some JPEGs: the native call reports those rows and the
    per-sample path decodes, replaces or keeps them exactly as it does without the native path."""
    src = build(tmp_path / "src", seed=4, shards=1)
    from stoker.reader import open_dataset

    ds = open_dataset(src)
    rng = np.random.default_rng(9)
    out = tmp_path / "flipped"
    out.mkdir()
    writer = ShardWriter(out, 0, label_type="int64")
    for i in range(len(ds)):
        s = ds.sample(i)
        data = bytearray(s.data)
        if s.encoding == "jpeg" and i % 3 == 0:
            for at in rng.integers(len(data) // 2, len(data) - 2, 4):
                data[at] ^= 0x5A
        writer.add(s.key, bytes(data), s.encoding, s.height, s.width, i)
    write_manifest(out, Manifest(num_samples=len(ds), shards=[writer.finish()], classes=None, label_type="int64"))
    on = epoch(out, TRAIN, 2)
    monkeypatch.setattr(native, "ON", False)
    off = epoch(out, TRAIN, 2, native_path=False)
    assert np.array_equal(on[1], off[1]) and np.array_equal(on[0], off[0])


@pytest.mark.parametrize("transforms, want", [
    ([RandomResizedCrop(224), RandomHorizontalFlip()], "30854411bec10b38"),
    ([Resize(256), CenterCrop(224)], "7db2e2a6d86cb60d"),
    ([CenterCrop(300), Resize((120, 90))], "1ff4e12c4b85226b"),
    ([RandomResizedCrop((160, 224), scale=(0.3, 1.0), ratio=(0.5, 2.0))], "60710ab8ae198b9c"),
], ids=["train", "val", "crop-resize", "rrc-rect"])
def test_batch_plans_are_the_released_ones(transforms, want):
    """Planning was made cheaper (cached stream keys, fewer NumPy calls, RandomResizedCrop's fallback
    planned only when a row needs it): keys, draws and plans must stay bit for bit those stoker gave
    before, so a seed gives the same crops. The digests were computed with the earlier code; tiny and
    very wide images take RandomResizedCrop's fallback."""
    import hashlib

    from stoker.order import TAG_DRAW, sample_keys, uniforms
    from stoker.transforms import Pipeline

    rng = np.random.default_rng(17)
    h, w = rng.integers(1, 2000, 512), rng.integers(1, 2000, 512)
    h[:64], w[64:128] = rng.integers(1, 12, 64), h[64:128] * 9
    pipe = Pipeline(transforms)
    keys = np.concatenate([sample_keys(3, e, np.arange(256)) for e in (0, 1)])
    drawn = sample_keys(3, 2, np.arange(512), tag=TAG_DRAW)
    u = uniforms(keys ^ drawn, max(pipe.draws, 1))
    geo = pipe.plan(h.astype(np.int32), w.astype(np.int32), u)
    sha = hashlib.sha256()
    for a in (keys, drawn, u, geo.box, geo.size, geo.flip, geo.clip, geo.grid):
        sha.update(np.ascontiguousarray(a).tobytes())
    assert sha.hexdigest()[:16] == want


def test_shards_of_many_record_batches_give_the_same_batches(tmp_path, monkeypatch):
    """Chunks whose rows come from many blocks of several shards (the spans name a block each): the
    same batches with the native path on and off."""
    path = build(tmp_path / "ds", seed=6, shards=3, batch_bytes=20_000)
    on = epoch(path, TRAIN, 2)
    monkeypatch.setattr(native, "ON", False)
    off = epoch(path, TRAIN, 2, native_path=False)
    assert np.array_equal(on[1], off[1]) and np.array_equal(on[0], off[0])


def test_stored_raw_pixels_are_read_by_the_engine_without_a_decode(tmp_path, monkeypatch):
    """A pack of raw pixels (`PackOptions(encoding="raw")`, the decode-once path): the engine reads each
    row's window in place (no decode) and gives the Python path's batches, bit for bit."""
    import stoker
    from stoker.packing import PackOptions

    rng = np.random.default_rng(4)
    for i in range(20):
        h, w = (int(v) for v in rng.integers(30, 140, 2))
        (tmp_path / "src" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(smooth_rgb(rng, h, w)).save(tmp_path / "src" / f"c{i % 2}" / f"{i}.jpg", quality=92)
    stoker.pack(str(tmp_path / "src"), str(tmp_path / "raw"), options=PackOptions(encoding="raw"), progress=False)
    kinds_seen: list = []
    real = native._mod.Engine

    class Watching:
        def __init__(self, *a):
            self.pool = real(*a)

        def run(self, *a, **kw):
            kinds_seen.append(kw.get("kinds"))
            return self.pool.run(*a, **kw)

        def close(self):
            self.pool.close()

        @property
        def active(self):
            return self.pool.active

    monkeypatch.setattr(native, "engine", Watching)
    for transforms in (TRAIN, VAL):
        on = epoch(tmp_path / "raw", transforms, 2)
        assert kinds_seen and all(k is not None and (k == 1).all() for k in kinds_seen)
        kinds_seen.clear()
        monkeypatch.setenv("STOKER_ENGINE", "off")
        off = epoch(tmp_path / "raw", transforms, 2, native_path=False)
        monkeypatch.delenv("STOKER_ENGINE")
        assert not kinds_seen and np.array_equal(on[1], off[1]) and np.array_equal(on[0], off[0])
