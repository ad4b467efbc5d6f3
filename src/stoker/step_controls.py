"""The training step's two controls: the step timed on one batch held in memory, alone (the
synthetic-data ceiling: the model's own speed) and while a loader runs beside it with its batches
discarded (the interference control).

    controls = measure_controls(step, first_batch, loader, steps=20)
    fed / controls.synthetic_images_per_s         # what the user feels: the share of the model's speed kept

What a fed loop loses against the synthetic step splits in two. synthetic -> interference: the
loader's cost to the step itself (the cores, the GIL, memory bandwidth it takes from the step),
which data wait never shows, because the step never waits for it. interference -> fed: the time
spent waiting for batches. The discarding thread takes one batch per step, so the loader does the
work it does in the fed loop (it runs flat out only where it is slower than the step, as it does
there).

Both windows synchronize the GPU only at their ends (no per-step sync: the overlap the fed loop
has is kept), and the synthetic window runs twice, before and after the control (A, B, A), so a
machine whose speed drifts during the run (another process, thermal limits) biases neither side.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .errors import StokerError

__all__ = ["MIN_VERDICT_STEPS", "Drain", "StepControls", "call_step", "measure_controls", "resident_copy"]

#: Fewer measured steps than this give no verdict. The first steps after warm-up are served from the
#: batches the loader queued while the first one was made (stoker's default prefetch of 2 and its ring
#: of 4, a DataLoader's 2 per worker), so over a handful of steps the data wait describes that queue,
#: not the loader's sustained rate; and over fewer than 10 steps one abnormal step (a GC pause, a page
#: fault storm, another process) moves a share of wall time by more than the 10% the verdict turns on.
MIN_VERDICT_STEPS = 10
#: the longest the interference control waits for the loader's first batch, or for its thread to stop
_START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class StepControls:
    """The step on a resident batch: alone (`synthetic_images_per_s`) and beside the running loader
    (`interference_images_per_s`, None when it could not run: `why_no_interference` says why)."""

    steps: int                           # timed steps per window
    batch_size: int                      # images per step
    synthetic_images_per_s: float
    interference_images_per_s: float | None = None
    why_no_interference: str = ""

    @property
    def interference_ratio(self) -> float | None:
        """interference / synthetic: 1.0 when the running loader costs the step nothing."""
        if self.interference_images_per_s is None or not self.synthetic_images_per_s > 0:
            return None
        return self.interference_images_per_s / self.synthetic_images_per_s


def _first_tensor(batch: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


def _batch_size(batch: Any) -> int:
    t = _first_tensor(batch)
    if t is not None and t.dim() > 0:
        return int(t.shape[0])
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    try:
        return len(first)
    except TypeError:
        return 0


def _tensors_cloned(obj: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple):
        return tuple(_tensors_cloned(o) for o in obj)
    if isinstance(obj, list):
        return [_tensors_cloned(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _tensors_cloned(v) for k, v in obj.items()}
    return obj


def resident_copy(batch: Any) -> Any:
    """A copy of `batch` that no loader will overwrite (stoker's batches live in a ring of reused
    slots): its tensors cloned where they are (a GPU batch stays on the GPU)."""
    return _tensors_cloned(batch)


def call_step(step: Callable[..., Any], batch: Any) -> None:
    """`step(*batch)` for a tuple or list batch (`step(images, labels)`), else `step(batch)`."""
    if isinstance(batch, (tuple, list)):
        step(*batch)
    else:
        step(batch)


def _synchronize(device: Any) -> None:
    """Wait for the GPU work queued on `device` (nothing to do on the CPU or before CUDA started)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    where = str(device) if device is not None else ""
    torch.cuda.synchronize(where if where.startswith("cuda") else None)


def _window(step: Callable[..., Any], batch: Any, steps: int, device: Any,
            before_each: Callable[[], None] = lambda: None) -> float:
    """Seconds for `steps` steps on `batch`, the device synchronized at both ends only."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        before_each()
        call_step(step, batch)
    _synchronize(device)
    return time.perf_counter() - start


class Drain:
    """A thread that takes one batch from `iterable` per permit and drops it, starting the next pass when
    one ends (a one-shot iterator that runs out ends the control)."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable
        self.taken = 0
        self.ran_out = False
        self.error: BaseException | None = None
        self._permits = threading.Semaphore(0)
        self._stop = threading.Event()
        self._got = threading.Condition()
        # daemon only as a safety net: stop() ends it (every wait below polls the stop flag)
        self._thread = threading.Thread(target=self._run, name="stoker-interference-control", daemon=True)

    def permit(self) -> None:
        self._permits.release()

    def _run(self) -> None:
        it: Any = None
        try:
            it = iter(self.iterable)
            in_pass = 0
            while not self._stop.is_set():
                if not self._permits.acquire(timeout=0.05):
                    continue
                try:
                    batch = next(it)
                except StopIteration:
                    if it is self.iterable or in_pass == 0:   # one-shot, or a pass with no batch
                        self.ran_out = True
                        return
                    _close(it)
                    it, in_pass = iter(self.iterable), 0
                    batch = next(it)
                del batch
                in_pass += 1
                with self._got:
                    self.taken += 1
                    self._got.notify_all()
        except BaseException as exc:   # re-raised by stop() in the measuring thread
            self.error = exc
        finally:
            if it is not None and it is not self.iterable:
                _close(it)
            with self._got:
                self._got.notify_all()

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Start the thread and wait for the loader's first batch (its start-up stays out of the window)."""
        self._thread.start()
        self.permit()
        deadline = time.monotonic() + timeout_s
        with self._got:
            while not self.taken and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop()
                    raise StokerError(f"the interference control waited {timeout_s:.0f} s for the loader's first "
                                      "batch; check that the loader delivers batches outside the profiled loop")
                self._got.wait(min(left, 0.1))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(_START_TIMEOUT_S)
        if self.error is not None:
            raise self.error


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if callable(close):
        close()


def measure_controls(step: Callable[..., Any], batch: Any, iterable: Iterable[Any] | None = None, *, steps: int,
                     device: Any = None) -> StepControls:
    """Time `step` on a resident copy of `batch`: alone, then beside `iterable` running with its batches
    discarded (one per step), then alone again. `device`: where the step's GPU work runs (synchronized at
    window ends); None: the current CUDA device, when CUDA has started. `iterable` None: no control."""
    if steps < 1:
        raise StokerError(f"measure_controls: steps must be >= 1, got {steps}")
    resident = resident_copy(batch)
    size = _batch_size(resident)
    call_step(step, resident)   # warm-up: the first step on this batch pays for any lazy set-up
    first = _window(step, resident, steps, device)
    interference, why = None, "no loader given"
    if iterable is not None:
        drain = Drain(iterable)
        drain.start()
        try:
            call_step(step, resident)
            seconds = _window(step, resident, steps, device, before_each=drain.permit)
        finally:
            drain.stop()
        if drain.ran_out:
            why = ("the iterable ran out during the control: a one-shot iterator (a generator) cannot be read "
                   "again; profile the Loader or DataLoader itself")
        else:
            interference, why = steps * size / seconds, ""
    second = _window(step, resident, steps, device)
    synthetic = 2 * steps * size / (first + second) if first + second > 0 else math.nan
    return StepControls(steps, size, synthetic, interference, why)
