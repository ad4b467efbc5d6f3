"""Bit-flip fuzz of packed datasets: one random bit flipped in a shard's non-image bytes, then every
layer that reads a dataset is run on the damaged copy, each flip in a child process (a segfault or
a hang is counted, never hides the rest of the run).

    python benchmarks/fuzz_bitflips.py                 # 300 flips, seed 0
    python benchmarks/fuzz_bitflips.py --flips 500 --seed 1 --json flips.json

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

def run_flips(pristine: Path, flips: list, work: Path) -> list[dict]:
    """Feed flips to a child one at a time; a child that dies or hangs marks that flip and a
    fresh child takes the rest."""
    results: list[dict] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                                      os.environ.get("PYTHONPATH")]))}
    while len(results) < len(flips):
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(pristine), str(work)], env=env,
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flips", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every flip's per-layer outcome here")
    parser.add_argument("--legacy-manifest", action="store_true",
                        help="drop the small-columns checksums from the manifest (as written before they existed)")
    args = parser.parse_args()
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
