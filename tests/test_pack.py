"""pack(): normalize rules, round trip, bad input, determinism, crash safety and resume."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import jpeg_bytes, make_image_folder, smooth_rgb
from PIL import Image, ImageOps

import stoker.pack_work as work
import stoker.packing as packmod
from stoker import codecs
from stoker.errors import ConfigError, CorruptImageError, DecompressionBombError, ImageError, SourceError
from stoker.packing import JOURNAL_NAME, SKIPPED_NAME, PackOptions, normalize, pack
from stoker.reader import open_dataset
from stoker.shards import file_sha256, read_manifest
from stoker.sources import open_source

ONE = PackOptions(workers=1, raw_below=0)


def _pillow_rgb(data: bytes) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    return np.asarray(ImageOps.exif_transpose(img).convert("RGB"))


def _decoded(out: packmod.Normalized) -> np.ndarray:
    return codecs.decode_rgb(out.image, out.encoding, "k", height=out.height, width=out.width)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b) ** 2)
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _rows(out: Path) -> list[tuple]:
    ds = open_dataset(out)
    try:
        return [(s.key, bytes(s.data), s.encoding, s.height, s.width, s.label)
                for s in (ds.sample(i) for i in range(len(ds)))]
    finally:
        ds.close()


def _shard_hashes(out: Path) -> list[tuple[str, str]]:
    return [(p.name, file_sha256(p)) for p in sorted(out.glob("shard-*.arrow"))]


# ---------------------------------------------------------------- normalize

def test_plain_jpeg_kept_byte_for_byte_and_grey_too() -> None:
    rng = np.random.default_rng(1)
    for pixels in (smooth_rgb(rng, 70, 90), smooth_rgb(rng, 70, 90)[:, :, 0].copy()):
        data = jpeg_bytes(pixels)
        out = normalize(data, "k", ONE)
        assert (out.image, out.encoding, out.height, out.width) == (data, "jpeg", 70, 90)


def test_exif_rotated_jpeg_comes_out_upright() -> None:
    rgb = smooth_rgb(np.random.default_rng(2), 60, 100)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = jpeg_bytes(rgb, quality=95, exif=exif.tobytes())
    out = normalize(data, "k", ONE)
    assert out.encoding == "jpeg" and (out.height, out.width) == (100, 60) and out.image != data
    expected = _pillow_rgb(data)
    assert expected.shape == (100, 60, 3)
    assert np.abs(_decoded(out).astype(int) - expected).mean() < 3.0 and _psnr(_decoded(out), expected) > 30


@pytest.mark.parametrize("mode", ["RGBA", "P", "I;16", "CMYK", "LA"])
def test_other_modes_become_rgb(mode: str) -> None:
    rgb = smooth_rgb(np.random.default_rng(3), 40, 50)
    img = Image.fromarray(rgb)
    if mode == "I;16":
        img = Image.fromarray(rgb[:, :, 0].astype(np.uint16) * 257)
        assert img.mode == "I;16"
    elif mode == "P":  # undithered: a dither pattern is noise no JPEG keeps (the gauntlet measures that)
        img = img.quantize(64, dither=Image.Dither.NONE)
    else:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG" if mode == "CMYK" else "PNG")
    data = buf.getvalue()
    raw = normalize(data, "k", PackOptions(encoding="raw"))
    assert (raw.encoding, raw.height, raw.width) == ("raw", 40, 50)
    assert np.array_equal(_decoded(raw), codecs.decode_pillow_rgb(data, "k"))
    jpg = normalize(data, "k", ONE)
    assert jpg.encoding == "jpeg" and _psnr(_decoded(jpg), _decoded(raw)) > 30


def test_tiny_images_are_stored_raw_exactly() -> None:
    data = jpeg_bytes(smooth_rgb(np.random.default_rng(4), 20, 30))
    out = normalize(data, "k", PackOptions(raw_below=32 * 32))
    assert (out.encoding, out.height, out.width) == ("raw", 20, 30)
    assert np.array_equal(_decoded(out), _pillow_rgb(data))


@pytest.mark.parametrize("shape, max_side, expected", [
    ((300, 200), 100, (100, 67)), ((200, 300), 100, (67, 100)), ((80, 60), 100, (80, 60)), ((1000, 10), 50, (50, 1)),
])
def test_max_side_shrinks_the_longer_side_never_enlarges(shape, max_side, expected) -> None:
    rgb = smooth_rgb(np.random.default_rng(5), *shape)
    for data in (jpeg_bytes(rgb, quality=95), _png(rgb)):
        out = normalize(data, "k", PackOptions(max_side=max_side, raw_below=0))
        assert (out.height, out.width) == expected
        got = _decoded(out)
        ref = np.asarray(Image.fromarray(_pillow_rgb(data)).resize(expected[::-1], Image.Resampling.LANCZOS))
        assert _psnr(got, ref) > 30, "resized content must match a plain Lanczos resize"


def _png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def test_encoding_jpeg_reencodes_every_sample() -> None:
    data = jpeg_bytes(smooth_rgb(np.random.default_rng(6), 64, 64), quality=98)
    out = normalize(data, "k", PackOptions(encoding="jpeg", jpeg_quality=50, raw_below=0))
    assert out.encoding == "jpeg" and len(out.image) < len(data)


def test_bad_bytes_raise_image_errors() -> None:
    good = jpeg_bytes(smooth_rgb(np.random.default_rng(7), 64, 64))
    with pytest.raises(CorruptImageError, match="empty"):
        normalize(b"", "k", ONE)
    with pytest.raises(CorruptImageError):
        normalize(b"this is not an image", "k", ONE)
    with pytest.raises(CorruptImageError):
        normalize(good[: len(good) // 2], "k", ONE)  # truncated: caught by the full decode
    with pytest.raises(DecompressionBombError):
        normalize(good, "k", PackOptions(max_pixels=1000))


def test_options_are_validated() -> None:
    for bad in ({"encoding": "png"}, {"jpeg_quality": 0}, {"max_side": 0}, {"workers": 0},
                {"on_error": "ignore"}, {"shard_size": 0}, {"raw_below": -1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            PackOptions(**bad)


# ---------------------------------------------------------------- pack

def test_round_trip_folder(image_folder: Path, tmp_path: Path) -> None:
    summary = pack(image_folder, tmp_path / "out", options=ONE, progress=False)
    assert (summary.packed, summary.skipped, summary.shards) == (12, 0, 1)
    assert summary.bytes_in == summary.bytes_out > 0 and "packed 12 images" in str(summary)
    source = open_source(image_folder)
    rows = _rows(tmp_path / "out")
    assert [r[0] for r in rows] == [i.key for i in source.items]
    for item, (key, data, enc, h, w, label) in zip(source.items, rows):
        assert data == item.read() and enc == "jpeg" and label == item.label
        assert (h, w) == Image.open(item.path).size[::-1]
    manifest = read_manifest(tmp_path / "out")
    assert manifest.classes == ["cat", "dog", "eel"] and manifest.num_samples == 12
    assert manifest.pack_options["source_kind"] == "folder" and manifest.pack_options["encoding"] == "keep"
    assert not (tmp_path / "out" / JOURNAL_NAME).exists()
    assert (tmp_path / "out" / SKIPPED_NAME).read_text() == ""


def test_round_trip_csv_extras_and_string_labels(image_folder: Path, tmp_path: Path) -> None:
    keys = sorted(p.relative_to(image_folder).as_posix() for p in image_folder.rglob("*.jpg"))[:5]
    lines = ["path,label,weight,count,note"] + [f"{k},{'bird' if i % 2 else 'ant'},{i / 4},{i * 10},n{i}"
                                                 for i, k in enumerate(keys)]
    (image_folder / "meta.csv").write_text("\n".join(lines) + "\n")
    pack(image_folder / "meta.csv", tmp_path / "out", options=ONE, progress=False)
    ds = open_dataset(tmp_path / "out")
    assert ds.classes == ["ant", "bird"] and list(ds.labels) == [0, 1, 0, 1, 0]
    assert [ds.extra(i, "weight") for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [ds.extra(i, "count") for i in range(5)] == [0, 10, 20, 30, 40]
    assert [ds.extra(i, "note") for i in range(5)] == [f"n{i}" for i in range(5)]
    assert [ds.sample(i).key for i in range(5)] == keys
    ds.close()


def _bad_folder(root: Path) -> Path:
    make_image_folder(root, n_per_class=3, classes=("a", "b"))
    (root / "a" / "000.jpg").write_bytes(b"")                              # zero bytes
    good = (root / "b" / "001.jpg").read_bytes()
    (root / "b" / "001.jpg").write_bytes(good[: len(good) // 2])           # truncated
    (root / "b" / "zz.png").write_text("not a png at all")                 # not an image
    return root


def test_bad_files_are_skipped_with_reasons(tmp_path: Path) -> None:
    root = _bad_folder(tmp_path / "src")
    summary = pack(root, tmp_path / "out", options=ONE, progress=False)
    assert (summary.packed, summary.skipped) == (4, 3)
    skipped = [json.loads(line) for line in (tmp_path / "out" / SKIPPED_NAME).read_text().splitlines()]
    assert [s["key"] for s in skipped] == ["a/000.jpg", "b/001.jpg", "b/zz.png"]
    assert all(s["reason"] and Path(s["path"]).is_absolute() for s in skipped)
    assert "empty" in skipped[0]["reason"]
    assert "skipped" in str(summary)


def test_on_error_fail_names_file_and_reason(tmp_path: Path) -> None:
    root = _bad_folder(tmp_path / "src")
    with pytest.raises(ImageError) as info:
        pack(root, tmp_path / "out", options=PackOptions(workers=1, on_error="fail"), progress=False)
    assert info.value.key == str(root / "a" / "000.jpg") and "empty" in info.value.reason


def test_file_vanishing_after_listing_is_a_skip(image_folder: Path, tmp_path: Path) -> None:
    source = open_source(image_folder)
    source.items[3].path.unlink()
    summary = pack(source, tmp_path / "out", options=ONE, progress=False)
    assert (summary.packed, summary.skipped) == (11, 1)
    line = json.loads((tmp_path / "out" / SKIPPED_NAME).read_text())
    assert line["key"] == source.items[3].key and "not found" in line["reason"]


def test_all_bad_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.jpg").write_bytes(b"nope")
    with pytest.raises(SourceError, match="none of the 1 images"):
        pack(tmp_path / "src", tmp_path / "out", options=ONE, progress=False)
    with pytest.raises(SourceError, match="does not exist"):
        pack(tmp_path / "missing", tmp_path / "out2", progress=False)


def test_existing_pack_needs_resume_or_overwrite(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(image_folder, out, options=ONE, progress=False)
    with pytest.raises(ConfigError, match="resume=True.*overwrite=True.*empty directory"):
        pack(image_folder, out, options=ONE, progress=False)
    again = pack(image_folder, out, options=ONE, progress=False, resume=True)  # already finished
    assert again.packed == 12
    with pytest.raises(ConfigError, match="other options"):
        pack(image_folder, out, options=PackOptions(workers=1, max_side=32), progress=False, resume=True)
    (out / "notes.txt").write_text("mine")
    summary = pack(image_folder, out, options=PackOptions(workers=1, max_side=32), progress=False, overwrite=True)
    assert summary.packed == 12 and (out / "notes.txt").read_text() == "mine"
    assert read_manifest(out).pack_options["max_side"] == 32


def test_output_is_the_same_for_any_worker_count(tmp_path: Path) -> None:
    root = _bad_folder(tmp_path / "src")
    make_image_folder(root, n_per_class=6, classes=("c", "d"), seed=3)
    hashes = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        summary = pack(root, out, options=PackOptions(workers=workers, shard_size=6000, max_side=48), progress=False)
        assert summary.shards > 2
        hashes.append((_shard_hashes(out), (out / SKIPPED_NAME).read_text(), read_manifest(out).to_json()))
    assert hashes[0] == hashes[1]


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Make the n-th processed sample raise KeyboardInterrupt, as Ctrl-C would."""
    calls = {"n": 0}
    real = work._process_one

    def flaky(entry, options):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(entry, options)
    monkeypatch.setattr(work, "_process_one", flaky)


def test_resume_after_interrupt_matches_uninterrupted_run(tmp_path: Path, monkeypatch) -> None:
    root = _bad_folder(tmp_path / "src")
    make_image_folder(root, n_per_class=8, classes=("c", "d"), seed=4)
    opts = PackOptions(workers=1, shard_size=5000)
    full = tmp_path / "full"
    pack(root, full, options=opts, progress=False)

    out = tmp_path / "cut"
    _interrupt_at(monkeypatch, 17)
    with pytest.raises(KeyboardInterrupt):
        pack(root, out, options=opts, progress=False)
    monkeypatch.undo()
    assert (out / JOURNAL_NAME).exists() and not (out / "stoker.json").exists()
    assert not list(out.glob(".*.tmp"))
    done_before = len(list(out.glob("shard-*.arrow")))
    assert done_before >= 1
    # damage the last finished shard: resume must notice and redo it
    last = sorted(out.glob("shard-*.arrow"))[-1]
    last.write_bytes(last.read_bytes()[:-10] + b"x" * 10)
    with pytest.raises(ConfigError, match="resume=True"):
        pack(root, out, options=opts, progress=False)
    with pytest.raises(ConfigError, match="differs"):
        pack(root, out, options=PackOptions(workers=1, shard_size=4000), progress=False, resume=True)
    summary = pack(root, out, options=opts, progress=False, resume=True)
    assert summary.packed == read_manifest(full).num_samples and summary.skipped == 3
    assert _shard_hashes(out) == _shard_hashes(full)
    assert (out / SKIPPED_NAME).read_text() == (full / SKIPPED_NAME).read_text()
    assert read_manifest(out).to_json() == read_manifest(full).to_json()
    assert not (out / JOURNAL_NAME).exists()


_SLOW_PACK = """
import sys, time
import stoker.pack_work as W
import stoker.packing as P
real = W._process_one
def slow(entry, options):
    time.sleep(0.01)
    return real(entry, options)
W._process_one = slow
P.pack(sys.argv[1], sys.argv[2], options=P.PackOptions(workers=1, shard_size=int(sys.argv[3])), progress=False)
"""


def test_resume_after_kill_9_mid_shard(tmp_path: Path) -> None:
    root = _bad_folder(tmp_path / "src")
    make_image_folder(root, n_per_class=30, classes=("c", "d", "e"), seed=5)
    shard_size = 20_000
    full = tmp_path / "full"
    pack(root, full, options=PackOptions(workers=1, shard_size=shard_size), progress=False)
    assert len(_shard_hashes(full)) >= 4

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PACK, str(root), str(out), str(shard_size)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            journal = out / JOURNAL_NAME
            if journal.exists() and len(journal.read_text().splitlines()) >= 3:  # header + 2 shards
                break
            time.sleep(0.005)
        time.sleep(0.05)  # now in the middle of the next shard
        assert proc.poll() is None, "the pack finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not (out / "stoker.json").exists()
    summary = pack(root, out, options=PackOptions(workers=2, shard_size=shard_size), progress=False, resume=True)
    assert summary.packed == read_manifest(full).num_samples
    assert _rows(out) == _rows(full)
    assert _shard_hashes(out) == _shard_hashes(full)
    assert (out / SKIPPED_NAME).read_text() == (full / SKIPPED_NAME).read_text()
    assert not list(out.glob(".*tmp"))


def test_hard_edged_graphics_get_full_chroma_or_lossless_png() -> None:
    rng = np.random.default_rng(8)
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0]], np.uint8)
    checks = colours[rng.integers(0, 4, size=(80, 80))]  # 1-pixel colour checks: 7 dB at 4:2:0
    out = normalize(_png(checks), "k", ONE)
    assert out.encoding == "jpeg" and _psnr(_decoded(out), checks) >= 30
    noise = rng.integers(0, 256, size=(80, 80, 3), dtype=np.uint8)  # under 30 dB even at 4:4:4
    out = normalize(_png(noise), "k", ONE)
    assert out.encoding == "png" and np.array_equal(_decoded(out), noise)
    lossy = normalize(_png(noise), "k", PackOptions(encoding="jpeg", raw_below=0))
    assert lossy.encoding == "jpeg"  # asked for JPEG: gets JPEG


def test_on_error_fail_with_workers_stops_promptly(tmp_path: Path) -> None:
    root = _bad_folder(tmp_path / "src")
    make_image_folder(root, n_per_class=20, classes=("c",), seed=6)
    started = time.monotonic()
    with pytest.raises(CorruptImageError, match="000.jpg"):
        pack(root, tmp_path / "out", options=PackOptions(workers=2, on_error="fail"), progress=False)
    assert time.monotonic() - started < 30
    assert not (tmp_path / "out" / "stoker.json").exists()
