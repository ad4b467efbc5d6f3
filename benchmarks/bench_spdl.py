"""SPDL beside stoker: `stoker bench` with pipeline ``spdl`` added (a `stoker.tools.bench.Peer`).

    python benchmarks/bench_spdl.py [stoker bench's options]   # default: stoker-train, stoker-val, spdl

The same options and outputs as `stoker bench` (`stoker bench --help`). SPDL (``pip install spdl``, Meta's
Scalable and Performant Data Loading, FFmpeg decode) on its recommended fast path: a `spdl.pipeline` that
reads the ImageFolder's JPEG files and decodes each batch with `spdl.io.load_image_batch` (FFmpeg's decoder
and scale filter, the GIL released) on `--workers` threads, into uint8 224 x 224 batches. Its scale filter
resizes the whole image to 224 x 224 (no crop: less work than a RandomResizedCrop), so its peer among
stoker's pipelines is ``stoker-val`` (whole-image decode, Resize + CenterCrop). Where spdl does not import,
``spdl`` is reported as skipped, with the pip command.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Iterator

from stoker.cli import add_bench_arguments, run_command
from stoker.tools.bench import Peer, peer_added

__all__ = ["PEER", "PIPELINES", "main", "why_unavailable"]

PIPELINES = {"spdl": ("SPDL 0.8: load_image_batch (FFmpeg decode + scale to 224x224, whole image) in a "
                      "spdl.pipeline on --workers threads", "stoker-val")}
_SIZE = 224


def why_unavailable() -> str | None:
    """Why SPDL cannot run here (with the fix), or None when it imports."""
    try:
        import spdl.io
        import spdl.pipeline  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a wheel built for another platform
        return f"spdl does not import ({type(exc).__name__}: {exc}); pip install spdl (Linux wheels)"
    try:   # its decoders load FFmpeg's shared libraries on first use
        import io

        import numpy as np
        from PIL import Image

        jpeg = io.BytesIO()
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(jpeg, "JPEG")
        spdl.io.load_image_batch([jpeg.getvalue()], width=8, height=8)
    except Exception as exc:  # noqa: BLE001 - FFmpeg's libraries missing (libavutil.so ...), or another failure
        return (f"spdl cannot decode here ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); SPDL needs "
                f"FFmpeg's shared libraries (apt-get install ffmpeg, or a conda ffmpeg)")
    return None


def version() -> str:
    from importlib.metadata import version as installed

    return f"spdl-io {installed('spdl-io')}"


def batches(spec: Any) -> tuple[Callable[[], Iterator[int]], Callable[[], None]]:
    """(epoch, close) over the ImageFolder ``spec.root``: each epoch one pipeline over every file, in
    batches of ``spec.batch_size``, yielding each batch's size."""
    import spdl.io
    from spdl.pipeline import PipelineBuilder

    files = sorted(str(p) for p in Path(spec.root).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    groups = [files[k:k + spec.batch_size] for k in range(0, len(files), spec.batch_size)]

    def load(paths: list[str]) -> int:
        buffer = spdl.io.load_image_batch(paths, width=_SIZE, height=_SIZE, pix_fmt="rgb24")
        return len(spdl.io.to_numpy(buffer))

    def epoch() -> Iterator[int]:
        pipeline = (PipelineBuilder().add_source(groups).pipe(load, concurrency=spec.workers, output_order="input")
                    .add_sink(4).build(num_threads=spec.workers))
        with pipeline.auto_stop():
            yield from pipeline
    return epoch, lambda: None


PEER = Peer(script=__file__, unavailable=why_unavailable, version=version, pipelines=PIPELINES, open=batches,
            modules=("spdl.io", "spdl.pipeline"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_spdl.py", description=__doc__.split("\n\n")[0])
    add_bench_arguments(p)
    args = p.parse_args(argv)
    if args.pipelines is None and args.device == "cpu" and args.recipe == "basic":
        args.pipelines = ",".join(["stoker-train", "stoker-val", *PIPELINES])
    with peer_added(PEER):
        return run_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
