"""`stoker demo`: the main job on built-in data, on any machine.

Generates an ImageNet-like set of JPEGs, packs it, checks it, then feeds the same images through
PyTorch's DataLoader + PIL (torchvision's default training transforms) and through stoker, and
prints the table. Everything lands in one working directory; generated images are cached there.
"""

from __future__ import annotations

import time
from pathlib import Path

from .audit import describe, verify
from .bench import format_table, run_bench, usable_cpus
from .packing import PackOptions, pack
from .synth import cached_imagenet_like

DEMO_PIPELINES = ("baseline", "stoker-train", "ceiling")


def _step(n: int, text: str) -> None:
    print(f"\n[{n}/4] {text}", flush=True)


def run_demo(out: str | Path = "stoker-demo", *, images: int = 2000, batch_size: int = 256,
             rounds: int = 3) -> Path:
    """Run the demo in ``out``; returns the path of the written markdown table."""
    out = Path(out)
    cores = len(usable_cpus())
    started = time.perf_counter()

    _step(1, f"generating {images:,} ImageNet-like JPEGs (cached in {out / 'data'})")
    root = cached_imagenet_like(out / "data", images, workers=cores)

    _step(2, "packing them into Arrow shards")
    packed = out / "packed"
    print(pack(root, packed, options=PackOptions(workers=cores), overwrite=True).format())

    _step(3, "checking the pack")
    print(describe(packed).format())
    print(verify(packed).format())

    _step(4, f"loading every image: DataLoader+PIL vs stoker ({cores} cores, batch {batch_size})")
    result = run_bench(root, batch_size=batch_size, workers=cores, rounds=rounds,
                       pipelines=DEMO_PIPELINES, out_dir=out, packed=packed)
    print(format_table(result))
    print(f"\ndemo finished in {time.perf_counter() - started:.0f} s; results in {out}/bench.md, "
          f"{out}/bench.json" + (f", {out}/bench.png" if (out / "bench.png").exists() else ""))
    return out / "bench.md"
