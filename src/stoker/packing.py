"""Pack a source into Arrow shards: validate, normalize, write; in parallel and resumable.

The pack loop: it lists the source, hands tasks of samples to worker threads (or Ray,
:mod:`stoker.ray_engine`) that run the per-sample work (:mod:`stoker.pack_work`, with the user's
function of :mod:`stoker.pack_map`), writes their rows in source order and keeps the journal
(:mod:`stoker.pack_journal`). Options: :mod:`stoker.pack_options`.

Each sample is checked and normalized on a worker thread (:func:`normalize`): a JPEG that
the loader's fast path can decode as is (RGB or grey, EXIF-upright, no resize) keeps its
bytes after a strict decode check; everything else is decoded by Pillow, turned upright RGB,
optionally shrunk, and re-encoded as JPEG, or stored as raw pixels when tiny.

Results are consumed in source order, so the shards are the same for any worker count.
After every finished shard one fsynced line goes to ``OUT/.stoker-pack.jsonl`` (the
journal); ``resume=True`` checks it against the shards on disk and carries on from the
recorded source position, giving exactly what an uninterrupted run gives. The manifest is
written last, then the journal is removed. Every file in OUT is written through
:mod:`stoker.storage`; a URL no backend serves is refused before anything is written.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from . import codecs, pack_journal as journal, video
from ._progress import Progress
from ._system import usable_cpus
from .errors import (OVERWRITE, RESUME, ConfigError, CorruptImageError, CorruptVideoError, DecompressionBombError,
                     ImageError, MapFunctionError, OutputError, SourceError, StokerError, UnsupportedImageError,
                     UnsupportedVideoError)
from .pack_journal import JOURNAL_NAME, LOCK_NAME, SKIPPED_NAME, PackState
from .pack_map import PackSample
from .pack_options import PackOptions
from .pack_work import MIN_PSNR_DB, Normalized, Work, _process_task, _Task, normalize, normalize_video
from .shards import Manifest, ShardWriter, read_manifest, write_manifest
from .sources import Source, SourceItem, open_source, unencodable_keys
from .sources.base import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, inside
from .storage import StorageBackend as Storage, as_storage, url_scheme
from .video import VIDEO_INDEX_COLUMN

__all__ = ["JOURNAL_NAME", "LOCK_NAME", "MIN_PSNR_DB", "SKIPPED_NAME", "Normalized", "PackOptions", "PackSample",
           "PackSummary", "normalize", "normalize_video", "pack"]

#: Seconds one task (a few samples) may take in a worker before the pack gives up on it.
TASK_TIMEOUT_S = 600.0
#: Samples per task handed to a worker thread: amortizes the per-task dispatch and result handling.
TASK_SAMPLES = 8
_ERROR_TYPES = {cls.__name__: cls for cls in (CorruptImageError, UnsupportedImageError, CorruptVideoError,
                                               UnsupportedVideoError, DecompressionBombError, ImageError,
                                               MapFunctionError)}
@dataclass
class PackSummary:
    """What a pack did. ``bytes_in``/``bytes_out`` count packed samples only (source vs stored)."""

    packed: int
    skipped: int
    bytes_in: int
    bytes_out: int
    seconds: float
    shards: int
    out: Path | str  # the dataset folder, or its URL
    already_complete: bool = False   # a resume found the pack finished: nothing was packed this time
    noun: str = "images"             # what the samples are: "images" or "videos"
    resumed: int = 0                 # of ``packed``, the samples an interrupted run had packed before
    dropped: int = 0                 # source samples the pack function returned None for

    def __str__(self) -> str:
        return self.format()

    def format(self) -> str:
        """One line for people: counts, shards, bytes in and out, time and images/s."""
        if self.already_complete:
            skipped = f" ({self.skipped:,} skipped)" if self.skipped else ""
            return (f"{self.out} already holds a complete pack of {self.packed:,} {self.noun}{skipped} in {self.shards} "
                    f"shard(s), {_mb(self.bytes_out)}: nothing to do")
        # the rate of this run's work: a resumed run did not pack what the interrupted one had
        rate = f", {(self.packed - self.resumed) / self.seconds:,.0f} {self.noun}/s" if self.seconds > 0 else ""
        skipped = f" ({self.skipped:,} skipped, see {self.out}/{SKIPPED_NAME})" if self.skipped else ""
        resumed = f" ({self.packed - self.resumed:,} now, {self.resumed:,} before the resume)" if self.resumed else ""
        if self.dropped:
            skipped += f" ({self.dropped:,} dropped by the pack function)"
        return (f"packed {self.packed:,} {self.noun}{resumed}{skipped} into {self.shards} shard(s) in {self.out}: "
                f"{_mb(self.bytes_in)} in -> {_mb(self.bytes_out)} out, {self.seconds:.1f} s{rate}")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"



# ---------------------------------------------------------------- parallel, in order

def _tasks(items: list[SourceItem], start: int, per_task: int) -> Iterator[_Task]:
    for lo in range(start, len(items), per_task):
        yield items[lo:lo + per_task]


def _run_in_order(tasks: Iterator[_Task], work: Work, workers: int) -> Iterator[list[tuple]]:
    """Yield each task's results in task order; at most ``4 * workers`` tasks in flight.

    Threads, not processes: file reads, libjpeg-turbo and Pillow's decode, resize and encode
    release the GIL, so threads scale as far as the cores do (measured in docs/packing.md) with
    no start-up cost, no bytes piped between processes, and no ``__main__`` guard for callers.
    """
    if workers == 1:
        for task in tasks:
            yield _process_task(task, work)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="stoker-pack")
    window: deque[Future] = deque()
    try:
        for task in tasks:
            window.append(pool.submit(_process_task, task, work))
            if len(window) >= 4 * workers:
                yield _result(window.popleft())
        while window:
            yield _result(window.popleft())
    finally:
        # On Ctrl-C or an error: queued tasks are cancelled; running ones finish their few samples.
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Future) -> list[tuple]:
    try:
        return future.result(timeout=TASK_TIMEOUT_S)
    except FutureTimeout:
        raise StokerError.spelled(f"a pack worker spent more than {TASK_TIMEOUT_S:.0f} s on {TASK_SAMPLES} samples "
                                  "and looks stuck (storage hung?); rerun with {resume}", {"resume": RESUME}) from None

def _finished_summary(storage: Storage, pack_options: dict[str, Any], started: float,
                      fingerprint: str) -> PackSummary:
    manifest = read_manifest(storage)
    stored = dict(manifest.pack_options)
    listed = stored.pop(journal.LISTING_KEY, None)   # absent from packs made before it was recorded
    if stored != pack_options:
        raise ConfigError.spelled(
            f"{storage.location} already holds a finished pack made with other options or another "
            f"source ({journal.changes(stored, pack_options)}); pack with the same options to keep it, "
            "or pass {overwrite} to re-pack", {"overwrite": OVERWRITE})
    if listed is not None and listed != fingerprint:
        raise ConfigError.spelled(
            f"{storage.location} already holds a finished pack of {pack_options['source']} whose listing (file "
            "names, labels, extras) has changed since it was packed; pass {overwrite} to re-pack it, or choose "
            "another output directory", {"overwrite": OVERWRITE})
    journal.remove(storage, [JOURNAL_NAME])
    try:
        skipped = len(storage.read_bytes(SKIPPED_NAME).splitlines())
    except FileNotFoundError:
        skipped = 0
    return PackSummary(manifest.num_samples, skipped, 0, sum(s.bytes for s in manifest.shards),
                       time.perf_counter() - started, len(manifest.shards), _out_location(storage),
                       already_complete=True, noun=_noun(pack_options))


# ---------------------------------------------------------------- the pack loop

class _Packer:
    """Consumes results in source order and rolls shards over at ``options.shard_size``."""

    def __init__(self, storage: Storage, source: Source, options: PackOptions, state: PackState) -> None:
        self.storage, self.source, self.options, self.state = storage, source, options, state
        self.pending: list[dict[str, str]] = []   # skips since the last journal line
        self.writer = self._new_writer()

    def _new_writer(self) -> ShardWriter:
        return ShardWriter(self.storage, len(self.state.shards), label_type=self.source.label_type,
                           extra_columns=self.source.extra_columns)

    def take(self, pos: int, result: tuple) -> None:
        item, st = self.source.items[pos], self.state
        if result[0]:
            _, n_in, rows = result
            for key, image, encoding, height, width, label, extras in rows:
                self.writer.add(key, image, encoding, height, width, label, extras)
                st.bytes_out += len(image)
            st.packed += len(rows)
            st.dropped += not rows
            st.bytes_in += n_in
        else:
            _, error_type, reason = result
            if self.options.on_error == "fail":
                raise _ERROR_TYPES[error_type](item.where(), reason)
            skip = {"key": item.key, "path": item.where(), "reason": reason}
            st.skipped.append(skip)
            self.pending.append(skip)
        if self.writer.nbytes >= self.options.shard_size:
            self.close_shard(pos + 1)

    def close_shard(self, consumed: int) -> None:
        st = self.state
        info = self.writer.finish()
        st.shards.append(info)
        st.consumed = consumed
        journal.append_line(self.storage, {
            "shard": asdict(info), "consumed": consumed, "packed": st.packed, "bytes_in": st.bytes_in,
            "bytes_out": st.bytes_out, "skipped": self.pending, **({"dropped": st.dropped} if st.dropped else {})})
        self.pending = []
        self.writer = self._new_writer()


def pack(src: str | Path | Source, out: str | Path | Storage, *, options: PackOptions | None = None,
         resume: bool = False, progress: bool = True, overwrite: bool = False,
         **source_options: Any) -> PackSummary:
    """Pack ``src`` (see :func:`stoker.sources.open_source`) into a dataset directory ``out``.

    ``out`` may be a URL (``s3://bucket/ds``, any fsspec URL) or a Storage: each shard is uploaded
    whole once finished, the manifest last, so a reader never takes a half-written pack for done.

    Bad files are skipped and listed in ``out/skipped.jsonl`` (or, with ``on_error="fail"``,
    the first raises its ImageError). ``resume=True`` finishes an interrupted pack exactly as
    an uninterrupted run would have; ``overwrite=True`` replaces an existing pack. Raises
    SourceError, ConfigError, ImageError.
    """
    started = time.perf_counter()
    options = options or PackOptions()
    from .spelling import pack_keywords
    pack_keywords(source_options, open_source, PackOptions)  # max_side= is options=PackOptions(max_side=)
    if resume and overwrite:
        raise ConfigError.spelled("{resume} and {overwrite} contradict each other; pass one of them",
                                  {"resume": RESUME, "overwrite": OVERWRITE})
    if options.engine == "ray":  # before anything is written: a missing extra is named at once
        from .ray_engine import require_ray
        require_ray()
    storage = as_storage(out)  # before listing: a URL no backend serves is refused at once
    _refuse_out_inside_src(src, storage)
    codecs.quiet_decoder_messages()  # each bad file is reported in skipped.jsonl, not by libtiff on stderr
    source = src if isinstance(src, Source) else open_source(src, **source_options)
    kept, unnamed = unencodable_keys(source.items)
    if unnamed:  # before the fingerprint: a resume lists (and leaves out) the same files
        source = replace(source, items=kept, skipped=source.skipped + unnamed)
    if source.skipped and options.on_error == "fail":
        first = source.skipped[0]
        raise CorruptImageError(first["path"], first["reason"])
    source, options = _resolve_samples(source, options)
    if options.map is not None and any(item.label_maps for item in source.items):
        raise ConfigError(f"{source.description} has label maps (a mask per image), which a pack function's "
                          "changes to the pixels would not follow; pack it without map=")
    pack_options = {**options.output_options(), "source": source.description, "source_kind": source.kind}
    header = {"format": "stoker-pack-journal", "items": len(source.items),
              "fingerprint": journal.source_fingerprint(source), "pack_options": pack_options}
    try:
        with journal.locked_out(storage):
            state = journal.prepare_out(storage, header, resume, overwrite)
            if state is None:
                return _finished_summary(storage, pack_options, started, header["fingerprint"])
            state.fingerprint = header["fingerprint"]
            return _pack_into(storage, source, options, state, pack_options, started, progress)
    except OSError as exc:
        if isinstance(exc, StokerError):
            raise
        # sources' read errors are skips, so an OSError here is OUT's: its writes, its folder
        raise OutputError(f"cannot write {storage.location}: {exc.strerror or exc}"
                          f"{f' ({exc.filename})' if exc.filename else ''}; "
                          f"{_OUTPUT_FIX.get(exc.errno, 'fix the output directory')}, then run the same "
                          "pack with resume=True (--resume): finished shards are kept",
                          path=storage.location, errno=exc.errno) from exc


def _resolve_samples(source: Source, options: PackOptions) -> tuple[Source, PackOptions]:
    """Decide whether the source's samples are videos (``samples="auto"``): yes when its keys end like
    video files, or, for keys without a file ending (a Hugging Face row), when the first sample's bytes
    start like a video container. A video pack stores each video's index in the ``video_index`` column."""
    samples = options.samples
    if samples == "auto":
        endings = {os.path.splitext(item.key)[1].lower() for item in source.items}
        if endings & VIDEO_EXTENSIONS:
            samples = "video"
        elif source.items and not endings & IMAGE_EXTENSIONS:
            try:
                samples = "video" if video.looks_like_video(source.items[0].read()[:16]) else "image"
            except OSError:
                samples = "image"   # that sample is skipped with its reason when packed
        else:
            samples = "image"
    if samples == "video":
        video.require_av()   # before anything is written: a missing extra is named at once
        if VIDEO_INDEX_COLUMN in source.extra_columns:
            raise SourceError(f"{source.description} has a column named {VIDEO_INDEX_COLUMN!r}, which a video pack "
                              "writes itself; rename that column", path=source.root)
        source = replace(source, extra_columns={**source.extra_columns, VIDEO_INDEX_COLUMN: "string"})
    return source, replace(options, samples=samples)


_OUTPUT_FIX = {errno.ENOSPC: "free some disk space (or choose an output directory on a disk with room)",
               errno.EDQUOT: "raise your disk quota or free some space",
               errno.EROFS: "the file system is read-only: choose a writable output directory",
               errno.EACCES: "make the output directory writable, or choose another",
               errno.EPERM: "make the output directory writable, or choose another"}


def _pack_into(storage: Storage, source: Source, options: PackOptions, state: PackState,
               pack_options: dict[str, Any], started: float, progress: bool) -> PackSummary:
    resumed = state.packed   # already in finished shards (a resumed pack)
    packer = _Packer(storage, source, options, state)
    remaining = len(source.items) - state.consumed
    workers = max(1, min(options.workers or usable_cpus(), -(-remaining // TASK_SAMPLES)))
    bar = Progress("pack", len(source.items), initial=state.consumed, enabled=progress)
    pos = state.consumed
    work = Work(options, source.label_type, len(source.classes or ()), dict(source.extra_columns))
    if options.engine == "ray":
        from .ray_engine import RAY_TASK_SAMPLES, run_on_ray

        tasks = ([item.portable() for item in task] for task in _tasks(source.items, pos, RAY_TASK_SAMPLES))
        stream = run_on_ray(_process_task, tasks, work, address=options.address, timeout=TASK_TIMEOUT_S)
    else:
        stream = _run_in_order(_tasks(source.items, pos, TASK_SAMPLES), work, workers)
    try:
        for results in stream:
            for result in results:
                packer.take(pos, result)
                pos += 1
            bar.update(len(results))
            if packer.pending:
                bar.set_postfix(skipped=len(state.skipped))
        if packer.writer.rows:
            packer.close_shard(pos)
    except BaseException:
        packer.writer.abort()
        raise
    finally:
        stream.close()  # stops the workers now, not when the traceback is collected
        bar.close()
    return replace(_finish(storage, source, state, pack_options, started), resumed=resumed)


def _out_location(storage: Storage) -> Path | str:
    return Path(storage.location) if storage.in_place else storage.location


def _refuse_out_inside_src(src: str | Path | Source, storage: Storage) -> None:
    """A dataset written inside the folder it packs would be listed by the next pack of that
    folder (a class ``packed`` shifting every label, or its shards as images), and a killed
    pack there could not resume: refuse it. A list or table is not walked, so OUT may sit
    beside it; object storage is never inside a local folder."""
    if isinstance(src, Source) or isinstance(src, (list, tuple)) or not storage.in_place or url_scheme(src):
        return
    out = storage.location
    folder = os.path.realpath(Path(src).expanduser())
    target = os.path.realpath(Path(out).expanduser())
    if os.path.isdir(folder) and inside(Path(folder), target):
        raise SourceError(f"OUT {out} is inside the source folder {src}: the next pack of that folder would "
                          "list the packed dataset as data (an extra class, every label shifted); write OUT "
                          "outside the source folder", path=src)


def _finish(storage: Storage, source: Source, state: PackState, pack_options: dict[str, Any],
            started: float) -> PackSummary:
    """skipped.jsonl, then the manifest (last), then drop the journal."""
    skipped = source.skipped + state.skipped   # refused while listing, then while packing
    lines = "".join(json.dumps(s) + "\n" for s in skipped)
    storage.write_atomic(SKIPPED_NAME, lines.encode())
    if state.packed == 0 and state.dropped == len(source.items) and not skipped:
        raise SourceError(f"the pack function (map=) dropped all {state.dropped} samples of {source.description}: "
                          "nothing to pack; return the sample (or samples) to keep", path=source.root)
    if state.packed == 0:
        raise SourceError(f"none of the {len(source.items) + len(source.skipped)} images in {source.description} "
                          f"could be packed; the reasons are in {storage.join(SKIPPED_NAME)}", path=source.root)
    manifest = Manifest(num_samples=state.packed, shards=state.shards, classes=source.classes,
                        label_type=source.label_type, extra_columns=source.extra_columns,
                        pack_options={**pack_options, journal.LISTING_KEY: state.fingerprint})
    write_manifest(storage, manifest)
    journal.remove(storage, [JOURNAL_NAME])
    return PackSummary(state.packed, len(skipped), state.bytes_in, state.bytes_out,
                       time.perf_counter() - started, len(state.shards), _out_location(storage),
                       noun=_noun(pack_options), dropped=state.dropped)


def _noun(pack_options: dict[str, Any]) -> str:
    return "videos" if pack_options.get("samples") == "video" else "images"
