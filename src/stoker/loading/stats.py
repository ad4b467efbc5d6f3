"""A Loader's counters (`LoaderStats`, `loader.stats`) and each worker's own, flushed into them under
the run's lock (`WorkerTimes`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: steps the recent data-wait figures are taken over (`StepWaits`)
RECENT_STEPS = 100


@dataclass
class StepWaits:
    """Each training step's exposed data wait (the time its `next()` took), as running numbers: the
    whole run's count and sum, the last `RECENT_STEPS` waits, and the wall time since the first step.
    One `add` per step on the caller's thread: a few float operations, no lock, no device sync."""

    steps: int = 0
    total_s: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    started: float | None = None   # time.monotonic() when the first step's wait began
    last: float = 0.0              # time.monotonic() when the latest step's wait ended

    def add(self, seconds: float) -> None:
        now = time.monotonic()
        if self.started is None:
            self.started = now - seconds
        self.steps += 1
        self.total_s += seconds
        self.recent.append(seconds)
        self.last = now

    def summary(self) -> dict[str, float]:
        """`data_wait_share`: the share of the wall time since the first step spent waiting for data (0: the
        loader kept up); `data_wait_ms` and `data_wait_max_ms`: the mean and largest wait of the last
        `RECENT_STEPS` steps; `data_wait_steps`: steps counted."""
        recent = list(self.recent)
        wall = self.last - self.started if self.started is not None else 0.0
        return {"data_wait_steps": float(self.steps),
                "data_wait_share": self.total_s / wall if wall > 0 else 0.0,
                "data_wait_ms": 1e3 * sum(recent) / len(recent) if recent else 0.0,
                "data_wait_max_ms": 1e3 * max(recent) if recent else 0.0}


@dataclass
class LoaderStats:
    """Counters of a Loader since it was made. Stage times are summed over worker threads (seconds; with
    the native batch engine, `decode_s` is its pool's busy seconds; with `Workers(processes=N)`, the worker
    processes' counters as their batches report them)."""

    samples: int = 0
    batches: int = 0
    skipped: int = 0  # failed samples replaced under on_error="skip"
    skipped_keys: list[str] = field(default_factory=list)  # the first 100 of them
    read_s: float = 0.0  # getting the stored bytes (mmap view, or a file read for loose data)
    decode_s: float = 0.0
    augment_s: float = 0.0  # crop, resize, flip, user transforms, writing into the batch
    worker_wait_s: float = 0.0  # workers waiting for a free slot (the consumer is the bottleneck)
    consumer_wait_s: float = 0.0  # the training loop waiting for a batch (the loader is the bottleneck)
    device_s: float = 0.0  # the device thread building batches: uploads, conversion, GPU decode submission
    tokenize_s: float = 0.0  # Targets(tokenizer=): its one call per batch, on the caller's thread (not a data wait)
    gpu_decoded: int = 0  # samples decoded on the GPU (decode="gpu"/"auto")
    gpu_fallbacks: int = 0  # JPEGs the GPU could not decode, decoded on the CPU instead
    gpu_decoder: str = ""  # decode="gpu"/"auto": the backend that decoded them (with what "auto" measured)
    gpu_share: float = 0.0  # decode="gpu"/"auto": the share of each batch's JPEGs the GPU decodes now
    gpu_split: str = ""  # why that share (measured throughputs, a fixed gpu_share, or why the CPU alone)
    # decode="gpu"/"auto": seconds per phase of the GPU path (device.gpu_pipeline.Phases names them)
    gpu_phases: dict = field(default_factory=dict)
    #: how each row becomes pixels in the latest pass (`route.Route`: decided when the Loader was made)
    route: Any = None
    slots_allocated: int = 0  # batch buffers allocated: the ring's own, plus one per batch the caller kept
    # memory on the device stage's device (GPU memory with device="cuda") the loader holds, in bytes: the
    # batches the device thread has built and not yet handed out. Counted by summing the storages of the
    # tensors it owns (not torch.cuda.memory_allocated deltas, which the training step's allocations
    # would pollute); the peak also counts the batch being built with its working tensor (the uint8
    # upload, or GPU decode target). A GPU decoder library's own buffers are not in it.
    device_bytes: int = 0
    device_peak_bytes: int = 0
    # the native engine's pool (with Workers(processes=N), the processes' pools together): the threads taking
    # rows at its latest batch, and the most at once; above the thread count while other processes take its
    # cores (`Workers(max_threads=)`)
    pool_threads: int = 0
    pool_threads_peak: int = 0
    _device_lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)
    _waits: StepWaits = field(default_factory=StepWaits, repr=False, compare=False)

    def step_wait(self, seconds: float) -> None:
        """A step waited `seconds` for its batch (the pass's `next()`; the caller's thread)."""
        self.consumer_wait_s += seconds
        self._waits.add(seconds)

    def data_wait(self) -> dict[str, float]:
        """The running data-wait figures of this process (`StepWaits.summary`): cheap, at any time.
        `Loader.data_wait(across_ranks=True)` reduces them over the ranks."""
        return self._waits.summary()

    @property
    def engine(self) -> bool:
        """Whether the route's CPU path is the native batch engine (in worker processes: theirs)."""
        return self.route is not None and self.route.native

    @property
    def per_sample_python(self) -> list[str]:
        """What runs Python per sample in the training process, and why (empty on the native path, or with
        the workers in child processes); `route.PER_SAMPLE_FIX` says what to do."""
        return [] if self.route is None else list(self.route.python)

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else
                    str(v) if k == "route" and v is not None else v)
                for k, v in self.__dict__.items() if not k.startswith("_")}

    def hold_device(self, nbytes: int, working: int = 0) -> None:
        """A built batch of `nbytes` now held on the device; `working`: bytes that also lived while it was
        built (freed since), for the peak."""
        with self._device_lock:
            self.device_bytes += nbytes
            if self.device_bytes + working > self.device_peak_bytes:
                self.device_peak_bytes = self.device_bytes + working

    def release_device(self, nbytes: int) -> None:
        """A held batch handed out to the caller (then it is theirs) or dropped."""
        with self._device_lock:
            self.device_bytes -= nbytes

    def add(self, times: "WorkerTimes", samples: int) -> None:
        """Add a worker's counters since its last flush (call under the run's lock) and reset them."""
        self.samples += samples
        self.read_s += times.read
        self.decode_s += times.decode
        self.augment_s += times.augment
        self.worker_wait_s += times.wait
        if times.pool_threads:
            self.pool_threads = times.pool_threads
            if times.pool_threads > self.pool_threads_peak:
                self.pool_threads_peak = times.pool_threads
        if times.plan:   # the route's GPU columns: their phase timers (made by `gpu_pipeline.Phases` before any worker)
            self.gpu_phases["plan_s"] += times.plan
            times.plan = 0.0
        self.skipped += times.skipped
        if times.skipped_keys:   # (as a rule none: no call)
            if len(self.skipped_keys) < 100:
                self.skipped_keys.extend(times.skipped_keys[:100 - len(self.skipped_keys)])
            times.skipped_keys.clear()
        times.read = times.decode = times.augment = times.wait = 0.0
        times.skipped = 0


@dataclass
class WorkerTimes:
    """Seconds one worker spent per stage since the last flush into the shared stats."""

    read: float = 0.0
    decode: float = 0.0
    augment: float = 0.0
    wait: float = 0.0
    plan: float = 0.0  # preparing the GPU's rows (crop windows, byte copies): part of `read` too; gpu_phases' plan_s
    skipped: int = 0
    skipped_keys: list[str] = field(default_factory=list)
    pool_threads: int = 0   # the engine pool's threads taking rows at this worker's latest batch (0: none ran)
