"""Pack speed from each source format vs packing the same images from an ImageFolder, in one run.

    python benchmarks/bench_sources.py CACHE_DIR [--images 2000] [--rounds 3] [--workers 2] [--json out.json]

The same generated ImageNet-like JPEGs (``stoker.synth``) are written once into every format with
that format's own writer library (pyarrow for Parquet/Arrow, ``lmdb``, ``h5py``, the ``tfrecord``
package, ``tarfile``; for MXNet RecordIO, which no longer installs, the tests' writer that
reproduces MXNet's files byte for byte), under CACHE_DIR. Then each source is packed ``--rounds`` times, the formats
in a different order each round (so a noisy neighbour hits all of them alike); the median wall time
is reported with the ratio ``folder time / format time`` (above 1: faster than the folder), and the
CPU time this process spent per image (all its threads; less sensitive than wall time to other
processes on a shared machine) with its ratio to the folder's (below 1: less work). Listing time
(``open_source``: reading labels and record offsets) is reported on its own too; pack times
include pack's own listing. Formats whose
writer library is missing are left out, with the reason printed.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import io
import json
import shutil
import statistics
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stoker.packing import PackOptions, pack
from stoker.sources import open_source
from stoker.sources.base import forget_decompressed
from stoker.tools.synth import cached_imagenet_like


def _samples(folder: Path) -> list[tuple[Path, int]]:
    src = open_source(folder, kind="folder")
    return [(i.path, i.label) for i in src.items]


def write_list(samples: list[tuple[Path, int]], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text("".join(f"{p} {label}\n" for p, label in samples))   # absolute paths
    return out / "train.txt"


def write_tars(samples: list[tuple[Path, int]], out: Path, gz: bool = False, shards: int = 4) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    per = -(-len(samples) // shards)
    for s in range(shards):
        name = out / f"train-{s:06d}.tar{'.gz' if gz else ''}"
        with tarfile.open(name, "w:gz" if gz else "w") as tf:
            for i, (path, label) in enumerate(samples[s * per:(s + 1) * per]):
                for ext, data in (("jpg", path.read_bytes()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{s:02d}{i:06d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return out


def _hf_table(samples: list[tuple[Path, int]]) -> Any:
    import pyarrow as pa
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": p.read_bytes(), "path": p.name} for p, _ in samples], struct)
    names = sorted({p.parent.name for p, _ in samples})
    meta = {"info": {"features": {"image": {"_type": "Image"},
                                  "label": {"names": names, "_type": "ClassLabel"}}}}
    return pa.table({"image": images, "label": pa.array([lab for _, lab in samples], pa.int64())},
                    metadata={"huggingface": json.dumps(meta)})


def write_parquet(samples: list[tuple[Path, int]], out: Path) -> Path:
    import pyarrow.parquet as pq
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(_hf_table(samples), out / "train-00000-of-00001.parquet", row_group_size=100)  # as datasets does
    return out


def write_arrow(samples: list[tuple[Path, int]], out: Path) -> Path:
    import pyarrow as pa
    out.mkdir(parents=True, exist_ok=True)
    table = _hf_table(samples)
    with pa.OSFile(str(out / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=1000)   # save_to_disk writes IPC streams
    return out / "data-00000-of-00001.arrow"


def write_lmdb(samples: list[tuple[Path, int]], out: Path) -> Path:
    import lmdb
    total = sum(p.stat().st_size for p, _ in samples)
    env = lmdb.open(str(out), map_size=2 * total + (64 << 20))
    with env.begin(write=True) as txn:
        for i, (path, _) in enumerate(samples):
            txn.put(f"{i:08d}".encode(), path.read_bytes())
    env.close()
    (out / "labels.txt").write_text("".join(f"{i:08d} {lab}\n" for i, (_, lab) in enumerate(samples)))
    return out


def write_tfrecord(samples: list[tuple[Path, int]], out: Path, gz: bool = False, shards: int = 4) -> Path:
    from tfrecord.writer import TFRecordWriter
    out.mkdir(parents=True, exist_ok=True)
    per = -(-len(samples) // shards)
    for s in range(shards):
        name = out / f"train-{s:05d}-of-{shards:05d}"
        writer = TFRecordWriter(str(name))
        for path, label in samples[s * per:(s + 1) * per]:
            writer.write({"image/encoded": (path.read_bytes(), "byte"), "image/class/label": (label + 1, "int"),
                          "image/filename": (path.name.encode(), "byte"), "image/format": (b"JPEG", "byte")})
        writer.close()
        if gz:
            name.with_name(name.name + ".gz").write_bytes(gzip.compress(name.read_bytes(), compresslevel=6))
            name.unlink()
    return out


def write_hdf5(samples: list[tuple[Path, int]], out: Path) -> Path:
    import h5py
    import numpy as np
    out.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(out, "w") as f:
        ds = f.create_dataset("images", (len(samples),), dtype=h5py.vlen_dtype(np.uint8))
        for i, (path, _) in enumerate(samples):
            ds[i] = np.frombuffer(path.read_bytes(), np.uint8)
        f.create_dataset("labels", data=np.array([lab for _, lab in samples], np.int64))
    return out


def write_recordio(samples: list[tuple[Path, int]], out: Path) -> Path:
    """``train.rec`` + ``train.idx`` as ``im2rec`` writes them (keys 0.., scalar float labels)."""
    spec = importlib.util.spec_from_file_location(
        "stoker_recordio_writer", Path(__file__).resolve().parents[1] / "tests" / "recordio_writer.py")
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    return writer.write_rec(out / "train.rec", [(float(label), path.read_bytes()) for path, label in samples])


WRITERS: dict[str, tuple[Callable[..., Path], str]] = {
    "list": (write_list, "list"),
    "webdataset": (write_tars, "webdataset"),
    "webdataset-gz": (lambda s, o: write_tars(s, o, gz=True), "webdataset"),
    "hf-parquet": (write_parquet, "hf"),
    "hf-arrow": (write_arrow, "hf"),
    "lmdb": (write_lmdb, "lmdb"),
    "tfrecord": (write_tfrecord, "tfrecord"),
    "tfrecord-gz": (lambda s, o: write_tfrecord(s, o, gz=True), "tfrecord"),
    "hdf5": (lambda s, o: write_hdf5(s, o.with_suffix(".h5")), "hdf5"),
    "recordio": (write_recordio, "recordio"),
}


def prepare(cache: Path, n: int) -> dict[str, tuple[Path, str]]:
    """Every format's copy of the images (written once, kept in CACHE_DIR): name -> (src, kind)."""
    folder = cached_imagenet_like(cache, n)
    samples = _samples(folder)
    sources = {"folder": (folder, "folder")}
    for name, (write, kind) in WRITERS.items():
        target = cache / "sources" / f"n{n}" / name
        marker = target.with_name(target.name + ".complete")
        try:
            if not marker.exists():
                shutil.rmtree(target, ignore_errors=True)
                target.with_suffix(".h5").unlink(missing_ok=True)
                path = write(samples, target)
                marker.write_text(str(path))
            sources[name] = (Path(marker.read_text()), kind)
        except ImportError as exc:
            print(f"skipping {name}: its writer library is missing ({exc.name}); "
                  "pip install 'stoker[test-formats]'", file=sys.stderr)
    return sources


def measure(sources: dict[str, tuple[Path, str]], work: Path, rounds: int, workers: int) -> dict[str, dict]:
    names = list(sources)
    pack_s: dict[str, list[float]] = {n: [] for n in names}
    cpu_s: dict[str, list[float]] = {n: [] for n in names}
    list_s: dict[str, list[float]] = {n: [] for n in names}
    packed: dict[str, int] = {}
    options = PackOptions(workers=workers)
    for r in range(rounds + 1):   # round 0 warms the page cache and imports; not counted
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            src, kind = sources[name]
            forget_decompressed()   # every run pays for its gzip decompression, as a fresh process would
            t1, c1 = time.perf_counter(), time.process_time()
            summary = pack(src, work / name, options=options, progress=False, overwrite=True, kind=kind)
            t2, c2 = time.perf_counter(), time.process_time()
            forget_decompressed()
            open_source(src, kind=kind)
            t3 = time.perf_counter()
            packed[name] = summary.packed
            if r:
                list_s[name].append(t3 - t2)
                pack_s[name].append(t2 - t1)
                cpu_s[name].append(c2 - c1)
    base = statistics.median(pack_s["folder"])
    base_cpu = statistics.median(cpu_s["folder"])
    return {n: {"images": packed[n], "pack_s": statistics.median(pack_s[n]), "list_s": statistics.median(list_s[n]),
                "images_per_s": packed[n] / statistics.median(pack_s[n]),
                "speed_vs_folder": base / statistics.median(pack_s[n]),
                "cpu_ms_per_image": 1000 * statistics.median(cpu_s[n]) / packed[n],
                "cpu_vs_folder": statistics.median(cpu_s[n]) / base_cpu} for n in names}


def table(results: dict[str, dict]) -> str:
    lines = ["| source | images | pack s (median) | listing s | images/s | speed vs folder | CPU ms/image | "
             "CPU vs folder |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['images']:,} | {r['pack_s']:.2f} | {r['list_s']:.3f} | "
                     f"{r['images_per_s']:,.0f} | {r['speed_vs_folder']:.2f}x | {r['cpu_ms_per_image']:.2f} | "
                     f"{r['cpu_vs_folder']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sources = prepare(args.cache, args.images)
    results = measure(sources, args.cache / "packed", args.rounds, args.workers)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
