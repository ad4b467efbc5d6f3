"""How much Python a Loader's own threads run per batch inside the training process.

Every Python call a worker thread makes needs the GIL, which the training loop's own thread wants
for each op it dispatches (docs/architecture.md, "Threads and the GIL"). `python_calls` counts the
calls (Python functions and the C functions Python calls, as `sys.setprofile` sees them) the
loader's threads make per batch in the steady state: `stoker bench --pipelines neighbour` reports
it beside the step inflation, for the default `Workers` at each thread count measured.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["python_calls"]

#: events that are calls: a Python function, or a C function (a builtin, a NumPy function) called from Python
_CALLS = frozenset(("call", "c_call"))


def python_calls(packed: Path, batch_size: int, threads: int, *, batches: int = 8, seed: int = 0) -> float:
    """Python calls per batch run by the loader's threads (the workers and the engine's coordinators),
    RandomResizedCrop(224) + flip on the packed dataset `packed`, default `Workers` at `threads` threads:
    counted over up to `batches` batches after a warm-up batch (the pass's start-up is not the steady
    state). The profile hook is on only while the loader runs, and only on the threads it starts."""
    from ..loader.loader import Loader
    from ..loader.options import Workers
    from ..transforms import RandomHorizontalFlip, RandomResizedCrop

    counts: dict[int, int] = {}
    lock = threading.Lock()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event in _CALLS:
            ident = threading.get_ident()
            counts[ident] = counts.get(ident, 0) + 1   # each thread writes only its own entry

    def snapshot() -> int:
        with lock:
            return sum(list(counts.values()))

    loader = Loader(str(packed), batch_size, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()],
                    seed=seed, workers=Workers(num_threads=threads))
    warm = 1
    batches = min(batches, len(loader) - warm - 1)   # the last batch may be short
    if batches < 1:
        loader.close()
        raise ConfigError(f"python_calls: {len(loader)} batches of {batch_size} is too few to count in the steady "
                          f"state (at least 3 are needed); use more images (--images) or a smaller --batch-size")
    threading.setprofile(hook)   # only threads started from here on: the loader's, not this one
    try:
        it = iter(loader)
    finally:
        threading.setprofile(None)   # type: ignore[arg-type]
    try:
        for _ in range(warm):
            next(it)
        start = snapshot()
        for _ in range(batches):
            next(it)
        return (snapshot() - start) / batches
    finally:
        it.close()
        loader.close()
