"""How much Python a Loader's own threads run per batch inside the training process.

Every Python call a worker thread makes needs the GIL, which the training loop's own thread wants
for each op it dispatches (docs/architecture.md, "Threads and the GIL"). `python_calls` counts the
calls (Python functions and the C functions Python calls, as `sys.setprofile` sees them) the
loader's threads make per batch in the steady state, for the default `Workers` at each thread count
measured (`run_calls`, on generated images or `--data`). benchmarks/bench_neighbour.py counts them too.

With `--decode gpu` or `--decode auto` (`--gpu-share 0.5`) it counts the GPU columns' path instead, on the CPU
device with the fixed-rate stand-in decoder (tests/gpu_standin.py): the workers, the device thread and
the decode thread together, the calls made inside the decoder's own methods left out (the library's
work, not stoker's).

    python benchmarks/bench_calls.py [--data DIR] [--images N] [--batch-size 256] [--workers N] [--out DIR] [--json]
    python benchmarks/bench_calls.py --decode gpu --workers 2
    python benchmarks/bench_calls.py --decode auto --gpu-share 0.5 --workers 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stoker.errors import ConfigError, StokerError

__all__ = ["CALLS_BATCH", "CALLS_THREADS", "CallsResult", "format_calls", "python_calls", "run_calls"]

#: the thread counts the calls are counted at by default
CALLS_THREADS = (2, 16)
#: the batch they are counted at, where the data holds 3 of them (else the batch given)
CALLS_BATCH = 256

#: events that are calls: a Python function, or a C function (a builtin, a NumPy function) called from Python
_CALLS = frozenset(("call", "c_call"))
#: --decode values: the CPU path, or the GPU columns' path (decode="gpu", or the split of decode="auto")
DECODES = ("cpu", "gpu", "auto")


def standin_decoder() -> Any:
    """The tests' fixed-rate stand-in GPU decoder (tests/gpu_standin.py), instant: the GPU columns' path on
    the CPU device, where what is counted is the Python around the decoder, not the decode."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from gpu_standin import FixedRateDecoder

    return FixedRateDecoder()


def _codes_of(obj: Any) -> frozenset:
    """The code objects of `obj`'s class and its bases (its methods, and functions nested in them are run
    from their frames): the frames the count leaves out."""
    codes = set()
    for cls in type(obj).__mro__[:-1]:
        for value in vars(cls).values():
            fn = getattr(value, "__func__", value)
            code = getattr(fn, "__code__", None)
            if code is not None:
                codes.add(code)
    return frozenset(codes)


def python_calls(packed: Path, batch_size: int, threads: int, *, batches: int = 8, seed: int = 0,
                 decode: str = "cpu", gpu_share: float | None = None, warm: int | None = None) -> float:
    """Python calls per batch run by the loader's threads (the workers and the engine's coordinators; with
    `decode` "gpu" or "auto" also the device and decode threads, on the CPU device with the stand-in
    decoder, the calls inside the decoder's own methods not counted), RandomResizedCrop(224) + flip on
    the packed dataset `packed`, default `Workers` at `threads` threads: counted over up to `batches`
    batches after `warm` warm-up batches (the pass's start-up is not the steady state; None: one, or with a
    device thread one turn of the ring, `prefetch + 2` batches). The profile hook is on only while the loader
    runs, and only on the threads it starts."""
    from stoker.loader.loader import Loader
    from stoker.device.stage import DeviceOptions
    from stoker.loader.options import Workers
    from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

    if decode not in DECODES:
        raise ConfigError(f"python_calls: decode is one of {DECODES}, got {decode!r}")
    counts: dict[int, int] = {}
    lock = threading.Lock()
    device = None
    inside: dict[int, Any] = {}   # thread -> the decoder's frame it is in (its calls are not counted)
    if decode != "cpu":
        decoder = standin_decoder()
        device = DeviceOptions("cpu", decode=decode, gpu_share=gpu_share, gpu_decoder=decoder)
        skip = _codes_of(decoder)

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event in _CALLS:
            ident = threading.get_ident()
            counts[ident] = counts.get(ident, 0) + 1   # each thread writes only its own entry

    def gpu_hook(frame: Any, event: str, arg: Any) -> None:
        ident = threading.get_ident()
        into = inside.get(ident)
        if into is not None:   # inside the decoder: only its return ends the skip
            if event == "return" and frame is into:
                inside[ident] = None
            return
        if event in _CALLS:
            counts[ident] = counts.get(ident, 0) + 1   # the call into the decoder is stoker's, counted
            if event == "call" and frame.f_code in skip:
                inside[ident] = frame

    def snapshot() -> int:
        with lock:
            return sum(list(counts.values()))

    loader = Loader(str(packed), batch_size, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()],
                    seed=seed, workers=Workers(num_threads=threads), device=device)
    # with a device thread (the GPU columns) the workers run ahead of it by up to the ring's slots: the
    # window ends before they can reach the pass's end, after which only the device side would still
    # work and its calls would count over fewer batches made (without one, nothing of the loader's runs
    # once the workers are done); the last batch may be short
    lead = loader.prefetch + 2 if device is not None else 0
    # the warm-up: one batch; with a device thread one turn of the ring (`--warm 1` for one batch there too),
    # whose first batches make what the pass then reuses (each slot's JPEG staging, the device's ring buffers)
    warm = (lead if device is not None else 1) if warm is None else warm
    batches = min(batches, len(loader) - warm - lead - 1)
    if batches < 1:
        loader.close()
        raise ConfigError(f"python_calls: {len(loader)} batches of {batch_size} is too few to count in the steady "
                          f"state (at least {warm + lead + 2} are needed); use more images (--images) or a smaller "
                          f"--batch-size")
    threading.setprofile(hook if device is None else gpu_hook)   # only threads started from here on: the loader's
    try:
        it = iter(loader)
    finally:
        threading.setprofile(None)   # type: ignore[arg-type]
    try:
        for _ in range(warm):
            next(it)
        # per batch the threads made in the window, not per batch handed out: the ring lets them run ahead,
        # so the batches handed out in the window may have been made before it began
        start, made = snapshot(), loader.stats.samples
        for _ in range(batches):
            next(it)
        produced = (loader.stats.samples - made) / batch_size
        if produced < 1:
            raise ConfigError(f"python_calls: the loader had made every batch before the count began ({len(loader)} "
                              f"batches of {batch_size}, a ring of {loader.prefetch + 2}); use more images (--images) "
                              f"or a smaller --batch-size")
        return (snapshot() - start) / produced
    finally:
        it.close()
        loader.close()


@dataclass
class CallsResult:
    """Python calls per batch of the loader's threads (`calls`: thread count -> calls) at `batch_size`."""

    calls: dict[int, float]
    batch_size: int
    data: dict[str, Any]
    machine: dict[str, Any]
    decode: str = "cpu"   # "gpu" or "auto": the GPU columns' path, on the CPU device with the stand-in decoder
    gpu_share: float | None = None
    warm: int | None = None   # warm-up batches asked for (None: the default, `python_calls`)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["calls"] = {str(n): c for n, c in self.calls.items()}
        return out


def run_calls(data_dir: Path | None = None, *, images: int | None = None, batch_size: int = CALLS_BATCH,
              threads: tuple[int, ...] = CALLS_THREADS, out_dir: Path | None = None, seed: int = 0,
              progress: bool = False, decode: str = "cpu", gpu_share: float | None = None,
              warm: int | None = None) -> CallsResult:
    """`python_calls` at each of `threads` on `data_dir` (an ImageFolder tree of JPEGs; None: `images`
    generated ImageNet-like JPEGs, default 1,000), packed once. `out_dir` keeps the data and receives
    calls.json and calls.md. `decode`/`gpu_share`/`warm`: as `python_calls`. Raises ConfigError for bad arguments or
    too few images for three batches."""
    from stoker._progress import Progress
    from stoker.tools.baseline import list_image_folder
    from stoker.tools.bench import _data_stats, _pack_once, machine_info
    from stoker.tools.synth import cached_imagenet_like

    if not threads or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in threads):
        raise ConfigError(f"run_calls: threads (--workers) are thread counts >= 1, got {threads!r}")
    with tempfile.TemporaryDirectory(prefix="stoker-calls-") as tmp, \
            Progress("bench", len(threads) + 1, unit="count", enabled=progress) as bar:
        work = Path(out_dir) if out_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        generated = data_dir is None
        root = cached_imagenet_like(work / "data", images or 1000, seed=seed, workers=max(threads)) if generated \
            else Path(data_dir)  # type: ignore[arg-type]
        samples, _ = list_image_folder(root)
        bar.stage("packing the images once")
        packed = work / "packed-calls"
        _pack_once(root, packed, max(threads))
        bar.update()
        calls: dict[int, float] = {}
        for n in threads:
            bar.stage(f"Python calls per batch of {batch_size} at {n} threads")
            calls[n] = python_calls(packed, batch_size, n, seed=seed, decode=decode, gpu_share=gpu_share, warm=warm)
            bar.update()
        result = CallsResult(calls, batch_size, _data_stats(root, samples, generated), machine_info(), decode,
                             gpu_share, warm)
        if out_dir is not None:
            (work / "calls.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
            (work / "calls.md").write_text(format_calls(result) + "\n")
    return result


def format_calls(result: CallsResult) -> str:
    """The counts as a markdown table, with what was counted and on what."""
    d, m = result.data, result.machine
    lines = [f"| stoker threads | Python calls per batch of {result.batch_size} (loader's threads) |", "| ---: | ---: |"]
    lines += [f"| {n} | {c:,.0f} |" for n, c in result.calls.items()]
    if result.decode != "cpu":
        share = "" if result.gpu_share is None else f", gpu_share={result.gpu_share:g}"
        lines += ["", f"Path: decode={result.decode!r}{share} on the CPU device with the fixed-rate stand-in "
                      f"decoder (tests/gpu_standin.py); the workers', device thread's and decode thread's calls "
                      f"together, those inside the decoder's own methods left out."]
    lines += ["",
              "Counted: the calls (Python functions, and C functions called from Python) the Loader's own threads "
              f"make per batch in the steady state (after {_warm_words(result)}), with threading.setprofile; "
              "RandomResizedCrop(224) + RandomHorizontalFlip, default Workers at that many threads. Each call "
              "takes the GIL the training loop's thread wants.",
              f"Data: {d['images']} {'generated ImageNet-like ' if d['generated'] else ''}JPEGs, mean "
              f"{d['mean_width']}x{d['mean_height']} px, {d['mean_file_kb']} KB.",
              f"Machine: {m['cpu']}, {m['usable_cores']} usable cores; Python {m['python']}."]
    return "\n".join(lines)


def _warm_words(result: CallsResult) -> str:
    if result.warm is not None:
        return f"{result.warm} warm-up batch{'es' if result.warm != 1 else ''}"
    return "one warm-up batch" if result.decode == "cpu" else "one turn of the batch ring as the warm-up"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_calls.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=None, help="image folder to use (default: generate ImageNet-like)")
    p.add_argument("--images", type=int, default=None, help="images to generate (default 1000)")
    p.add_argument("--batch-size", type=int, default=CALLS_BATCH, help=f"default {CALLS_BATCH}")
    p.add_argument("--workers", type=int, default=None,
                   help=f"count at N threads (default at each of {', '.join(map(str, CALLS_THREADS))})")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="receives calls.json and calls.md")
    p.add_argument("--decode", choices=DECODES, default="cpu",
                   help="the CPU path (default), or the GPU columns' path on the CPU device with a stand-in decoder")
    p.add_argument("--gpu-share", type=float, default=None, help="with --decode auto: a fixed share of the JPEG rows")
    p.add_argument("--warm", type=int, default=None,
                   help="warm-up batches before the count (default 1; with --decode gpu/auto one turn of the ring)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    args = p.parse_args(argv)
    try:
        result = run_calls(args.data, images=args.images, batch_size=args.batch_size,
                           threads=(args.workers,) if args.workers else CALLS_THREADS, out_dir=args.out,
                           progress=not args.quiet, decode=args.decode, gpu_share=args.gpu_share, warm=args.warm)
    except StokerError as exc:
        p.error(str(exc))
    print(json.dumps(result.to_json(), indent=1) if args.json else format_calls(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
