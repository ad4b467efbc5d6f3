"""The native batch engine (csrc/engine.c, loading/engine.py) under hostile rows and shutdowns.

A pack written row by row (`ShardWriter`, as a packer with a bug or a forged dataset would write it)
holds good JPEGs among every corpus file that is or claims to be a JPEG, truncated, bit-flipped and
empty rows, progressive, CMYK, greyscale, 12-bit and arithmetic/lossless-coded headers, a JPEG
claiming 65,500 x 65,500 pixels, stored sizes that are empty, wrong or huge, and bytes of other
formats stored as JPEG. The engine's batches must be bit for bit those of `STOKER_ENGINE=off`, every
refused row must be named (sample, shard, row) and cost nothing but itself, no stored size may make
anything allocate past `max_pixels`, and stopping in the middle of a native batch (break, an
exception in the consumer, Ctrl-C, garbage collection, interpreter exit, a replaced shard) leaves no
thread behind.
"""

from __future__ import annotations

import _thread
import gc
import io
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.transforms.kinds import engine_program
from stoker import native
from stoker.errors import ImageError, SampleError, ShardError
from stoker.loader.loader import Loader
from stoker.loader.options import Workers
from stoker.loading import engine
from stoker.transforms import CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize

from .rhelpers import CORPUS, jpeg_bytes, jpeg_claiming, run_child, smooth_rgb, write_pack

pytestmark = pytest.mark.skipif(not native.engine_available(), reason="the native extension or its libjpeg is missing")

TRAIN = [RandomResizedCrop(40), RandomHorizontalFlip()]
VAL = [Resize(48), CenterCrop(40)]


def _jpeg(rgb: np.ndarray, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=88, **save)
    return buf.getvalue()


def _sof(data: bytes, marker: int | None = None, precision: int | None = None) -> bytes:
    """`data` with its SOF0 segment made another frame type (SOF9 arithmetic, SOF3 lossless) or precision."""
    out = bytearray(data)
    sof = out.find(b"\xff\xc0")
    if marker is not None:
        out[sof + 1] = marker
    if precision is not None:
        out[sof + 4] = precision
    return bytes(out)


def gauntlet_rows(seed: int = 0) -> list[tuple[str, bytes, int, int, str | None]]:
    """(key, bytes, stored height, stored width, expected): "ok" must come out, "bad" must be refused,
    None either (damage some decoders tolerate)."""
    rng = np.random.default_rng(seed)
    rows: list[tuple[str, bytes, int, int, str | None]] = []
    kinds = [{}, {"subsampling": 0}, {"progressive": True}, {"restart_marker_rows": 1}, {"subsampling": 1}]
    for i in range(24):
        h, w = (int(v) for v in rng.integers(24, 200, 2))
        rgb = smooth_rgb(rng, h, w)
        rows.append((f"good/{i:02d}", _jpeg(rgb[:, :, 0]) if i % 7 == 3 else _jpeg(rgb, **kinds[i % 5]), h, w, "ok"))
    for h, w in ((1, 1), (1, 300), (300, 1), (2, 60_000), (9, 7)):   # odd sizes, a 60,000-wide strip
        rows.append((f"odd/{h}x{w}", _jpeg(smooth_rgb(rng, h, w)), h, w, "ok"))
    rgb = smooth_rgb(rng, 48, 64)
    cmyk = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(cmyk, "JPEG", quality=90)
    rows.append(("cmyk", cmyk.getvalue(), 48, 64, "ok"))
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, "PNG")
    base, h, w = rows[0][1], rows[0][2], rows[0][3]
    small = jpeg_bytes(np.zeros((16, 16, 3), np.uint8))
    rows += [(f"truncated/{cut}", base[:cut], h, w, "bad" if cut < 200 else None)
             for cut in (0, 2, 20, 200, len(base) // 2, len(base) - 2)]
    rows += [
        ("claims-65500/stored-65500", jpeg_claiming(65_500, 65_500), 65_500, 65_500, "bad"),
        ("claims-65500/stored-16", jpeg_claiming(65_500, 65_500), 16, 16, "bad"),
        ("stored-60000/real-16", small, 60_000, 60_000, "bad"),
        ("stored-17x16/real-16", small, 17, 16, "bad"),
        ("stored-0x0", small, 0, 0, "bad"),
        ("precision-12", _sof(base, precision=12), h, w, "bad"),
        ("arithmetic-sof9", _sof(base, marker=0xC9), h, w, None),
        ("lossless-sof3", _sof(base, marker=0xC3), h, w, None),
        ("png-stored-as-jpeg", png.getvalue(), 48, 64, None),
        ("text-stored-as-jpeg", b"not a jpeg at all\n" * 10, 48, 64, "bad"),
    ]
    for k in range(6):
        flipped = bytearray(rows[k][1])
        for pos in rng.integers(100, len(flipped), size=1 + k):
            flipped[pos] ^= 1 << int(rng.integers(0, 8))
        rows.append((f"flipped/{k}", bytes(flipped), rows[k][2], rows[k][3], None))
    if CORPUS.is_dir():   # every file that is a JPEG or is named like one, at the size Pillow reads
        for path in sorted(CORPUS.iterdir()):
            data = path.read_bytes() if path.is_file() else b""
            if not (path.suffix.lower() in (".jpg", ".jpeg", ".jfif") or data[:2] == b"\xff\xd8"):
                continue
            try:
                with Image.open(io.BytesIO(data)) as im:
                    cw, ch = im.size
            except Exception:  # noqa: BLE001 - not readable: stored at a made-up size
                ch, cw = 32, 32
            rows.append((f"corpus/{path.name}", data, ch, cw, None))
    return rows


@pytest.fixture(scope="module")
def gauntlet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    rows = gauntlet_rows()
    return write_pack(tmp_path_factory.mktemp("engine-gauntlet") / "pack", rows), rows


class Counting:
    """A pool that counts the rows its `run` calls wrote, and may act just before each call."""

    made: list["Counting"] = []
    before_run: list = []

    def __init__(self, threads: int, nice: int = 0, most: int = 0) -> None:
        self.pool = native._mod.Engine(threads, nice, most)
        self.rows = 0
        self.closed = False
        Counting.made.append(self)

    @property
    def active(self) -> int:
        return self.pool.active

    def run(self, *args, **options):
        for act in Counting.before_run:
            act()
        left, busy, state = self.pool.run(*args, **options)
        self.rows += len(args[2]) - left
        return left, busy, state

    def close(self) -> None:
        self.closed = True
        self.pool.close()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[Counting]:
    Counting.made, Counting.before_run = [], []
    monkeypatch.setattr(native, "engine", Counting)
    return Counting.made


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def epoch(path: Path, transforms: list, threads: int = 2, **workers) -> tuple[np.ndarray, np.ndarray, list, int]:
    """One pass: images, labels, the skip warnings (sorted) and `stats.skipped`."""
    handler = _Messages()
    log = logging.getLogger("stoker.loader")
    log.addHandler(handler)
    imgs, labels = [], []
    try:
        with Loader(path, 8, transforms=transforms, seed=5, device="numpy",
                    workers=Workers(num_threads=threads, prefetch=1, **{"on_error": "skip", **workers})) as loader:
            for x, y in loader:
                imgs.append(np.asarray(x).copy())
                labels.append(np.asarray(y).copy())
            skipped = loader.stats.skipped
    finally:
        log.removeHandler(handler)
    return np.concatenate(imgs), np.concatenate(labels), sorted(handler.lines), skipped


@pytest.mark.filterwarnings("ignore::UserWarning")   # Pillow's warnings about the corpus's odd EXIF
@pytest.mark.parametrize("transforms, quality", [(TRAIN, "accurate"), (VAL, "accurate"), (TRAIN, "exact"),
                                                 (TRAIN, "fast")], ids=["train", "val", "train-exact", "train-fast"])
def test_the_gauntlet_gives_the_engine_and_the_python_path_the_same_batches(gauntlet, transforms, quality, counted,
                                                                          monkeypatch):
    path, rows = gauntlet
    on = epoch(path, transforms, decode_quality=quality)
    assert sum(c.rows for c in counted) >= 20, "the engine served too few rows"
    monkeypatch.setenv(engine.ENV, "off")
    off = epoch(path, transforms, decode_quality=quality)
    assert np.array_equal(on[1], off[1]) and on[2] == off[2] and on[3] == off[3]
    bad = [i for i in range(len(on[0])) if not np.array_equal(on[0][i], off[0][i])]
    assert not bad, f"rows {bad[:10]} differ"
    # nothing lost: one row per sample, and every sample not refused is its own row
    assert len(on[1]) == len(rows)
    named = {line.split("'")[3] for line in on[2]}   # "on_error='skip': sample 'KEY' (shard ..., row ...)"
    assert all("(shard shard-0000" in line and ", row " in line for line in on[2]), on[2][:3]
    assert {key for key, *_, want in rows if want == "bad"} <= named
    assert not {key for key, *_, want in rows if want == "ok"} & named
    assert on[3] == len(named)
    kept = set(on[1].tolist())
    assert all(j in kept for j, r in enumerate(rows) if r[0] not in named)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_on_error_raise_names_the_same_first_refused_sample_with_and_without_the_engine(gauntlet, counted,
                                                                                      monkeypatch):
    path, rows = gauntlet
    refused = {key for key, *_, want in rows if want != "ok"}

    def until_error() -> tuple[list, SampleError]:
        got = []
        with Loader(path, 8, transforms=TRAIN, seed=5, device="numpy",
                    workers=Workers(num_threads=2, prefetch=1, on_error="raise")) as loader:
            with pytest.raises(SampleError) as info:
                for x, _ in loader:
                    got.append(np.asarray(x).copy())
        return got, info.value

    on, err = until_error()
    monkeypatch.setenv(engine.ENV, "off")
    off, err_off = until_error()
    assert str(err) == str(err_off) and err.key in refused
    assert isinstance(err.__cause__, ImageError) and f"(shard {err.shard}, row {err.row}" in str(err)
    assert len(on) == len(off) and all(np.array_equal(a, b) for a, b in zip(on, off))


def test_a_stored_size_over_max_pixels_is_refused_before_the_pool_allocates():
    """The pool's row status for a 16 x 16 JPEG stored as 60,000 x 60,000: 5 (too large: the per-sample
    path names it). It was 21 (header disagrees), after growing the thread's buffer to 10 GB."""
    from stoker import _libjpeg, codecs

    assert _libjpeg.region_decoder() is not None
    data = np.frombuffer(jpeg_bytes(np.zeros((16, 16, 3), np.uint8)), np.uint8)
    prog = engine_program([Resize((24, 24))], [0])
    images, status = np.zeros((2, 24, 24, 3), np.uint8), np.empty(2, np.uint8)
    pool = native._mod.Engine(1, 0)
    try:
        left, _, state = pool.run([data], np.array([[0, 0, len(data)]] * 2, np.int64), np.arange(2, dtype=np.int64),
                                  np.arange(2, dtype=np.int64), np.array([[60_000, 60_000], [16, 16]], np.int64), 1,
                                  prog, images, status, 0, 24, 24, True, 2.0, True, False,
                                  float(codecs.MAX_PIXELS), 30.0)
    finally:
        pool.close()
    assert (left, state) == (1, 0) and status.tolist() == [5, 0]


_BOMB = """
import os, resource, sys
import numpy as np
from rhelpers import jpeg_claiming
from stoker.loader.loader import Loader
from stoker.loader.options import Workers
from stoker.shards import Manifest, ShardWriter, write_manifest
from stoker.transforms import RandomResizedCrop
out = sys.argv[1]
os.environ["STOKER_ENGINE"] = sys.argv[2]
os.makedirs(out)
writer = ShardWriter(out, 0, label_type="int64")
good = jpeg_claiming(16, 16)
for i in range(7):
    writer.add(f"good/{i}", good, "jpeg", 16, 16, i)
writer.add("bomb", jpeg_claiming(65500, 65500), "jpeg", 65500, 65500, 7)
write_manifest(out, Manifest(num_samples=8, shards=[writer.finish()], classes=None, label_type="int64"))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    with Loader(out, 8, transforms=[RandomResizedCrop(24)], device="numpy",
                workers=Workers(num_threads=2, on_error="raise", decode_quality="exact")) as loader:
        for _ in loader:
            pass
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
print("GREW_MB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.parametrize("setting", ["on", "off"])
def test_a_jpeg_and_its_stored_size_both_claiming_65500_squared_cost_no_memory(tmp_path, setting):
    """decode_quality="exact" sized the decode buffer from the stored size and handed it to the decoder,
    which filled 12 GB over 30 s before the header check refused it (engine or not)."""
    proc = run_child(_BOMB, str(tmp_path / "pack"), setting)
    assert "ERROR SampleError" in proc.stdout and "'bomb'" in proc.stdout and "over the limit" in proc.stdout, \
        proc.stdout + proc.stderr
    grew = float(proc.stdout.split("GREW_MB")[1])
    assert grew < 400, proc.stdout


def test_an_infinite_timeout_does_not_stall_the_first_batch(gauntlet):
    """Workers(timeout=float("inf")): the engine's deadline was cast to one in the past, and its waiting
    coordinator re-took the pool's mutex in a loop the pool's threads could not get past: the first batch
    never came. Run in a child: a hang fails the test, not the suite."""
    code = ("import sys, numpy as np\nfrom stoker.loader.loader import Loader\nfrom stoker.loader.options import Workers\n"
            "from stoker.transforms import Resize\n"
            "with Loader(sys.argv[1], 8, transforms=[Resize((24, 24))], device='numpy', workers=Workers("
            "num_threads=2, on_error='skip', timeout=float('inf'))) as loader:\n"
            "    print('ROWS', sum(len(x) for x, _ in loader))\n")
    proc = run_child(code, str(gauntlet[0]), timeout=60)
    assert f"ROWS {len(gauntlet[1])}" in proc.stdout, proc.stdout + proc.stderr
    pool = native._mod.Engine(1, 0)
    try:
        with pytest.raises(ValueError, match="nan"):
            pool.run([], np.empty((0, 3), np.int64), np.empty(0, np.int64), np.empty(0, np.int64),
                     np.empty((0, 2), np.int64), 1, engine_program([Resize((8, 8))], [0]),
                     np.zeros((1, 8, 8, 3), np.uint8), np.empty(0, np.uint8), 0, 8, 8, True, 2.0, True, False,
                     1e12, float("nan"))
    finally:
        pool.close()


# ---- stopping while the pool is in the middle of a batch ------------------------------------------------

@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """96 JPEGs of 600 x 800: 8 batches of 12, each keeping the pool busy long enough to be stopped inside it."""
    data = jpeg_bytes(smooth_rgb(np.random.default_rng(0), 600, 800), quality=95)
    return write_pack(tmp_path_factory.mktemp("engine-big") / "pack",
                      [(f"big/{i:02d}", data, 600, 800, "ok") for i in range(96)], shards=1)


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_to(n: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while _tasks() > n and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return _tasks()


def _big_loader(path: Path) -> Loader:
    return Loader(path, 12, transforms=TRAIN, seed=2, device="numpy",
                  workers=Workers(num_threads=2, prefetch=1, decode_quality="exact"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "consumer-exception", "break", "garbage-collection"])
def test_stopping_inside_a_native_batch_joins_the_pool_and_the_loader_goes_on(big, counted, how):
    """Each way of stopping, acted on just as a coordinator hands the pool a later batch:
    Ctrl-C (from the coordinator, so it reaches the consumer while the pool renders), an exception in the
    consumer's loop, break, an iterator dropped without close(). The pool is closed, every thread ends,
    and the Loader's next pass is whole and the same."""
    whole = [np.asarray(x).copy() for x, _ in _big_loader(big)]   # also starts the libraries' own threads
    before = _tasks()
    calls = []
    in_run, armed, fired = threading.Event(), threading.Event(), threading.Event()

    def hook() -> None:
        calls.append(1)
        if how == "ctrl-c" and armed.is_set() and not fired.is_set():
            fired.set()
            _thread.interrupt_main()   # once the consumer's loop below can receive it
        if len(calls) >= 2:
            in_run.set()

    Counting.before_run.append(hook)
    loader = _big_loader(big)
    it = iter(loader)
    next(it)   # the pool's first batch is done; the hook acts on a later one
    if how == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            armed.set()
            for _ in it:
                time.sleep(0.01)
    elif how == "garbage-collection":
        assert in_run.wait(30)
    else:
        with pytest.raises(ZeroDivisionError) if how == "consumer-exception" else _nothing():
            for _ in it:
                assert in_run.wait(30)
                if how == "break":
                    break
                raise ZeroDivisionError("the training step failed")
    del it
    gc.collect()
    assert _settles_to(before) <= before
    assert counted and all(c.closed for c in counted), "a pool was not closed"
    Counting.before_run.clear()
    again = [np.asarray(x).copy() for x, _ in loader]
    loader.close()
    assert len(again) == len(whole) and all(np.array_equal(a, b) for a, b in zip(again, whole))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


_EXIT = """
import sys, threading
from stoker import native
from stoker.loader.loader import Loader
from stoker.loader.options import Workers
from stoker.transforms import RandomResizedCrop
real = native.engine
busy = threading.Event()
class Pool:
    def __init__(self, *a):
        self.pool = real(*a)
    def run(self, *a):
        busy.set()
        return self.pool.run(*a)
    def close(self):
        self.pool.close()
    @property
    def active(self):
        return self.pool.active
native.engine = Pool
loader = Loader(sys.argv[1], 24, transforms=[RandomResizedCrop(40)], device="numpy",
                workers=Workers(num_threads=2, prefetch=2, decode_quality="exact"))
it = iter(loader)
next(it)
busy.clear()
busy.wait(30)
print("EXITING", flush=True)
if sys.argv[2] == "raise":
    raise RuntimeError("the training script failed")
sys.exit(0)
"""


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_the_interpreter_exits_cleanly_while_the_pool_renders_a_batch(big, how):
    """No close(), no break: the script ends (or dies of an exception) while the pool's threads write a
    batch; the process exits with the script's status, not a crash or a hang."""
    started = time.monotonic()
    proc = run_child(_EXIT, str(big), how, timeout=60)
    assert "EXITING" in proc.stdout, proc.stderr
    assert proc.returncode == (0 if how == "exit" else 1), proc.stderr[-2000:]
    assert how == "exit" or "the training script failed" in proc.stderr
    assert time.monotonic() - started < 60


def test_a_shard_replaced_between_batches_is_named_by_the_engine_path(tmp_path, counted):
    """A shard renamed over mid-pass (its old mapping stays valid, so no SIGBUS): the batches already
    rendered come out, the next one raises the same SampleError (cause: ShardError) as without the engine."""
    data = jpeg_bytes(smooth_rgb(np.random.default_rng(4), 60, 80))
    path = write_pack(tmp_path / "pack", [(f"s/{i:02d}", data, 60, 80, "ok") for i in range(64)], shards=2)
    loader = Loader(path, 8, transforms=VAL, seed=1, device="numpy",
                    workers=Workers(num_threads=2, prefetch=1, on_error="raise"))
    it = iter(loader)
    next(it)
    shard = path / "shard-00001.arrow"
    copy = tmp_path / "copy.arrow"
    copy.write_bytes(shard.read_bytes())
    os.replace(copy, shard)
    with pytest.raises(SampleError) as info:
        for _ in it:
            pass
    loader.close()
    assert isinstance(info.value.__cause__, ShardError) and "shard-00001.arrow" in str(info.value)
    assert sum(c.rows for c in counted) >= 8


def test_a_pack_of_nothing_but_damaged_rows_fails_the_same_named_way(tmp_path, counted, monkeypatch):
    """Every row claims to be a JPEG (so the engine takes the pack) and none decodes: on_error="skip"
    runs out of replacements with the same SampleError, engine or not, naming the sample and the count."""
    path = write_pack(tmp_path / "pack", [(f"bad/{i}", b"\xff\xd8\xff\xe0" + bytes(range(200)), 30, 40)
                                          for i in range(20)])

    def first_error() -> str:
        with Loader(path, 8, transforms=[Resize((16, 16))], device="numpy",
                    workers=Workers(num_threads=2, on_error="skip")) as loader:
            with pytest.raises(SampleError) as info:
                for _ in loader:
                    pass
        return str(info.value)

    on = first_error()
    assert counted, "the engine did not take the pack"
    monkeypatch.setenv(engine.ENV, "off")
    assert first_error() == on and "replacement samples failed as well" in on and "sample 'bad/" in on


def test_gather_spans_refuses_an_offset_past_the_buffer_however_large():
    """`gather_spans` (the GPU rows' bytes into their staging buffer) checked `offset + length > size`,
    which overflowed for an offset near 2**63 and wrote outside the buffer (a segfault). In a child."""
    code = ("import numpy as np\nfrom stoker import native\n"
            "data, out = np.arange(100, dtype=np.uint8), np.zeros(50, np.uint8)\n"
            "for off in (30, 31, 2**63 - 5, 2**63 - 1, -1):\n"
            "    try:\n"
            "        print(off, native._mod.gather_spans([data], np.array([[0, 0, 20]], np.int64), out,\n"
            "                                            np.array([off], np.int64)))\n"
            "    except ValueError:\n"
            "        print(off, 'refused')\n")
    proc = run_child(code)
    assert proc.stdout.split("\n")[:5] == ["30 20", "31 refused", f"{2**63 - 5} refused", f"{2**63 - 1} refused",
                                            "-1 refused"], proc.stdout + proc.stderr
