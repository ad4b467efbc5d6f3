"""datago beside stoker: `stoker bench` with pipeline ``datago`` added (a `stoker.tools.bench.Peer`).

    python benchmarks/bench_datago.py [stoker bench's options]   # default: stoker-train, stoker-buckets, datago

The same options and outputs as `stoker bench` (`stoker bench --help`). datago (``pip install datago``,
Photoroom's Rust loader, Linux wheels) reads the ImageFolder's JPEG files itself, decodes them and resizes
each to its aspect bucket of about 224 x 224 pixels (`crop_and_resize`, `downsampling_ratio=32`, aspects
1/4 to 4) on its own threads, and hands out one sample at a time (it batches nothing; its threads are not
set by a count). Its peer among stoker's pipelines is ``stoker-buckets`` (the same buckets, by stoker's
engine, batched); ``stoker-train`` is the fixed-size pipeline. Where datago does not import, ``datago`` is
reported as skipped, with the pip command.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from stoker.cli import add_bench_arguments, run_command
from stoker.tools.bench import Peer, peer_added

__all__ = ["PEER", "PIPELINES", "main", "why_unavailable"]

PIPELINES = {"datago": ("datago 2026.10 (Rust): file reads, decode, resize to aspect buckets of about 224x224, "
                        "one sample at a time", "stoker-buckets")}
_SIZE = 224


def why_unavailable() -> str | None:
    """Why datago cannot run here (with the fix), or None when it imports."""
    try:
        import datago  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a wheel built for another platform
        return f"datago does not import ({type(exc).__name__}: {exc}); pip install datago (Linux wheels)"
    return None


def version() -> str:
    from importlib.metadata import version as installed

    return f"datago {installed('datago')}"


def samples(spec: Any) -> tuple[Callable[[], Iterator[int]], Callable[[], None]]:
    """(epoch, close) over the ImageFolder ``spec.root``: each epoch one client reading every file once,
    yielding a batch size per ``spec.batch_size`` samples handed out."""
    from datago import DatagoClient

    files = sum(1 for p in Path(spec.root).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    config = {"source_type": "file",
              "source_config": {"root_path": str(spec.root), "random_sampling": True, "rank": 0, "world_size": 1},
              "image_config": {"crop_and_resize": True, "default_image_size": _SIZE, "downsampling_ratio": 32,
                               "min_aspect_ratio": 0.25, "max_aspect_ratio": 4.0, "pre_encode_images": False},
              "limit": files, "samples_buffer_size": 2 * spec.batch_size}

    def epoch() -> Iterator[int]:
        client = DatagoClient(json.dumps(config))
        got = 0
        while got < files:
            n = 0
            while n < spec.batch_size and got + n < files and client.get_sample() is not None:
                n += 1
            if n == 0:
                return
            got += n
            yield n
    return epoch, lambda: None


PEER = Peer(script=__file__, unavailable=why_unavailable, version=version, pipelines=PIPELINES, open=samples,
            modules=("datago",))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_datago.py", description=__doc__.split("\n\n")[0])
    add_bench_arguments(p)
    args = p.parse_args(argv)
    if args.pipelines is None and args.device == "cpu" and args.recipe == "basic":
        args.pipelines = ",".join(["stoker-train", "stoker-buckets", *PIPELINES])
    with peer_added(PEER):
        return run_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
