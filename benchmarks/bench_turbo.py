"""TurboLoader beside stoker: `stoker bench` with pipeline ``turbo-tbl`` added (a `stoker.tools.bench.Peer`).

    python benchmarks/bench_turbo.py [stoker bench's options]   # default: stoker-train-raw256 and turbo-tbl

The same options and outputs as `stoker bench` (`stoker bench --help`). TurboLoader
(``pip install -e '.[turboloader]'``, Linux x86-64 wheels) decodes a tar of JPEGs once into a TBL file of
RGB uint8 samples (`turboloader.preprocess_to_tbl`), then serves training batches from a memory map with a
fused RandomResizedCrop + flip + normalize (`TblRawImageLoader(train_aug=True)`): float32 ImageNet-
normalized NCHW, no decode per epoch. The peer of stoker's raw-pixel pack (``stoker-train-raw256``:
`PackOptions(encoding="raw", max_side=256)`). One difference in what is stored: TBL resizes every image to
a square (`image_size` x `image_size`, aspect ratio not kept); stoker keeps the aspect ratio (the longer
side at most 256). The tar and the TBL file are made before any timing, as stoker's packs are; the
loader's own threads are not set by a count (it serves from a background thread and SIMD calls). Where
turboloader does not import, ``turbo-tbl`` is reported as skipped, with the pip command.
"""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path
from typing import Any, Callable, Iterator

from stoker.cli import add_bench_arguments, run_command
from stoker.tools.bench import Peer, peer_added

__all__ = ["PEER", "PIPELINES", "STORED", "main", "prepare", "tbl_batches", "why_unavailable"]

#: the pipelines this module measures: name -> (description, the pipeline its ratio is to)
PIPELINES = {"turbo-tbl": ("TurboLoader 2.39 TBL: decoded once to 256x256 RGB (squashed), served from a memory "
                           "map with fused RandomResizedCrop(224) + flip + normalize (float32)", "stoker-train-raw256")}
#: the stored side of the TBL file: stoker-train-raw256's max_side
STORED = 256
_SIZE = 224


def why_unavailable() -> str | None:
    """Why TurboLoader cannot run here (with the fix), or None when it imports."""
    try:
        import turboloader  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a wheel built for another CPU or libc
        return (f"turboloader does not import ({type(exc).__name__}: {exc}); pip install 'stoker[turboloader]' "
                f"(a Linux x86-64 wheel)")
    return None


def version() -> str:
    import turboloader

    return f"turboloader {getattr(turboloader, '__version__', '?')}"


def prepare(root: Path, work: Path, workers: int) -> Path:
    """The TBL file of the ImageFolder `root`'s JPEGs at `STORED` x `STORED`, made once in the folder
    `work`/turbo-`STORED` (a tar of the JPEGs first, which is what `preprocess_to_tbl` reads). Returns that folder."""
    out = work / f"turbo-{STORED}"
    tbl = out / f"images-{STORED}.tbl"
    if tbl.exists():
        return out
    import turboloader

    out.mkdir(parents=True, exist_ok=True)
    tar = out / "images.tar"
    with tarfile.open(tar, "w") as archive:
        for path in sorted(p for p in Path(root).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg")):
            archive.add(path, arcname=f"{path.parent.name}/{path.name}")
    partial = tbl.with_suffix(".partial")
    turboloader.preprocess_to_tbl(str(tar), str(partial), image_size=STORED, num_workers=workers)
    partial.rename(tbl)
    tar.unlink()
    return out


def tbl_batches(spec: Any) -> tuple[Callable[[], Iterator[int]], Callable[[], None]]:
    """(epoch, close) of the TBL file `prepare` made (``spec.packed``) in batches of ``spec.batch_size``:
    each epoch yields its batch sizes."""
    import turboloader

    loader: Any = turboloader.TblRawImageLoader(str(Path(spec.packed) / f"images-{STORED}.tbl"), spec.batch_size,
                                                train_aug=True, hflip_prob=0.5, image_size=_SIZE, prefetch_batches=2)
    epochs = [0]

    def epoch() -> Iterator[int]:
        loader.set_epoch(epochs[0])
        epochs[0] += 1
        for batch, _ in loader:
            yield len(batch)
    return epoch, lambda: None


PEER = Peer(script=__file__, unavailable=why_unavailable, version=version, pipelines=PIPELINES, open=tbl_batches,
            modules=("turboloader",), prepare=prepare)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_turbo.py", description=__doc__.split("\n\n")[0])
    add_bench_arguments(p)
    args = p.parse_args(argv)
    if args.pipelines is None and args.device == "cpu" and args.recipe == "basic":
        args.pipelines = ",".join(["stoker-train-raw256", *PIPELINES])
    with peer_added(PEER):
        return run_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
