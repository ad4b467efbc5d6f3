"""What stoker's threads rely on where the GIL is gone (a free-threaded build, python3.13t): positions
claimed once each by many workers, the region decoder run from eight threads at once giving the serial
pixels, and the extension declaring itself safe without the GIL. All but the last run on every build
(with a tiny switch interval here: threads interleave as often as they can); `.ci/freethreaded` builds
CPython 3.13t and runs this file there, with numpy, Pillow and pyarrow only (no torch, OpenCV or
simplejpeg: none of them has a free-threaded wheel this machine can install)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import sysconfig
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import stoker
from stoker.loading.numpy_output import NumpyBuffers
from stoker.loading.slots import BatchRing, Run, Slot
from stoker.loading.stats import WorkerTimes

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


@pytest.fixture
def busy_switching():
    """Threads switch at every opportunity (no effect on what a free-threaded build runs in parallel)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _recording_run(sizes: list[int], threads: int, seen: list[tuple[int, int]], open_ended: bool = False) -> Run:
    def fill(plan: None, row: int, slot: Slot, scratch: dict, times: WorkerTimes) -> None:
        seen.append((slot.batch, row))
        slot.images_np[row, 0, 0, 0] = slot.batch % 256
        slot.images_np[row, 0, 0, 1] = row

    # NumPy slots: the run needs no torch, so this runs on a free-threaded Python with numpy alone
    ring = BatchRing(3, max(sizes), 2, 2, label_dtype=None, pin_memory=False, buffers=NumpyBuffers())
    return Run(ring, sizes, threads, lambda b, slot: None, fill, lambda times, n: None, 20.0,
               name="stoker-ft", open_ended=open_ended)


def _drain(run: Run, sizes: list[int], first: int = 0) -> None:
    for b, n in enumerate(sizes, start=first):
        slot = run.next_batch(b)
        assert slot.images_np[:n, 0, 0, 0].tolist() == [b % 256] * n
        assert slot.images_np[:n, 0, 0, 1].tolist() == list(range(n))


@pytest.mark.usefixtures("busy_switching")
def test_many_workers_claim_every_position_once() -> None:
    sizes = [8] * 60 + [3]   # a partial batch at the end
    seen: list[tuple[int, int]] = []
    run = _recording_run(sizes, 8, seen)
    run.start()
    try:
        _drain(run, sizes)
    finally:
        run.stop()
    want = Counter((b, r) for b, n in enumerate(sizes) for r in range(n))
    assert Counter(seen) == want   # none twice, none missed


@pytest.mark.usefixtures("busy_switching")
def test_an_open_ended_run_claims_appended_batches_once() -> None:
    """A persistent Loader's next epoch: batches appended while workers wait for them."""
    first, more = [8] * 10, [8] * 10 + [5]
    seen: list[tuple[int, int]] = []
    run = _recording_run(first, 6, seen, open_ended=True)
    run.start()
    try:
        _drain(run, first)
        run.extend(more)
        _drain(run, more, first=len(first))
    finally:
        run.stop()
    sizes = first + more
    assert Counter(seen) == Counter((b, r) for b, n in enumerate(sizes) for r in range(n))


@pytest.mark.skipif(not FREE_THREADED, reason="needs a free-threaded Python (python3.13t)")
def test_region_decoder_leaves_the_gil_off() -> None:
    """Importing stoker._jpeg alone (not the package, whose dependencies may not declare themselves
    yet) keeps the GIL disabled and warns about nothing."""
    found = sorted(Path(stoker.__file__).parent.glob("_jpeg*" + sysconfig.get_config_var("EXT_SUFFIX")))
    if not found:
        pytest.skip("the compiled extension stoker._jpeg is not built for this interpreter")
    code = ("import importlib.machinery, importlib.util, sys\n"
            f"loader = importlib.machinery.ExtensionFileLoader('stoker._jpeg', {str(found[0])!r})\n"
            "spec = importlib.util.spec_from_loader('stoker._jpeg', loader)\n"
            "loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "print(sys._is_gil_enabled())\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _jpeg_module():
    """stoker._jpeg with Pillow's libjpeg-turbo loaded into it (the library stoker itself picks first)."""
    try:
        from stoker import _jpeg
        from stoker._libjpeg import _candidates
    except ImportError as exc:
        pytest.skip(f"the region decoder is not compiled here: {exc}")
    for path in _candidates():
        try:
            _jpeg.load(path)
            return _jpeg
        except RuntimeError:  # loaded already (by stoker itself, or an earlier test): one per process
            return _jpeg
        except OSError:
            continue
    pytest.skip("no libjpeg-turbo with partial decode found")


def _photo(seed: int, h: int = 240, w: int = 320, restart: bool = False) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // w, y * 255 // h, (x ^ y) & 255], -1).astype(np.int16)
    rgb = np.clip(rgb + rng.integers(-20, 21, rgb.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90, subsampling=2, **({"restart_marker_rows": 1} if restart else {}))
    data = buf.getvalue()
    return data, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("restart", [False, True])
def test_region_decodes_from_eight_threads_match_serial_and_pillow(restart):
    mod = _jpeg_module()
    images = [_photo(seed, restart=restart) for seed in range(4)]
    rng = np.random.default_rng(7)
    jobs = []
    for k in range(96):
        data, full = images[k % len(images)]
        h, w = full.shape[:2]
        y0, x0 = int(rng.integers(0, h - 16)), int(rng.integers(0, w - 16))
        y1, x1 = int(rng.integers(y0 + 8, h + 1)), int(rng.integers(x0 + 8, w + 1))
        jobs.append((k % len(images), y0, y1, x0, x1))

    def run(job):
        i, y0, y1, x0, x1 = job
        out = np.empty((y1 - y0, x1 - x0, 3), np.uint8)
        mod.decode(images[i][0], out, 8, y0, y1, x0, x1)
        return out

    serial = [run(j) for j in jobs]
    with ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(run, jobs))
    for job, a, b in zip(jobs, serial, parallel):
        i, y0, y1, x0, x1 = job
        assert np.array_equal(a, b), f"job {job}: threads decode different pixels"
        assert np.array_equal(a, images[i][1][y0:y1, x0:x1]), f"job {job}: differs from Pillow's decode"


def test_native_resize_from_eight_threads_matches_serial():
    """The C resize keeps its weights per call: threads resizing at once get the serial pixels."""
    try:
        from stoker import _jpeg
    except ImportError as exc:
        pytest.skip(f"the extension is not compiled here: {exc}")
    if not hasattr(_jpeg, "resample"):
        pytest.skip("this build of the extension has no native resize")
    rng = np.random.default_rng(3)
    jobs = []
    for k in range(64):
        h, w = (int(v) for v in rng.integers(8, 300, 2))
        oh, ow = (int(v) for v in rng.integers(1, 260, 2))
        jobs.append((rng.integers(0, 256, (h, w, 3), dtype=np.uint8), (oh, ow), bool(k % 2)))

    def run(job):
        src, size, antialias = job
        out = np.empty((*size, 3), np.uint8)
        _jpeg.resample(src, out, antialias=antialias)
        return out

    serial = [run(j) for j in jobs]
    with ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(run, jobs))
    for k, (a, b) in enumerate(zip(serial, parallel)):
        assert np.array_equal(a, b), f"job {k}: threads resize to different pixels"


def test_batch_engine_from_four_coordinators_matches_one_thread():
    """The native batch engine (`Engine`, csrc/engine.c) shared by four Python threads submitting batches
    at once, on a pool of six native threads: every batch is the one a one-thread pool renders alone.
    The program is built by hand (kinds.engine_program's encoding: RandomResizedCrop(48) + flip), so no
    OpenCV is needed."""
    import math

    mod = _jpeg_module()
    if not hasattr(mod, "Engine"):
        pytest.skip("the extension predates the batch engine")
    photos = [_photo(seed, h=180 + 20 * seed, w=260 - 10 * seed, restart=seed % 2 == 1)[0] for seed in range(4)]
    blocks = [np.frombuffer(b"".join(photos), np.uint8)]
    starts = np.cumsum([0] + [len(p) for p in photos])
    sizes = np.array([[180 + 20 * s, 260 - 10 * s] for s in range(4)], np.int64)
    prog = np.zeros((2, 10))
    prog[0] = (1, 0, 48, 48, 0.08, 1.0, math.log(3 / 4), math.log(4 / 3), 3 / 4, 4 / 3)
    prog[1, :3] = (4, 22, 0.5)
    rows = 32

    def batch(engine, b: int) -> np.ndarray:
        index = (np.arange(rows, dtype=np.int64) + b) % 4
        spans = np.stack([np.zeros(rows, np.int64), starts[index], starts[index + 1]], 1)
        images = np.zeros((rows, 48, 48, 3), np.uint8)
        status = np.empty(rows, np.uint8)
        left, _, state = engine.run(blocks, spans, np.arange(rows, dtype=np.int64) + 1000 * b, index, sizes, 77,
                                    prog, images, status, 0, 48, 48, False, 2.0, True, False, 1e12, 60.0)
        assert (left, state) == (0, 0) and not status.any()
        return images

    alone = mod.Engine(1)
    want = [batch(alone, b) for b in range(12)]
    alone.close()
    shared = mod.Engine(6)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: batch(shared, b), range(12)))
    shared.close()
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert len({w.tobytes() for w in want}) == 12   # the batches differ: the streams and crops are used
