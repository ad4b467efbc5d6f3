"""Helpers for the reliability suite: hostile files, resource counters, child processes.

(A plain module, not conftest.py, so that tests and child processes can import it by name.)

Anything that could crash the interpreter (a segfault in a decoder, SIGBUS from a shrunk
memory map, kill -9) runs in a child process, so a crash fails one test instead of pytest.
"""

from __future__ import annotations

import gc
import importlib.util
import io
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent


def _shared_helpers():
    # tests/conftest.py by file path, under its own name: "conftest" is ambiguous in sys.modules
    spec = importlib.util.spec_from_file_location("stoker_tests_shared", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_shared = _shared_helpers()
jpeg_bytes, make_image_folder, smooth_rgb = _shared.jpeg_bytes, _shared.make_image_folder, _shared.smooth_rgb

CORPUS, CORPUS_MISSING = _shared.PILLOW_CORPUS, _shared.CORPUS_MISSING
#: Seconds a child process may take before the test calls it hung. Every child here finishes in
#: a few seconds on a loaded 2-core machine; a hang is a bug, not slowness.
CHILD_TIMEOUT_S = 120.0
GOOD_SHAPE = (40, 48)  # (height, width) of every valid generated image


def run_child(code: str, *args: str, timeout: float = CHILD_TIMEOUT_S,
              expect_signal: int | None = None) -> subprocess.CompletedProcess:
    """Run Python ``code`` in a fresh interpreter; a crash (death by a signal other than
    ``expect_signal``) or a hang (TimeoutExpired) fails the calling test with the child's output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"child process hung for more than {timeout:.0f} s; output so far:\n{exc.stdout}\n{exc.stderr}")
    if proc.returncode < 0 and -proc.returncode != expect_signal:
        pytest.fail(f"child process died from signal {-proc.returncode} (crash, not an exception):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


# ---------------------------------------------------------------- resource counters

def open_fds() -> int:
    """File descriptors open in this process (Linux: /proc/self/fd)."""
    return len(os.listdir("/proc/self/fd"))


def settle_threads(baseline: int, timeout: float = 5.0) -> int:
    """Wait (bounded) for thread count to come back to ``baseline``; returns the count reached."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return threading.active_count()


# ---------------------------------------------------------------- hostile files

def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming ``width`` x ``height`` RGB pixels, a tiny IDAT, IEND."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _png_chunk(b"IEND", b""))


def jpeg_claiming(width: int, height: int) -> bytes:
    """A small valid JPEG whose SOF header is patched to claim ``width`` x ``height``."""
    data = bytearray(jpeg_bytes(np.zeros((16, 16, 3), np.uint8)))
    sof = data.find(b"\xff\xc0")
    data[sof + 5: sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def hostile_files(seed: int = 0) -> dict[str, tuple[bytes, str | None]]:
    """name -> (bytes, expected). ``expected`` is "ok" (a valid image of GOOD_SHAPE that must come
    out as correct RGB), "skip" (must be refused, with a reason) or None (damaged in a way some
    decoders tolerate: either outcome is fine, but never a crash or a hang)."""
    rng = np.random.default_rng(seed)
    h, w = GOOD_SHAPE
    rgb = smooth_rgb(rng, h, w)
    good_jpeg = jpeg_bytes(rgb, quality=92)
    good_png = _save(Image.fromarray(rgb), "PNG")
    files: dict[str, tuple[bytes, str | None]] = {
        "good.jpg": (good_jpeg, "ok"),
        "good.png": (good_png, "ok"),
        "cmyk.jpg": (_save(Image.fromarray(rgb).convert("CMYK"), "JPEG", quality=95), "ok"),
        "gray16.png": (_save(Image.fromarray((rgb[:, :, 0].astype(np.uint16) * 257)), "PNG"), "ok"),
        "palette.gif": (_save(Image.fromarray(rgb).convert("P"), "GIF"), "ok"),
        "zero.jpg": (b"", "skip"),
        "text.jpg": (b"this is not an image, just text named .jpg\n" * 20, "skip"),
        "bomb_jpeg.jpg": (jpeg_claiming(65_500, 65_500), "skip"),  # JPEG's size fields stop at 65,535
        "bomb_png.png": (png_header_only(100_000, 100_000), "skip"),
        "header_only.jpg": (good_jpeg[:2], "skip"),
    }
    frames = [Image.fromarray(np.roll(rgb, k * 7, axis=1)) for k in range(3)]
    anim = io.BytesIO()
    frames[0].save(anim, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    files["animated.gif"] = (anim.getvalue(), "ok")
    # PNG with a broken CRC on IDAT: the data is intact, the checksum is not
    png = bytearray(good_png)
    idat = png.find(b"IDAT")
    length = struct.unpack(">I", png[idat - 4: idat])[0]
    png[idat + 4 + length] ^= 0xFF
    files["bad_crc.png"] = (bytes(png), None)
    for k, cut in enumerate(sorted(rng.integers(3, len(good_jpeg) - 1, size=6))):
        files[f"trunc_{k}_{cut}.jpg"] = (good_jpeg[:cut], None)
    for k, cut in enumerate(sorted(rng.integers(9, len(good_png) - 1, size=3))):
        files[f"trunc_{k}_{cut}.png"] = (good_png[:cut], None)
    for k in range(8):
        flipped = bytearray(good_jpeg if k < 6 else good_png)
        for pos in rng.integers(2, len(flipped), size=1 + k):
            flipped[pos] ^= 1 << int(rng.integers(0, 8))
        files[f"flip_{k}.{'jpg' if k < 6 else 'png'}"] = (bytes(flipped), None)
    return files


def reference_rgb(data: bytes) -> np.ndarray:
    """Pillow's decode of a valid generated image as RGB (16-bit grey scaled to 8 bits)."""
    img = Image.open(io.BytesIO(data))
    img.seek(0)
    img.load()
    if img.mode.startswith("I;16"):
        arr = (np.asarray(img, dtype=np.int64) + 128) // 257
        return np.repeat(arr.astype(np.uint8)[:, :, None], 3, axis=2)
    return np.asarray(img.convert("RGB"))


def write_files(folder: Path, files: dict[str, tuple[bytes, str | None]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, (data, _) in files.items():
        (folder / name).write_bytes(data)
    return folder


__all__ = ["CHILD_TIMEOUT_S", "CORPUS", "CORPUS_MISSING", "GOOD_SHAPE", "hostile_files", "jpeg_claiming", "make_image_folder",
           "open_fds", "png_header_only", "reference_rgb", "run_child", "settle_threads", "write_files"]


def write_pack(out: Path, rows: list, shards: int = 2) -> Path:
    """A pack written row by row (as a packer with a bug, or a forged dataset, would write it): each of
    `rows` (key, bytes, stored height, stored width, ...) a JPEG row whatever its bytes, in a shuffled
    order; each row's label is its place in `rows`."""
    from stoker.shards import Manifest, ShardWriter, write_manifest

    out.mkdir(parents=True)
    order = np.random.default_rng(1).permutation(len(rows))
    per, infos = -(-len(rows) // shards), []
    for k in range(shards):
        writer = ShardWriter(out, k, label_type="int64")
        for j in order[k * per:(k + 1) * per].tolist():
            key, data, h, w = rows[j][:4]
            writer.add(key, data, "jpeg", h, w, j)
        infos.append(writer.finish())
    write_manifest(out, Manifest(num_samples=len(rows), shards=infos, classes=None, label_type="int64"))
    return out
