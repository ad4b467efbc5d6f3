"""What is in a packed dataset (``stoker info``) and whether it is intact (``stoker verify``)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import codecs
from ._progress import Progress
from ._system import usable_cpus
from .errors import DatasetError, ImageError
from .integrity import check_shard
from .reader import CachedDataset, PackedDataset, open_dataset
from .shards import MANIFEST_NAME, SHARD_NAME_RE, read_manifest
from .storage import RemoteStorage, StorageBackend, as_storage
from .video import VIDEO_ENCODING, VIDEO_INDEX_COLUMN, VideoIndex, probe_video


def _stats(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"min": 0, "mean": 0, "median": 0, "max": 0}
    v = values.astype(np.float64)
    return {"min": float(v.min()), "mean": float(v.mean()), "median": float(np.median(v)), "max": float(v.max())}


@dataclass
class DatasetInfo:
    """Summary of a packed dataset: counts, classes, sizes, resolutions, encodings."""

    path: str
    samples: int
    shards: int
    total_bytes: int
    label_type: str
    classes: list[str] | None
    class_counts: dict[str, int]
    encodings: dict[str, int]
    height: dict[str, float]
    width: dict[str, float]
    sample_bytes: dict[str, float]
    extra_columns: dict[str, str]
    pack_options: dict[str, Any]

    def format(self) -> str:
        """Human-readable text for the terminal."""
        def px(d: dict[str, float]) -> str:
            return f"min {d['min']:.0f}, mean {d['mean']:.0f}, median {d['median']:.0f}, max {d['max']:.0f}"

        lines = [
            f"dataset     {self.path}",
            f"samples     {self.samples:,} in {self.shards} shard(s), {self.total_bytes / 2**20:,.1f} MiB",
            f"labels      {self.label_type}" + (f", {len(self.classes)} classes" if self.classes else ""),
            "encodings   " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.encodings.items())),
            f"height px   {px(self.height)}",
            f"width px    {px(self.width)}",
            f"sample size {px({k: v / 1024 for k, v in self.sample_bytes.items()})} KiB" if self.sample_bytes
            else f"sample size mean {self.total_bytes / max(self.samples, 1) / 1024:.0f} KiB (per-sample sizes are "
                 "in the shards: not downloaded for info)",
        ]
        if self.class_counts:
            counts = sorted(self.class_counts.items(), key=lambda kv: (-kv[1], kv[0]))
            shown = ", ".join(f"{k} {v:,}" for k, v in counts[:10])
            more = f" (+{len(counts) - 10} more)" if len(counts) > 10 else ""
            lines.append(f"per class   {shown}{more}")
        if self.extra_columns:
            lines.append("extras      " + ", ".join(f"{k}: {t}" for k, t in self.extra_columns.items()))
        if self.pack_options:
            opts = {k: v for k, v in self.pack_options.items() if k not in ("source", "source_listing_sha256")}
            lines.append("packed with " + ", ".join(f"{k}={v}" for k, v in opts.items()))
            if "source" in self.pack_options:
                lines.append(f"source      {self.pack_options['source']}")
        return "\n".join(lines)


def describe(path: str | Path | StorageBackend) -> DatasetInfo:
    """Counts, classes, resolution and size statistics of a packed dataset (reads only metadata
    columns, never decodes an image)."""
    with open_dataset(path) as ds:
        m = ds.manifest
        labels = ds.labels
        class_counts: dict[str, int] = {}
        if m.classes and labels.dtype.kind == "i":
            counts = np.bincount(labels[labels >= 0], minlength=len(m.classes))
            class_counts = {m.classes[i]: int(c) for i, c in enumerate(counts)}
        return DatasetInfo(
            path=ds.storage.location if isinstance(path, StorageBackend) else str(path), samples=len(ds),
            shards=len(m.shards), total_bytes=sum(s.bytes for s in m.shards),
            label_type=m.label_type, classes=m.classes, class_counts=class_counts,
            encodings=dict(Counter(ds.encodings.tolist())), height=_stats(ds.heights), width=_stats(ds.widths),
            sample_bytes={} if ds.sizes is None else _stats(ds.sizes), extra_columns=dict(m.extra_columns), pack_options=dict(m.pack_options))


@dataclass
class Problem:
    """One thing wrong with a dataset: where, what, and expected vs found when that applies."""

    where: str  # shard file, manifest, or "shard-00001.arrow row 17 (key)"
    what: str
    expected: str = ""
    found: str = ""

    def __str__(self) -> str:
        detail = f" (expected {self.expected}, found {self.found})" if self.expected or self.found else ""
        return f"{self.where}: {self.what}{detail}"


@dataclass
class VerifyReport:
    """Result of :func:`verify`. ``ok`` is False when any problem was found."""

    path: str
    shards_checked: int = 0
    samples_decoded: int = 0
    problems: list[Problem] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def format(self) -> str:
        lines = [str(p) for p in self.problems]
        lines += [f"{name}: shard file not listed in {MANIFEST_NAME} (ignored)" for name in self.unlisted]
        decoded = f", {self.samples_decoded:,} samples decoded" if self.samples_decoded else ""
        verdict = "OK" if self.ok else f"FAILED: {len(self.problems)} problem(s)"
        lines.append(f"{self.path}: {self.shards_checked} shard(s) checked{decoded}: {verdict}")
        return "\n".join(lines)


def _check_shards(storage: StorageBackend, report: VerifyReport, progress: bool = False) -> bool:
    """Checksums and structure of every listed shard; True when all are sound."""
    try:
        manifest = read_manifest(storage)
    except DatasetError as exc:
        report.problems.append(Problem(storage.join(MANIFEST_NAME), str(exc)))
        return False
    if isinstance(storage, RemoteStorage):  # shards are checked as downloaded into the (bounded) cache
        storage.open_cache(manifest.shards)
    listed = {s.file for s in manifest.shards}
    report.unlisted = [n for n in storage.list() if SHARD_NAME_RE.fullmatch(n) and n not in listed]
    with Progress("verify checksums", len(manifest.shards), unit="shard", enabled=progress) as bar:
        for info in manifest.shards:
            report.shards_checked += 1
            problem = check_shard(storage, info, manifest, checksum=True)
            if problem is not None:
                report.problems.append(Problem(info.file, problem.what, problem.expected, problem.found))
            bar.update()
    return not report.problems


def _check_video(ds: PackedDataset | CachedDataset, i: int, s: Any) -> Problem | None:
    """Decode every frame of a video sample and compare it with the index stored at pack time."""
    where = f"{s.shard} row {s.row} ({s.key})"
    try:
        limit = getattr(ds, "manifest", None) and ds.manifest.pack_options.get("max_pixels")
        found = probe_video(s.data, s.key, max_pixels=limit or codecs.MAX_PIXELS)
    except ImageError as exc:
        return Problem(where, f"does not decode: {exc.reason}")
    stored = VideoIndex.from_json(ds.extra(i, VIDEO_INDEX_COLUMN))
    if (found.pts.tolist(), found.keyframes.tolist()) != (stored.pts.tolist(), stored.keyframes.tolist()):
        return Problem(where, "its frames differ from its stored index (timestamps or keyframes)",
                       f"{stored.frames} frames", f"{found.frames} frames")
    if found.upright != (s.height, s.width):
        return Problem(where, "decodes to a size other than the stored one", f"{s.height}x{s.width}",
                       f"{found.upright[0]}x{found.upright[1]}")
    return None


def _decode_all(ds: PackedDataset | CachedDataset, report: VerifyReport, workers: int, progress: bool = False) -> None:
    label_maps = [c for c, t in ds.manifest.extra_columns.items() if t == "binary"]  # PNGs of class ids

    def check(i: int) -> Problem | None:
        s = ds.sample(i)
        if s.encoding == VIDEO_ENCODING:
            return _check_video(ds, i, s)
        try:
            rgb = codecs.decode_rgb(s.data, s.encoding, s.key, height=s.height, width=s.width)
        except ImageError as exc:
            return Problem(f"{s.shard} row {s.row} ({s.key})", f"does not decode: {exc.reason}")
        if rgb.shape[:2] != (s.height, s.width):  # crops are planned from the stored size
            return Problem(f"{s.shard} row {s.row} ({s.key})", "decodes to a size other than the stored one",
                           f"{s.height}x{s.width}", f"{rgb.shape[0]}x{rgb.shape[1]}")
        for column in label_maps:
            data = ds.extra(i, column)
            if data is None:
                continue
            try:
                ids = codecs.decode_label_map(data, s.key)
            except ImageError as exc:
                return Problem(f"{s.shard} row {s.row} ({s.key})", f"label map {column!r} does not decode: {exc.reason}")
            if ids.shape != (s.height, s.width):
                return Problem(f"{s.shard} row {s.row} ({s.key})", f"label map {column!r} is not the image's size",
                               f"{s.height}x{s.width}", f"{ids.shape[0]}x{ids.shape[1]}")
        return None

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stoker-verify") as pool, \
            Progress("verify decode", len(ds), enabled=progress) as bar:
        for problem in pool.map(check, range(len(ds)), chunksize=64):
            report.samples_decoded += 1
            if problem is not None:
                report.problems.append(problem)
                bar.set_postfix(problems=len(report.problems))
            bar.update()


def verify(path: str | Path | StorageBackend, *, decode: bool = False, workers: int | None = None,
           progress: bool = False) -> VerifyReport:
    """Check a packed dataset: manifest valid, every shard present with the manifest's size,
    SHA-256 and row count, and readable as Arrow; with ``decode`` also decode every sample.
    Reports every problem found (not just the first). ``progress``: a bar on a terminal, log lines
    (logger ``stoker.progress``) elsewhere."""
    storage = as_storage(path)
    report = VerifyReport(storage.location if isinstance(path, StorageBackend) else str(path))
    try:
        if _check_shards(storage, report, progress) and decode:
            with open_dataset(storage) as ds:
                _decode_all(ds, report, workers or usable_cpus(), progress)
    finally:
        if isinstance(storage, RemoteStorage):
            storage.close()  # the cache's download threads
    return report
