"""``stoker`` command line: thin wrappers over the library (synth, pack, info, verify, stage, bench, doctor, demo).

Errors print their command-line spelling (flags, not Python arguments). Long commands report progress:
a bar on a terminal, a log line every few seconds otherwise (batch jobs, CI logs); ``--quiet`` drops both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from . import __version__
from ._system import parse_size as _parse_size
from .errors import ConfigError, StokerError


def parse_size(text: str) -> int:
    """'256MiB', '64M', '1g', '1048576' -> bytes (binary multiples)."""
    try:
        return _parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _integer(text: str, least: int, expected: str) -> int:
    """`text` as an int >= `least`; otherwise argparse's error names what was expected (not this function)."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def _non_negative(text: str) -> int:
    return _integer(text, 0, "an integer >= 0")


def _core_counts(text: str) -> tuple[int, ...]:
    """`--cores 16,8` -> (16, 8); argparse names the flag in the error."""
    from .tools.cores import parse_cores

    try:
        return parse_cores(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--cores {text}: ")) from None


def _at_cores(counts: Sequence[int] | None) -> list[int | None]:
    """The core counts a command runs at: each of `--cores` in turn, checked before the first runs (a count
    beyond this machine's CPUs fails now, not after the others ran), or [None]: unpinned."""
    if not counts:
        return [None]
    from .tools.cores import check_cores

    check_cores(counts)
    return list(counts)


@contextlib.contextmanager
def _quiet_native_output() -> Iterator[None]:
    """Keep decoder chatter off the terminal while packing a messy folder.

    libtiff and friends print to file descriptor 2 by the hundred on odd files, and Pillow warns
    about them; every skipped file's reason is in skipped.jsonl anyway. File descriptor 2 goes to
    /dev/null while Python's own stderr (progress bar, errors) keeps the real terminal. Only the
    CLI does this: it owns its process; the library never touches process-wide state."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real stderr (embedded, captured): leave it
        yield
        return
    real = sys.stderr
    devnull = os.open(os.devnull, os.O_WRONLY)
    sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1, errors="backslashreplace")
    os.dup2(devnull, 2)
    pil_logger = logging.getLogger("PIL")
    pil_level = pil_logger.level
    pil_logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        pil_logger.setLevel(pil_level)
        sys.stderr.flush()
        os.dup2(saved, 2)
        for fd in (saved, devnull):
            os.close(fd)
        quiet, sys.stderr = sys.stderr, real
        quiet.close()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record: while decoder chatter is hidden,
    file descriptor 2 points at /dev/null and ``sys.stderr`` at the real terminal."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _setup_logging(quiet: bool) -> logging.Handler:
    """stoker's log lines (progress, skipped samples) on stderr; with --quiet only warnings and errors."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s stoker: %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("stoker")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    return handler


def _cmd_synth(args: argparse.Namespace) -> int:
    if args.videos:
        from .tools.synth_video import VideoStyle, make_kinetics_like

        per_class = -(-args.videos // args.classes)
        result = make_kinetics_like(args.out, per_class, classes=args.classes, seed=args.seed,
                                    style=VideoStyle(codec=args.codec, keyframe_seconds=args.keyframe_seconds))
        print(f"wrote {per_class * args.classes:,} Kinetics-like {args.codec} videos (10 s, 25 fps, 256x340, "
              f"{args.classes} classes) in class folders: {result}\n"
              f"next: stoker pack {result} {Path(args.out).name}-packed")
        return 0
    from .tools.synth import make_imagenet_like

    result = make_imagenet_like(args.out, args.images, classes=args.classes, seed=args.seed, workers=args.workers,
                                layout=args.layout, progress=not args.quiet)
    what = "an ImageFolder tree" if args.layout == "folder" else "a file list"
    print(f"wrote {args.images:,} ImageNet-like JPEGs ({args.classes} classes) as {what}: {result}\n"
          f"next: stoker pack {result} {Path(args.out).name}-packed")
    return 0


def _column_list(text: str) -> list[str]:
    return [c.strip() for c in text.split(",") if c.strip()]


def _pack_function(spec: str | None) -> Any:
    """`--map MODULE:FUNCTION` or `--map path/to/file.py:FUNCTION`: the function, a module imported as
    Python would (the current folder first), a file loaded from its path. Every wrong spelling is a
    one-line ConfigError naming the flag and the fix."""
    if spec is None:
        return None
    import importlib
    import importlib.util

    where, _, name = spec.rpartition(":")
    if not where or not name or not name.isidentifier():
        raise ConfigError(f"--map {spec}: expected MODULE:FUNCTION or FILE.py:FUNCTION, e.g. --map mypack:crop_faces "
                          f"or --map ./mypack.py:crop_faces")
    is_file = where.endswith(".py") or os.sep in where or (os.altsep is not None and os.altsep in where)
    try:
        if is_file:
            path = Path(where).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"--map {spec}: no file {path}; give the path of the .py file that defines {name}")
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            if loaded is None or loaded.loader is None:
                raise ConfigError(f"--map {spec}: {path} is not a Python file Python can load")
            module = importlib.util.module_from_spec(loaded)
            sys.modules[path.stem] = module   # its functions pickle by name into pack workers
            sys.path.insert(0, str(path.parent))
            try:
                loaded.loader.exec_module(module)
            finally:
                sys.path.remove(str(path.parent))
        else:
            sys.path.insert(0, os.getcwd())
            try:
                module = importlib.import_module(where)
            finally:
                sys.path.remove(os.getcwd())
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(f"--map {spec}: cannot import {where} ({exc}); run from the folder that holds "
                          f"{where.replace('.', os.sep)}.py, give its path (--map path/to/{where}.py:{name}), "
                          f"or install it") from None
    except Exception as exc:   # the user's module failed as it ran (a SyntaxError, its own exception)
        raise ConfigError(f"--map {spec}: loading {where} raised {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"--map {spec}: {where} has no function {name}")
    if not callable(fn):
        raise ConfigError(f"--map {spec}: {where}.{name} is a {type(fn).__name__}, not a function")
    return fn


def _cmd_pack(args: argparse.Namespace) -> int:
    from .packing import PackOptions, pack

    options = PackOptions(max_side=args.max_side, encoding=args.encoding, jpeg_quality=args.jpeg_quality,
                          raw_below=args.raw_below, shard_size=args.shard_size, workers=args.workers,
                          on_error=args.on_error, max_pixels=args.max_pixels, engine=args.engine,
                          address=args.address, samples=args.samples, video_keyframes=args.video_keyframes,
                          video_crf=args.video_crf, map=_pack_function(args.map),
                          map_fingerprint=args.map_fingerprint)
    source_options = {"kind": args.kind, "label_column": None if args.no_labels else args.label_column,
                      "path_column": args.path_column, "image_column": args.image_column, "root": args.root,
                      "mask_column": args.mask_column, "columns": args.columns}
    src = args.src[0] if len(args.src) == 1 else list(args.src)   # several: a list of WebDataset shards
    with contextlib.nullcontext() if args.verbose else _quiet_native_output():
        summary = pack(src, args.out, options=options, resume=args.resume, overwrite=args.overwrite,
                       progress=not (args.no_progress or args.quiet), **source_options)
    print(summary.format())
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .audit import describe

    info = describe(args.dataset)
    print(json.dumps(info.__dict__, indent=1) if args.json else info.format())
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from .audit import verify

    report = verify(args.dataset, decode=args.decode, workers=args.workers, progress=not args.quiet)
    print(report.format())
    return 0 if report.ok else 1


def _cmd_stage(args: argparse.Namespace) -> int:
    from . import staging

    if args.remove:
        for dest in args.paths:
            staging.remove(dest)
            print(f"removed {dest}")
        return 0
    if args.sweep:
        for root in args.paths:
            for gone in staging.sweep(root):
                print(f"removed abandoned copy {gone}")
        return 0
    if len(args.paths) != 2:
        raise ConfigError("usage: stoker stage DATASET DEST (or --remove DEST, --sweep ROOT)")
    started = time.perf_counter()
    with staging.stage(args.paths[0], args.paths[1]) as copy:
        what = "reused the finished copy in" if copy.reused else "copied and verified into"
        print(f"{what} {copy.path} in {time.perf_counter() - started:.1f} s; pass that path to stoker.Loader "
              f"(remove it with `stoker stage --remove {copy.path}`)")
    return 0


#: `stoker bench` flags of the video clip bench, which runs from the project's benchmarks/ folder
_VIDEO_FLAGS = ("video", "videos", "clips", "video_keyframes")


def _cmd_bench(args: argparse.Namespace) -> int:
    from .tools.bench import format_cores, format_table, run_bench

    given = [f"--{name.replace('_', '-')}" for name in _VIDEO_FLAGS if getattr(args, name, None)]
    if given:
        raise ConfigError(f"{given[0]}: the video clip bench is not part of stoker bench; from a checkout of the "
                          "project run python benchmarks/bench_video.py CACHE_DIR [--data VIDEOS|PACKED] [--videos N] "
                          "[--clips N] [--rounds N] [--threads N] [--keyframes SECONDS]")
    models = None if args.models is None else tuple(m.strip() for m in args.models.split(",") if m.strip())
    results = [run_bench(args.data, images=args.images, batch_size=args.batch_size or 256, workers=args.workers,
                         rounds=args.rounds or 3, out_dir=args.out, device=args.device, models=models,
                         steps=args.steps, warmup_steps=args.warmup_steps, recipe=args.recipe,
                         progress=not args.quiet, cores=cores,
                         **({"pipelines": tuple(args.pipelines.split(","))} if args.pipelines else {}))
               for cores in _at_cores(args.cores)]
    if args.json:
        print(json.dumps(results[0].to_json() if not args.cores else
                         {"cores": list(args.cores), "runs": [r.to_json() for r in results]}, indent=1))
    else:
        print(format_table(results[0]) if len(results) == 1 else format_cores(results))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .tools.doctor import format_cores, run_doctor

    reports = [run_doctor(args.path, batch_size=args.batch_size, steps=args.steps, threads=args.threads,
                          transforms=args.transforms, size=args.size, model=args.model, device=args.device,
                          progress=not args.json, decode=args.decode, cores=cores) for cores in _at_cores(args.cores)]
    if args.json:
        print(json.dumps(reports[0].as_dict() if not args.cores else
                         {"cores": list(args.cores), "runs": [r.as_dict() for r in reports]}, indent=1))
    else:
        print(reports[0].format() if len(reports) == 1 else format_cores(reports))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    sizes = {k: v for k, v in (("batch_size", args.batch_size), ("steps", args.steps)) if v is not None}
    if args.video:
        from .tools.demo_video import VideoDemoSetup, run_video_demo

        setup = VideoDemoSetup(videos=args.videos, rounds=args.rounds, **sizes)
        run_video_demo(args.out or Path("stoker-demo-video"), setup, device=args.device)
        return 0
    from .tools.demo import run_demo

    run_demo(args.out or Path("stoker-demo"), images=args.images, device=args.device, **sizes)
    return 0


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress (bar or log lines) and no info log lines; warnings and errors still show")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """`stoker bench`'s options on `p` (the project's benchmarks/ scripts that add other loaders take the same)."""
    p.add_argument("--data", type=Path, default=None, help="image folder to use (default: generate ImageNet-like)")
    p.add_argument("--images", type=_positive, default=None,
                   help="images to generate (default 2000; 5000 with --device cuda)")
    p.add_argument("--batch-size", type=_positive, default=None, help="default 256")
    p.add_argument("--workers", type=_positive, default=None,
                   help="CPU cores each pipeline may use (default: every usable core, or N of --cores N)")
    p.add_argument("--cores", type=_core_counts, default=None, metavar="N[,N...]",
                   help="run pinned to N cores, as a machine with N cores per GPU would (this process and every "
                   "process it starts; thread counts follow N); several (16,8) run in turn, a section each")
    p.add_argument("--rounds", type=_positive, default=None, help="timed rounds after one warm-up (median; default 3)")
    p.add_argument("--pipelines", default=None, help="comma-separated subset, e.g. baseline,stoker-train")
    p.add_argument("--recipe", choices=("basic", "randaug", "deit"), default="basic",
                   help="augmentation recipe both sides run: basic (crop+flip), randaug (+RandAugment 2/9), "
                   "deit (+RandomErasing 0.25, Mixup/CutMix)")
    p.add_argument("--device", default="cpu",
                   help="cpu: the loaders on the CPU (default); cuda or cuda:N: loaders into GPU memory, normalized, "
                   "and training fed by each loader against synthetic data")
    p.add_argument("--models", default=None, metavar="MODELS",
                   help="with --device cuda: comma-separated torchvision model names or module:callable "
                   "(default resnet50,resnet18)")
    p.add_argument("--steps", type=_positive, default=None,
                   help="with --device cuda: timed training steps per round (default 100)")
    p.add_argument("--warmup-steps", type=_non_negative, default=None,
                   help="with --device cuda: untimed training steps first (default 10)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where to write JSON/markdown/PNG")
    for flag in _VIDEO_FLAGS:   # refused with the script that runs them now
        p.add_argument(f"--{flag.replace('_', '-')}", default=None, nargs="?", const=True, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    _add_quiet(p)
    p.set_defaults(func=_cmd_bench, command="bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stoker", description="Keep the GPU fed: pack images into shards, "
                                     "load them fast.")
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from .sources import KINDS

    p = sub.add_parser("synth", help="write ImageNet-like sample JPEGs to try the other commands on")
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--images", type=_positive, default=1000, metavar="N", help="how many images (default 1000)")
    p.add_argument("--classes", type=_positive, default=10, help="number of classes (default 10)")
    p.add_argument("--layout", default="folder", choices=["folder", "list"],
                   help="folder: OUT/class_XXX/*.jpg (default); list: OUT/images/*.jpg plus OUT/train.txt")
    p.add_argument("--seed", type=int, default=0, help="same seed, same files (default 0)")
    p.add_argument("--workers", type=_positive, default=None, help="worker processes (default: usable CPUs)")
    p.add_argument("--videos", type=_positive, default=None, metavar="N",
                   help="write N Kinetics-like videos (10 s, 25 fps, 256x340, motion by class) instead of JPEGs, "
                        "in class folders (pip install 'stoker[video]')")
    p.add_argument("--codec", default="h264", choices=["h264", "hevc", "vp9", "av1", "mpeg4"],
                   help="with --videos: the encoder (default h264, x264)")
    p.add_argument("--keyframe-seconds", type=float, default=10.0, metavar="S",
                   help="with --videos: seconds between keyframes (default 10, x264's default interval)")
    _add_quiet(p)
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("pack", help="pack images (folders, lists, CSV, WebDataset, Hugging Face, LMDB, TFRecord, "
                       "MXNet RecordIO, HDF5, COCO) into Arrow shards, in a folder or object storage")
    p.add_argument("src", nargs="+", metavar="SRC",
                   help="ImageFolder directory, 'path label' .txt list, .csv, WebDataset .tar/.tar.gz shards "
                        "(a file, a folder, a brace pattern like 'train-{000000..000146}.tar' in quotes, or "
                        "several files), .parquet/.arrow files or a saved Hugging Face dataset folder, an LMDB "
                        "environment, TFRecord files (a file or folder), an MXNet .rec file (with its .idx) or a folder "
                        "of them, an .h5 file, a COCO instances .json")
    p.add_argument("out", help="output dataset directory, or a URL: s3://bucket/ds (credentials from the usual "
                   "environment; AWS_ENDPOINT_URL for S3-compatible stores)")
    p.add_argument("--kind", default="auto", choices=list(KINDS),
                   help="how to read SRC (default: auto, recognized by name or content); tar = webdataset")
    p.add_argument("--max-side", type=_positive, default=None, metavar="PX",
                   help="resize so the longer side is at most PX pixels (never upscales)")
    p.add_argument("--encoding", default="keep", choices=["keep", "jpeg", "raw"],
                   help="keep: store plain JPEGs byte-for-byte, re-encode the rest as JPEG (default)")
    p.add_argument("--jpeg-quality", type=_positive, default=90, metavar="Q", help="quality of re-encoded JPEGs")
    p.add_argument("--raw-below", type=int, default=64 * 64, metavar="PIXELS",
                   help="store images with at most this many pixels as raw RGB (0 disables)")
    p.add_argument("--shard-size", type=parse_size, default=256 * 2**20, metavar="SIZE",
                   help="target shard size, e.g. 256MiB (default)")
    p.add_argument("--workers", type=_positive, default=None, help="worker threads (default: usable CPUs)")
    p.add_argument("--engine", default="local", choices=["local", "ray"],
                   help="local: threads on this machine (default); ray: the per-image work on a Ray cluster's "
                   "workers (pip install 'stoker[ray]'; SRC must be readable from every node)")
    p.add_argument("--address", default=None, help="with --engine ray: the cluster to join (auto, "
                   "ray://HOST:10001); default: a Ray instance started on this machine")
    p.add_argument("--map", default=None, metavar="MODULE:FUNCTION",
                   help="run your function on every sample before it is stored (a changed sample, several, or "
                        "None to drop it; docs/packing.md)")
    p.add_argument("--map-fingerprint", default=None, metavar="TEXT",
                   help="with --map: the function's version for --resume (default: a hash of its code)")
    p.add_argument("--on-error", default="skip", choices=["skip", "fail"],
                   help="skip: log bad files to OUT/skipped.jsonl (default); fail: stop at the first")
    p.add_argument("--max-pixels", type=_positive, default=None, metavar="N",
                   help="refuse images (and video frames) with more pixels than N (decompression bombs)")
    p.add_argument("--samples", default="auto", choices=["auto", "image", "video"],
                   help="what SRC holds (default: auto, videos when its files end like .mp4/.mkv/.webm/... or "
                        "its bytes start like a video container); videos need pip install 'stoker[video]'")
    p.add_argument("--video-keyframes", type=float, default=None, metavar="SECONDS",
                   help="videos: re-encode to H.264 with a keyframe every SECONDS (cheaper random clips, more "
                        "bytes; docs/video.md); default: stored byte-for-byte unless --max-side shrinks them")
    p.add_argument("--video-crf", type=int, default=23, metavar="CRF",
                   help="quality of re-encoded videos (x264 CRF 0..51, lower is better; default 23)")
    p.add_argument("--resume", action="store_true", help="finish an interrupted pack into OUT")
    p.add_argument("--overwrite", action="store_true", help="replace a pack already in OUT (deletes only "
                   "the files pack writes)")
    p.add_argument("--verbose", action="store_true", help="let decoder libraries print their warnings "
                   "(they are hidden by default: skipped.jsonl has every skipped file's reason)")
    p.add_argument("--label-column", default="label", metavar="NAME",
                   help="where labels are: a CSV or Hugging Face column, a TFRecord feature, an HDF5 dataset, a "
                        "WebDataset .json field (default: 'label', else the format's usual name, e.g. "
                        "image/class/label for TFRecord)")
    p.add_argument("--no-labels", action="store_true", help="pack without labels even where SRC has some")
    p.add_argument("--image-column", default=None, metavar="NAME",
                   help="where images are: a Hugging Face column, a TFRecord feature or an HDF5 dataset "
                        "(default: image, image/encoded, images, ...)")
    p.add_argument("--path-column", default="path", help="CSV column holding image paths")
    p.add_argument("--mask-column", default=None, metavar="NAME",
                   help="CSV column holding each image's label map (a PNG of class ids, same size as the image), "
                        "stored as a binary column NAME; resized with nearest neighbour under --max-side")
    p.add_argument("--columns", type=_column_list, default=None, metavar="NAME,...",
                   help="keep only these extra columns (comma-separated; '' keeps none); fields named like a "
                        "built-in column (key, image, encoding, height, width, label) are stored as source_<name>")
    p.add_argument("--root", type=Path, default=None, metavar="DIR",
                   help="lists and CSVs: resolve relative paths against DIR and make keys relative to it "
                        "(default: the list's folder; absolute paths work either way)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress log lines")
    _add_quiet(p)
    p.set_defaults(func=_cmd_pack)

    p = sub.add_parser("info", help="counts, classes, resolutions and sizes of a packed dataset")
    p.add_argument("dataset", help="dataset directory or URL (s3://bucket/ds)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("verify", help="check shard checksums against the manifest (exit 1 on any problem)")
    p.add_argument("dataset", help="dataset directory or URL (s3://bucket/ds: shards go through the local cache)")
    p.add_argument("--decode", action="store_true", help="also decode every sample")
    p.add_argument("--workers", type=_positive, default=None, help="decode threads (default: usable CPUs)")
    _add_quiet(p)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("stage", help="copy a packed dataset into memory-backed storage (/dev/shm) once, verified",
                       description="stoker stage DATASET /dev/shm/NAME: copy (or reuse a finished copy), checking "
                       "every shard's SHA-256; the copy stays until --remove. --sweep ROOT removes copies made by "
                       "Loader(storage=Storage(stage=ROOT)) that crashed runs left behind.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="DATASET DEST, or DEST with --remove, ROOT with --sweep")
    p.add_argument("--remove", action="store_true", help="delete staged copies (waits while a process uses them)")
    p.add_argument("--sweep", action="store_true", help="delete abandoned copies under ROOT that no process holds")
    p.set_defaults(func=_cmd_stage)

    p = sub.add_parser("bench", help="stoker vs a DataLoader+PIL baseline vs the decode ceiling, same images")
    add_bench_arguments(p)

    p = sub.add_parser("doctor", help="is training on this data input-bound? loader alone, model alone, both")
    p.add_argument("path", type=Path, help="a packed dataset, an ImageFolder tree or a 'path label' list")
    p.add_argument("--batch-size", type=_positive, default=32)
    p.add_argument("--steps", type=_positive, default=12,
                   help="measured batches per run, after one warm-up batch (default 12: 416 images per run; "
                        "no verdict below 10)")
    p.add_argument("--threads", type=_positive, default=None, help="loader threads (default: usable CPUs)")
    p.add_argument("--cores", type=_core_counts, default=None, metavar="N[,N...]",
                   help="run pinned to N cores, as a machine with N cores per GPU would (loader and model threads "
                   "follow N); several (16,8) run in turn, a row and a report each")
    p.add_argument("--transforms", default="train", choices=["train", "val", "buckets", "tokens"],
                   help="train: RandomResizedCrop + flip (default); val: Resize + CenterCrop; buckets: aspect-ratio "
                        "buckets of --size x --size pixels + flip (each batch one bucket); tokens: NaFlex token "
                        "budgets of (--size / 16)^2 patches of 16 + flip")
    p.add_argument("--size", type=_positive, default=224, help="output size in pixels (default 224)")
    p.add_argument("--model", default=None, metavar="MODEL",
                   help="the model to train: a torchvision model name or module:callable returning an nn.Module, "
                   "e.g. torchvision.models:resnet18 (default: built-in small CNN)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--decode", default="cpu", choices=["cpu", "gpu", "auto"],
                   help="where JPEGs are decoded: cpu (default), gpu (a CUDA device), or auto (split with the CPU "
                        "threads by measured throughput where a GPU decoder works)")
    p.add_argument("--json", action="store_true", help="machine-readable output, no progress bar")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("demo", help="the main job on built-in data: generate, pack, train on one batch held in memory and fed "
                                             "by each loader, compare fed / synthetic")
    p.add_argument("--out", type=Path, default=None,
                   help="working directory (default ./stoker-demo; ./stoker-demo-video with --video)")
    p.add_argument("--images", type=_positive, default=2000, help="images to generate (default 2000)")
    p.add_argument("--batch-size", type=_positive, default=None,
                   help="default 256 on a GPU, 64 on the CPU (--video: 8 clips)")
    p.add_argument("--steps", type=_positive, default=None,
                   help="timed training steps per run (default 20, raised to 4x the largest loader queue; "
                        "--video: 10)")
    p.add_argument("--video", action="store_true",
                   help="train a tiny 3D CNN on generated video clips: a DataLoader decoding with PyAV vs stoker's "
                        "Loader(sampling=Sampling(clips=...)), alternating (needs pip install 'stoker[video]')")
    p.add_argument("--videos", type=_positive, default=32, help="--video: videos to generate (default 32)")
    p.add_argument("--rounds", type=_positive, default=2, help="--video: rounds of each feed, alternating (default 2)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command (`args.func`, named `args.command`): a StokerError or OSError becomes one line on
    stderr and exit status 2."""
    func: Callable[[argparse.Namespace], int] = args.func
    handler = _setup_logging(getattr(args, "quiet", False))
    try:
        code = func(args)
        sys.stdout.flush()   # inside the try: a closed pipe is answered below, not at interpreter exit
        return code
    except BrokenPipeError:   # `stoker info packed | head -1`: the reader had what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error when Python flushes
        return 141   # 128 + SIGPIPE, what a shell tool killed by the closed pipe returns
    except StokerError as exc:
        print(f"stoker {args.command}: error: {exc.for_cli()}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine's answer (a full disk, a vanished file): one line, not a traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"stoker {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        again = " (finished shards are kept; run the same command with --resume to finish it)" \
            if args.command == "pack" else ""
        print(f"stoker {args.command}: interrupted{again}", file=sys.stderr)
        return 130
    finally:
        logging.getLogger("stoker").removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
