"""What checking a shard at open time costs: Arrow's own validation, targeted offset checks, and
the small-columns checksum, against opening without any of them.

    python benchmarks/bench_open.py                       # one 256 MiB shard of ~100 KB samples
    python benchmarks/bench_open.py --rows 20000 --sample-bytes 12000

The shard is written by stoker's own ShardWriter (keys like ImageNet paths, int64 labels, random
bytes as images: validation never reads image bytes, so their content does not matter). Prints the
median of ``--rounds`` runs of each check, in milliseconds for the shard and microseconds a row.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa


def write_shard(folder: Path, rows: int, sample_bytes: int) -> Path:
    from stoker.shards import ShardWriter

    rng = np.random.default_rng(0)
    blob = rng.integers(0, 256, sample_bytes * 2, dtype=np.uint8).tobytes()
    writer = ShardWriter(folder, 0)
    for i in range(rows):
        size = int(sample_bytes * (0.5 + rng.random()))
        writer.add(f"train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG", blob[:size], "jpeg",
                   int(rng.integers(200, 500)), int(rng.integers(200, 500)), i % 1000)
    writer.finish()
    return folder / "shard-00000.arrow"


def targeted(batches: list[pa.RecordBatch]) -> None:
    """Hand-written alternative to validate(full=True): offsets of the binary/string columns
    monotone and inside their data buffer, dictionary indices inside the dictionary."""
    for batch in batches:
        for column in batch.columns:
            if pa.types.is_dictionary(column.type):
                idx = np.frombuffer(column.indices.buffers()[1], np.int8)[:len(column)]
                if len(idx) and (idx.min() < 0 or idx.max() >= len(column.dictionary)):
                    raise ValueError("dictionary index out of range")
            elif pa.types.is_large_binary(column.type) or pa.types.is_string(column.type):
                bufs = column.buffers()
                off = np.frombuffer(bufs[1], np.int64 if pa.types.is_large_binary(column.type) else np.int32)
                off = off[:len(column) + 1]
                if len(off) and (off[0] < 0 or (np.diff(off) < 0).any() or off[-1] > bufs[2].size):
                    raise ValueError("bad offsets")


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from stoker.shards import columns_digest

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2400)
    parser.add_argument("--sample-bytes", type=int, default=110_000)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stoker-open-") as tmp:
        path = write_shard(Path(tmp), args.rows, args.sample_bytes)

        def open_only() -> list[pa.RecordBatch]:
            with pa.memory_map(str(path), "r") as mm:
                reader = pa.ipc.open_file(mm)
                return [reader.get_batch(k) for k in range(reader.num_record_batches)]

        batches = open_only()
        checks = {
            "open (footer + batches, no check)": open_only,
            "validate()": lambda: [b.validate() for b in batches],
            "validate(full=True)": lambda: [b.validate(full=True) for b in batches],
            "targeted offset/index checks (numpy)": lambda: targeted(batches),
            "columns checksum (SHA-256 of small columns)": lambda: columns_digest(batches),
        }
        print(f"shard: {args.rows} rows, {len(batches)} record batches, {path.stat().st_size / 2**20:.0f} MiB")
        for name, fn in checks.items():
            seconds = timed(fn, args.rounds)
            print(f"{name:46s} {seconds * 1e3:8.3f} ms  {seconds / args.rows * 1e6:7.3f} us/row")


if __name__ == "__main__":
    main()
