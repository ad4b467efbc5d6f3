"""Bit-flip fuzz of packed datasets: one random bit flipped in a shard's non-image bytes, then every
layer that reads a dataset is run on the damaged copy, each flip in a child process (a segfault or
a hang is counted, never hides the rest of the run).

    python benchmarks/fuzz_bitflips.py                 # 300 flips, seed 0
    python benchmarks/fuzz_bitflips.py --flips 500 --seed 1 --json flips.json
    python benchmarks/fuzz_bitflips.py --source lmdb --flips 500   # a source format's own file

With ``--source FORMAT`` (``lmdb``, ``tfrecord``, ``hdf5``, ``parquet``, ``targz``; ``all`` for each in
turn) the flips go anywhere in one file of that format, written by its own library (lmdb, the
``tfrecord`` package's writer, h5py, pyarrow, tarfile + gzip), and each damaged copy is listed,
packed and read back loose (``open_loose``, every sample's bytes and probe). A flip is "caught" when
a stoker error is raised, "packed" when the pack finishes (bad records skipped and logged in
``skipped.jsonl``); the goal is again 0 crashes, 0 hangs and 0 non-stoker exceptions.

Layers, in the order a user meets them: ``open`` (``open_dataset`` and reading every sample's key,
bytes, encoding, size, label and extra columns), ``loader`` (one epoch of a ``Loader`` with extra
columns), ``verify`` (``stoker verify``: SHA-256 of every shard), ``verify --decode``. A layer
"catches" a flip when it raises a stoker error or reports a problem. A flip no layer before
``verify`` catches is "harmless" when every value read back equals the original, else "silent".
The goal is 0 crashes, 0 hangs and 0 non-stoker exceptions; ``verify`` catches every flip (SHA-256).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LAYERS = ("open", "loader", "verify", "verify --decode")
#: Seconds one flip may take in the child before it counts as a hang.
FLIP_TIMEOUT_S = 120.0


def build_dataset(root: Path) -> Path:
    """A small CSV-sourced dataset: JPEGs and tiny raw samples (two encodings), an int label, a
    string and an int extra column, in 2 shards."""
    from PIL import Image

    from stoker.packing import PackOptions, pack

    rng = np.random.default_rng(0)
    src = root / "src"
    src.mkdir(parents=True)
    lines = ["path,label,caption,score"]
    for i in range(24):
        side = 8 if i % 4 == 0 else 24 + 4 * (i % 3)
        rgb = (rng.random((side, side, 3)) * 255).astype(np.uint8)
        Image.fromarray(rgb).save(src / f"img{i:02d}.jpg", quality=90)
        lines.append(f"img{i:02d}.jpg,{i % 3},caption number {i} {'x' * (i % 5)},{i * 7}")
    (src / "list.csv").write_text("\n".join(lines) + "\n")
    out = root / "packed"
    pack(src / "list.csv", out, options=PackOptions(workers=1, raw_below=10 * 10, shard_size=12_000),
         progress=False)
    return out


def strip_columns_checksums(dataset: Path) -> None:
    manifest = json.loads((dataset / "stoker.json").read_text())
    for entry in manifest["shards"]:
        entry.pop("columns_sha256", None)
    (dataset / "stoker.json").write_text(json.dumps(manifest))


def image_ranges(dataset: Path) -> dict[str, list[tuple[int, int]]]:
    """Per shard, the file byte ranges holding image bytes (the flips go everywhere else)."""
    import pyarrow as pa

    ranges: dict[str, list[tuple[int, int]]] = {}
    for shard in sorted(dataset.glob("*.arrow")):
        with pa.memory_map(str(shard), "r") as mm:
            base = mm.read_buffer(1).address
            mm.seek(0)
            reader = pa.ipc.open_file(mm)
            spans = []
            for k in range(reader.num_record_batches):
                values = reader.get_batch(k).column("image").buffers()[2]
                if values is not None and values.size:
                    spans.append((values.address - base, values.address - base + values.size))
            ranges[shard.name] = spans
    return ranges


def plan_flips(dataset: Path, count: int, seed: int) -> list[tuple[str, int, int]]:
    rng = np.random.default_rng(seed)
    ranges = image_ranges(dataset)
    candidates = []
    for name, spans in ranges.items():
        size = (dataset / name).stat().st_size
        mask = np.ones(size, bool)
        for a, b in spans:
            mask[a:b] = False
        candidates += [(name, int(off)) for off in np.flatnonzero(mask)]
    picks = rng.choice(len(candidates), size=count, replace=False)
    return [(*candidates[p], int(rng.integers(0, 8))) for p in picks]


# ------------------------------------------------------------------ source formats

SOURCES = ("lmdb", "tfrecord", "hdf5", "parquet", "targz")


def _small_jpegs(n: int) -> list[bytes]:
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray((rng.random((24 + 4 * (i % 3), 32, 3)) * 255).astype(np.uint8)).save(buf, "JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def build_source(kind: str, root: Path) -> tuple[Path, Path]:
    """(what to pack, the file the flips go into) for a small dataset of `kind`, written with the
    format's own library: 12 JPEGs, a label each, an extra field where the format has them."""
    import io
    import tarfile

    images = _small_jpegs(12)
    folder = root / f"src-{kind}"
    folder.mkdir(parents=True)
    if kind == "lmdb":
        import lmdb

        env = lmdb.open(str(folder), map_size=1 << 24)
        with env.begin(write=True) as txn:
            for i, img in enumerate(images):
                txn.put(f"c{i % 3}/img{i:02d}".encode(), img)
        env.close()
        return folder, folder / "data.mdb"
    if kind == "tfrecord":
        from tfrecord.writer import TFRecordWriter

        path = folder / "train.tfrecord"
        writer = TFRecordWriter(str(path))
        for i, img in enumerate(images):
            writer.write({"image/encoded": (img, "byte"), "image/class/label": (i % 3, "int"),
                          "image/filename": (f"img{i}.jpg".encode(), "byte")})
        writer.close()
        return path, path
    if kind == "hdf5":
        import h5py

        path = folder / "train.h5"
        with h5py.File(path, "w") as f:
            ds = f.create_dataset("images", (len(images),), dtype=h5py.vlen_dtype(np.uint8))
            for i, img in enumerate(images):
                ds[i] = np.frombuffer(img, np.uint8)
            f.create_dataset("labels", data=np.arange(len(images)) % 3)
            f.create_dataset("weight", data=np.linspace(0, 1, len(images)))
        return path, path
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "train-00000-of-00001.parquet"
        table = pa.table({"image": [{"bytes": img, "path": f"img{i}.jpg"} for i, img in enumerate(images)],
                          "label": list(np.arange(len(images)) % 3), "caption": [f"n{i}" for i in range(len(images))]})
        pq.write_table(table, path, row_group_size=4)
        return path, path
    if kind == "targz":
        path = folder / "train-000000.tar.gz"
        with tarfile.open(path, "w:gz") as tf:
            for i, img in enumerate(images):
                for ext, data in (("jpg", img), ("cls", str(i % 3).encode()),
                                  ("json", json.dumps({"caption": f"n{i}", "score": i}).encode())):
                    info = tarfile.TarInfo(f"s{i:02d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        return path, path
    raise ValueError(f"unknown source format {kind!r}; one of {SOURCES}")


def plan_source_flips(target: Path, count: int, seed: int) -> list[tuple[str, int, int]]:
    """`count` distinct (file name, byte, bit) anywhere in the source file."""
    rng = np.random.default_rng(seed)
    size = target.stat().st_size
    picks = rng.choice(size, size=min(count, size), replace=False)
    return [(target.name, int(off), int(rng.integers(0, 8))) for off in picks]


def read_loose(src: Path) -> int:
    from stoker.loose import open_loose

    ds = open_loose(src)
    for i in range(len(ds)):
        try:
            s = ds.sample(i)
            bytes(s.data)
        except Exception as exc:   # one sample refused is fine when it is a stoker ImageError
            from stoker.errors import ImageError

            if not isinstance(exc, ImageError):
                raise
        [ds.extra(i, c) for c in ds.extra_columns]
    return len(ds)


def source_child(kind: str, pristine: str, work: str) -> None:
    """One flip per stdin line: copy the pristine source, flip the bit, list + pack + read loose."""
    from stoker.packing import PackOptions, pack
    from stoker.sources.base import forget_decompressed

    pristine_src, _ = Path(pristine), None
    for n, line in enumerate(sys.stdin):
        name, offset, bit = json.loads(line)
        target = Path(work) / f"flip-{n}"   # a new path each time: lmdb keeps environments by path
        shutil.rmtree(Path(work) / f"flip-{n - 1}", ignore_errors=True)
        shutil.copytree(pristine_src.parent if pristine_src.is_file() else pristine_src, target / "src")
        src = target / "src" / pristine_src.name if pristine_src.is_file() else target / "src"
        flipped = src if src.is_file() else src / name
        with open(flipped, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)[0]
            fh.seek(offset)
            fh.write(bytes([byte ^ (1 << bit)]))
        forget_decompressed()
        status, summary = outcome(lambda: pack(src, target / "out", options=PackOptions(workers=1), progress=False))
        result = {"pack": status, "skipped": summary.skipped if summary is not None else None,
                  "loose": outcome(lambda: read_loose(src))[0]}
        print(json.dumps(result), flush=True)


def summarize_sources(results: list[dict]) -> dict:
    counts = {"flips": len(results), "crash or hang": 0, "non-stoker exception": 0, "packed": 0,
              "packed, some records skipped": 0, "caught by pack": 0, "caught by loose": 0}
    kinds: collections.Counter = collections.Counter()
    for r in results:
        if "fatal" in r:
            counts["crash or hang"] += 1
            continue
        bad = [v for v in (r["pack"], r["loose"]) if v.startswith("NON-STOKER")]
        if bad:
            counts["non-stoker exception"] += 1
            kinds.update(bad)
        counts["packed"] += r["pack"] == "ok"
        counts["packed, some records skipped"] += r["pack"] == "ok" and bool(r.get("skipped"))
        counts["caught by pack"] += r["pack"].startswith("caught")
        counts["caught by loose"] += r["loose"].startswith("caught")
    counts["non-stoker kinds"] = dict(kinds.most_common(12))
    return counts


# ------------------------------------------------------------------ child side

def read_everything(path: Path) -> list:
    """Every value a user can read from the dataset, as plain comparable Python values."""
    from stoker import open_dataset

    with open_dataset(path) as ds:
        labels, heights, widths = ds.labels.tolist(), ds.heights.tolist(), ds.widths.tolist()
        rows = []
        for i in range(len(ds)):
            s = ds.sample(i)
            rows.append((s.key, hashlib.sha256(bytes(s.data)).hexdigest(), s.encoding, s.height, s.width,
                         s.label, labels[i], heights[i], widths[i],
                         *[ds.extra(i, c) for c in ds.extra_columns]))
        return rows


def run_loader(path: Path) -> None:
    from stoker import Loader, Resize

    loader = Loader(path, 8, transforms=[Resize((16, 16))], columns=("caption", "score"),
                    timeout=60.0, workers=1)
    try:
        for _ in loader:
            pass
    finally:
        loader.close()


def outcome(fn) -> tuple[str, object]:
    from stoker.errors import StokerError

    try:
        return "ok", fn()
    except StokerError as exc:
        return f"caught: {type(exc).__name__}", None
    except Exception as exc:  # the fuzz's finding: any other exception is a bug
        return f"NON-STOKER {type(exc).__name__}: {str(exc)[:160]}", None


def child(pristine: str, work: str) -> None:
    from stoker import verify

    expected = read_everything(Path(pristine))
    for line in sys.stdin:
        name, offset, bit = json.loads(line)
        target = Path(work) / "ds"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(pristine, target)
        with open(target / name, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)[0]
            fh.seek(offset)
            fh.write(bytes([byte ^ (1 << bit)]))
        result = {}
        status, rows = outcome(lambda: read_everything(target))
        result["open"] = status if status != "ok" else ("ok" if rows == expected else "ok, different data")
        result["loader"] = outcome(lambda: run_loader(target))[0]
        for layer, decode in (("verify", False), ("verify --decode", True)):
            status, report = outcome(lambda: verify(target, decode=decode, workers=1))
            result[layer] = status if status != "ok" else ("ok" if report.ok else "caught: report")
        print(json.dumps(result), flush=True)


# ------------------------------------------------------------------ parent side

def run_flips(pristine: Path, flips: list, work: Path, source: str | None = None) -> list[dict]:
    """Feed flips to a child one at a time; a child that dies or hangs marks that flip and a
    fresh child takes the rest. `source`: a source format (the child lists and packs it)."""
    results: list[dict] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                                      os.environ.get("PYTHONPATH")]))}
    while len(results) < len(flips):
        mode = ["--child"] if source is None else ["--source-child", source]
        run_dir = work / f"run-{len(results)}"   # a fresh child works in a folder of its own
        run_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, __file__, *mode, str(pristine), str(run_dir)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            while len(results) < len(flips):
                flip = flips[len(results)]
                proc.stdin.write(json.dumps(flip) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], FLIP_TIMEOUT_S)
                line = proc.stdout.readline() if ready else ""
                if not ready:
                    proc.kill()
                    results.append({"flip": flip, "fatal": "hang"})
                    break
                if not line:
                    code = proc.wait(timeout=30)
                    results.append({"flip": flip, "fatal": f"crash (exit {code})"})
                    break
                results.append({"flip": flip, **json.loads(line)})
        finally:
            if proc.poll() is None:
                proc.stdin.close()
                proc.wait(timeout=30)
    return results


def summarize(results: list[dict]) -> dict:
    counts = {"flips": len(results), "crash or hang": 0, "non-stoker exception": 0, "silent": 0, "harmless": 0,
              "caught by open": 0, "caught by loader": 0, "caught by verify": 0, "caught by verify --decode": 0}
    kinds: collections.Counter = collections.Counter()
    for r in results:
        if "fatal" in r:
            counts["crash or hang"] += 1
            continue
        if any(v.startswith("NON-STOKER") for v in (r[layer] for layer in LAYERS)):
            counts["non-stoker exception"] += 1
            kinds.update(v for v in (r[layer] for layer in LAYERS) if v.startswith("NON-STOKER"))
        for layer in LAYERS:
            if r[layer].startswith("caught"):
                counts[f"caught by {layer}"] += 1
        if not r["open"].startswith("caught") and not r["loader"].startswith("caught"):
            counts["silent" if r["open"] == "ok, different data" else "harmless"] += 1
    counts["non-stoker kinds"] = dict(kinds.most_common(12))
    return counts


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--source-child":
        source_child(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flips", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every flip's per-layer outcome here")
    parser.add_argument("--legacy-manifest", action="store_true",
                        help="drop the small-columns checksums from the manifest (as written before they existed)")
    parser.add_argument("--source", choices=(*SOURCES, "all"),
                        help="flip bits in a source format's own file instead of a packed dataset")
    args = parser.parse_args()
    if args.source:
        report = {}
        for kind in SOURCES if args.source == "all" else (args.source,):
            with tempfile.TemporaryDirectory(prefix=f"stoker-fuzz-{kind}-") as tmp:
                src, target = build_source(kind, Path(tmp))
                flips = plan_source_flips(target, args.flips, args.seed)
                started = time.monotonic()
                results = run_flips(src, flips, Path(tmp) / "work", source=kind)
                report[kind] = {**summarize_sources(results), "file bytes": target.stat().st_size,
                                "seconds": round(time.monotonic() - started, 1)}
                if args.json:
                    Path(args.json).with_suffix(f".{kind}.json").write_text(json.dumps(results, indent=1))
            print(json.dumps({kind: report[kind]}, indent=1), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="stoker-fuzz-") as tmp:
        pristine = build_dataset(Path(tmp))
        if args.legacy_manifest:
            strip_columns_checksums(pristine)
        flips = plan_flips(pristine, args.flips, args.seed)
        started = time.monotonic()
        results = run_flips(pristine, flips, Path(tmp))
        summary = summarize(results)
    summary["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
