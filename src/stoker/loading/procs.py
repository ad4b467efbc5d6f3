"""The process mode (`Workers(processes=N)`): the worker threads in N child processes, writing into
ring slots in shared memory that the training process hands out as zero-copy batches.

Why: a worker thread still runs some Python per sample under the GIL (planning, a user transform,
PyAV's per-frame loop for clips), and the training loop's own Python (kernel dispatch) waits for the
same lock. In a child process those workers have a GIL of their own; with several children, no one
child's GIL is the ceiling either. The pixels still travel no further than the ring, because the
ring's slots are shared memory every process maps.

Who does what:

- The parent keeps the ring (`slots.BatchRing`, its slots made by `shared_slots.SharedBuffers`: one
  shared memory segment per slot, pinned with `cudaHostRegister` when CUDA is present) and every rule about
  it: a slot goes back to a child only once nothing references it and its guard fence has passed.
  `ProcessRun` is what the pass talks to in place of `slots.Run`, with the same methods.
- Child i of N (`proc_child.child_main`, started with the "spawn" context: never a fork of a threaded
  parent) renders the run's batches i, i + N, i + 2N, ...: it gets the frozen `RenderSpec` (pickled), the
  dataset's path, the epoch's indices and the slots' names, and runs the same `slots.Run` and
  `render.Filler` as the thread mode over a ring whose free slots are only those the parent sent it.
  Each free slot goes to the child of the next batch in run order that has none yet, so the child whose
  batch is due always has one (`settle`); the parent reads the batches in order, batch b from child b % N.
- The num_threads of `Workers` are all the children's together, shared out as evenly as they go: the
  default thread count is what leaves the training process its cores (`_system.threads_per_process`),
  and more processes must not take more cores.
- Each pipe carries small messages only: parent to child "slot k is free" (with its segment's name the
  first time that child hears of it), "extend" (a persistent Loader's next epoch: its indices) and
  "stop"; child to parent "attached", "batch b is in slot k" (with its size, the labels that are not
  numbers, the extra columns and the workers' counters) and errors with their traceback text.

Shared memory never outlives its pass (or a persistent Loader's run of epochs, which the same children
serve): on Linux it has no name at all (see `shared_slots`), so no kill leaves anything in /dev/shm. The
memory itself lives while any process maps it. A child that dies (killed, out of memory) is an error in
the consumer naming which worker process, its pid and how it died, found within the Loader's timeout
(at once where the pipe wait sees it), never a hang; one that dies while starting is told apart from a
script without a `__main__` guard.

The children ignore SIGINT: a terminal's Ctrl-C reaches the whole process group, and the training
script decides (it may catch it and finish its epoch, as with threads); the parent stops the children.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import wait as wait_any
from typing import Any, Iterator

import numpy as np

from .. import native
from .._system import fork_generation
from ..errors import ConfigError, LoaderClosedError, LoaderTimeoutError, WorkerError
from .proc_child import COUNTERS, child_main
from .process_errors import (child_imports, has_main_guard, killed_fix, main_references, main_script, rebuild,
                             out_of_files, signal_name, start_failure)
from .shared_slots import SharedBuffers, _posixshmem, check_shm_fits
from .slots import BatchRing, HandOut, Slot, row_shape
from .stats import LoaderStats

__all__ = ["ProcessRun", "SharedBuffers", "check_process_mode", "child_main", "process_run", "ring_slots",
           "thread_shares"]

_POLL_S = 0.1   # how often a blocked wait re-checks the stop flag and the children's liveness, seconds
_START_S = 60.0  # the least time a worker process is given to start (a fresh interpreter importing stoker)


# ---- what can cross ------------------------------------------------------------------------------
def check_process_mode(spec: Any, dataset: Any, *, device: Any, processes: int = 1) -> bytes:
    """Refuse, when the Loader is made, what the process mode cannot do, naming the fix; else the
    pickled RenderSpec the child is given."""
    from ..reader import PackedDataset

    what = f"Workers(processes={processes})"
    if _posixshmem is None:   # pragma: no cover - Windows
        raise ConfigError(f"{what} needs POSIX shared memory (Linux, macOS); drop processes=")
    from ..mainguard import unguarded_main_line

    unguarded = unguarded_main_line()   # before spawning: the child would run that line again and fail
    if unguarded is not None:
        raise ConfigError(f"{what} starts its worker processes with 'spawn', which runs your script "
                          f"again: line {unguarded[1]} of {unguarded[0]} is top-level code; put the training code "
                          f"under `if __name__ == \"__main__\":`, or use worker threads (Workers(processes=0))")
    if not isinstance(dataset, PackedDataset) and getattr(dataset, "process_path", None) is None:
        raise ConfigError(f"{what} reopens the dataset in each worker process, which needs a packed "
                          f"dataset on local storage (or staged with Storage(stage=)); {dataset.path} is not one: "
                          f"pack it first (stoker pack SRC OUT), or use worker threads (drop processes=)")
    if device is not None and getattr(device, "decode", "cpu") == "gpu":
        raise ConfigError(f"{what} renders on the CPU in its worker processes; decode='gpu' runs on the "
                          "training process's GPU: use DeviceOptions(decode='cpu'), or drop processes=")
    if multiprocessing.current_process().daemon:
        raise ConfigError(f"{what} starts a worker process, and this process "
                          f"({multiprocessing.current_process().name}) is daemonic (a multiprocessing.Pool or "
                          f"DataLoader worker), which may not have children: use worker threads here "
                          f"(Workers(processes=0), the default)")
    try:
        data = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ConfigError(f"{what} sends the transforms to its worker processes by pickling them, and "
                          f"one cannot be pickled ({type(exc).__name__}: {exc}); define a user transform at the top "
                          f"level of a module (not a lambda or a nested function), or use worker threads (drop "
                          f"processes=)") from None
    lost = [obj for obj in main_references(data) if not child_imports(obj)]
    if lost:
        name = getattr(lost[0], "__qualname__", repr(lost[0]))
        raise ConfigError(f"{what} sends the transforms to its worker processes by name, and {name!r} "
                          f"was defined in a notebook, `python -c` or the interactive prompt, which the worker process "
                          f"cannot import: move it into a .py module and import it from there (or define it at the "
                          f"top level of your script), or use worker threads (drop processes=)")
    return data


# ---- the parent's side -----------------------------------------------------------------------------
def ring_slots(prefetch: int, processes: int, extra: int) -> int:
    """Slots of a process mode ring: the thread mode's `prefetch + 2` (+ `extra` for a device stage)
    with one more per process beyond the first, so each child has a batch in the works while the
    caller holds one and `prefetch` wait ready."""
    return prefetch + 1 + processes + extra


def thread_shares(threads: int, processes: int) -> list[int]:
    """`threads` (all the children's together) shared out among `processes`, as evenly as they go,
    each at least one."""
    return [max(1, threads // processes + (i < threads % processes)) for i in range(processes)]


def process_run(parts: Any, dataset: Any, stats: LoaderStats, orders: list[tuple[int, np.ndarray, int]],
                sizes: list[int], threads: int, extra: int, open_ended: bool = False) -> "ProcessRun":
    """A pipeline's `ProcessRun` over a ring of its own in shared memory (`ring_slots`): each pipeline
    (one pass, or a persistent Loader's epochs in a row) starts its worker processes (no more than it
    has batches, unless epochs follow), which map the ring's segments as they are sent; then they are
    unlinked. `orders`: the pipeline's (epoch, indices, first sample) list, which `extend` finds the
    appended epochs in. `threads`: all the processes' worker threads together."""
    h, w = parts.spec.output_size
    n = max(1, parts.processes if open_ended else min(parts.processes, len(sizes)))
    slots = ring_slots(parts.prefetch, n, extra)
    check_shm_fits(slots, parts.batch_size, h, w, parts.spec.frames)
    ring = BatchRing(slots, parts.batch_size, h, w, label_dtype=parts.label_dtype,
                     pin_memory=parts.pin_memory, stats=stats,
                     buffers=SharedBuffers(parts.pin_memory, arrays=parts.buffers is not None),
                     frames=parts.spec.frames)
    where = getattr(dataset, "process_path", None) or str(dataset.path)   # a Mix: its sources
    return ProcessRun(ring, sizes, thread_shares(threads, n), spec=parts.child_spec, path=where, orders=orders,
                      stats=stats, timeout=parts.timeout, label_dtype=parts.label_dtype, open_ended=open_ended,
                      identities=dict(getattr(dataset, "_identities", {})), nice=parts.asked.workers.nice,
                      most=parts.asked.workers.max_threads)


@dataclass(eq=False)
class _Child:
    """One worker process as the parent knows it."""

    index: int
    process: Any
    conn: Any   # the parent's end of its pipe
    end: Any    # the child's end, closed here once it started
    started_at: float | None = None   # when it reported its first slots mapped
    counted: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))   # its counters already in stats
    skipped_keys: int = 0
    pool_threads: int = 0   # its engine pool's threads at its latest report
    known: set = field(default_factory=set)   # ids of the slots it has mapped (or has been sent)
    ended: bool = False   # exited, its exit seen


class ProcessRun(HandOut):
    """`slots.Run`'s part for the pass (`next_batch`, `guard`, `settle`, `stop`, ...) with the workers
    in child processes. Only the thread that asks for batches (the consumer, or the device thread)
    reads the pipes; `stop` may come from any thread."""

    def __init__(self, ring: BatchRing, batch_sizes: list[int], threads: list[int], *, spec: bytes,
                 path: str, orders: list[tuple[int, np.ndarray, int]], stats: LoaderStats, timeout: float,
                 label_dtype: Any, open_ended: bool = False, identities: dict | None = None,
                 nice: int | None = None, most: int | None = None) -> None:
        self.ring = ring
        # open_ended: epochs may be appended (`extend`, a persistent Loader): the children run on into them
        self.open_ended = open_ended
        self.orders = orders
        self.sent_orders = len(orders)
        self.buffers: SharedBuffers = ring.buffers   # type: ignore[assignment]
        ring.top_up()
        self.batch_sizes = list(batch_sizes)
        self.stats, self.timeout = stats, timeout
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.stop_event = threading.Event()
        self._generation = fork_generation()
        self.last_given: tuple[int, Slot] | None = None
        self.stalled: LoaderTimeoutError | None = None   # a slot's guard never completed
        self.ids: dict[Slot, int] = {}   # slot -> its id in the messages
        self.by_id: dict[int, Slot] = {}
        self.mapped: dict[int, int] = {}   # slot id -> how many children have mapped it
        self.next_send = 0   # the run batch the next free slot goes to (to that batch's child)
        self._send_lock = threading.Lock()
        ctx = multiprocessing.get_context("spawn")
        n = len(threads)
        self.children: list[_Child] = []
        initial: list[list[tuple]] = [[] for _ in range(n)]
        for slot in list(ring.free):   # slot k for run batch k, in its child's ring from the start
            sid = self._id(slot)
            child = self.next_send % n
            initial[child].append((sid, *self.buffers.segments[slot].ticket()))
            self.next_send += 1
        ring.free.clear()
        geometry = (ring.batch_size, row_shape(ring.height, ring.width, ring.frames))
        dtype = None if label_dtype is None else np.dtype(label_dtype).str
        for i in range(n):
            parent, end = ctx.Pipe(duplex=True)
            given = {"slots": initial[i], "geometry": geometry, "label_dtype": dtype}
            process = ctx.Process(target=child_main, args=(end, given), name="stoker-worker-process", daemon=True)
            child = _Child(i, process, parent, end)
            child.known.update(sid for sid, *_ in initial[i])
            self.children.append(child)
        # sent once a child has started (the spawn itself stays short); "part" added per child
        self.payload = {"spec": spec, "path": path, "orders": [(e, idx, start, len(self.batch_sizes))
                                                                for e, idx, start in orders],
                        "sizes": list(self.batch_sizes), "open_ended": open_ended, "identities": identities or {},
                        "timeout": timeout, "nice": nice,
                        # the pool's most threads in each child (`Workers(max_threads=)`, all the children's together)
                        "most": None if most is None else max(1, most // len(threads))}
        self.shares = threads
        self._started = False
        self._mark = -1   # this process's entry among the stoker processes (`start`)
        self.spawned_at = 0.0
        self.threads: list = []   # no threads of its own (passes count `alive()`)

    @property
    def process(self) -> Any:
        """The first worker process (the only one with processes=1)."""
        return self.children[0].process

    def _id(self, slot: Slot) -> int:
        sid = self.ids.get(slot)
        if sid is None:
            sid = self.ids[slot] = len(self.ids)
            self.by_id[sid] = slot
            self.mapped[sid] = 0
        return sid

    def _who(self, child: _Child) -> str:
        n = len(self.children)
        what = "stoker's worker process" if n == 1 else f"stoker's worker process {child.index + 1} of {n}"
        return f"{what} (pid {child.process.pid})"

    def extend(self, batch_sizes: list[int]) -> None:
        """Append an epoch's batches (an open-ended run); its order is the last of `orders`. Before the
        children start, they join what each is given; after, they are sent to each."""
        with self.cond:
            (epoch, indices, start), = self.orders[self.sent_orders:]
            self.sent_orders += 1
            self.batch_sizes.extend(batch_sizes)
            segment = (epoch, indices, start, len(batch_sizes))
            if not self._started:
                self.payload["orders"].append(segment)
                self.payload["sizes"].extend(batch_sizes)
            else:
                for child in self.children:
                    self._send(child, ("extend", segment, list(batch_sizes)))
            self.cond.notify_all()

    def _attached(self, child: _Child, sids: list[int]) -> None:
        """`child` has mapped these slots: once every child has, the parent drops their names and
        descriptors (each child that maps a slot later is sent a descriptor of its own)."""
        for sid in sids:
            self.mapped[sid] += 1
            if self.mapped[sid] >= len(self.children):
                self.buffers.segments[self.by_id[sid]].release()

    def _send_slot(self, child: _Child, sid: int) -> None:
        """Tell `child` slot `sid` is free; the first time it hears of it, how to map it (its memfd
        follows the message on the same socket)."""
        slot = self.by_id[sid]
        first = sid not in child.known
        segment = self.buffers.segments[slot] if first else None
        fd = None if segment is None else segment.fd
        child.known.add(sid)
        with self._send_lock:
            try:
                child.conn.send(("slot", sid, None if segment is None else segment.name,
                                 0 if segment is None else segment.nbytes, fd is not None))
                if fd is not None:
                    reduction.send_handle(child.conn, fd, child.process.pid)
            except (OSError, ValueError):   # the child is gone: the next receive says how
                pass

    def start(self) -> None:
        # under the lock: `extend` adds to the payload until the children have it, then sends instead; and
        # `stop` joins only children that did start (a failed start leaves nothing to join)
        with self.cond:
            self.spawned_at = time.monotonic()
            with _sigint_ignored():
                try:
                    for child in self.children:
                        child.process.start()
                        self._started = True
                except OSError as exc:
                    fix = out_of_files(exc)
                    if fix is None:
                        raise
                    raise WorkerError(fix) from exc
            n = len(self.children)
            for child, threads in zip(self.children, self.shares):
                self._send(child, ("payload", {**self.payload, "part": (child.index, n), "threads": threads}))
                child.end.close()   # the child holds its end: EOF here once it is gone
        self.payload = {}   # the children have their copies (the indices need not stay here)
        # this process (the training loop) among the stoker processes: the children's pools do not grow
        # against its CPU (csrc/crowd.h)
        self._mark = native.mark_process()

    # ---- consumer ---------------------------------------------------------------------------
    def _next_batch(self, b: int) -> Slot:
        # a child's start (a fresh interpreter importing stoker) is not the samples' time: the batch's
        # timeout runs from when its child has started, the start itself has a limit of its own
        child = self.children[b % len(self.children)]
        started = child.started_at is not None
        deadline = time.monotonic() + self.timeout if started else \
            self.spawned_at + max(self.timeout, _START_S)
        with self.cond:
            self.ring.reclaim()
        while True:
            if not started and child.started_at is not None:
                started, deadline = True, max(time.monotonic(), child.started_at) + self.timeout
            pending = self.settle()
            msg = self._receive(child, min(_POLL_S, max(deadline - time.monotonic(), 0)))
            if msg is not None:   # each child reports its batches in order; each call reads the next
                if msg[1] != b:
                    raise WorkerError(f"{self._who(child)} sent batch {msg[1]} when batch {b} was due; this "
                                      f"is a bug in stoker, please report it")
                break
            if self.stop_event.is_set():
                raise LoaderClosedError(f"the loader was closed while waiting for batch {b}")
            if self.stalled is not None:
                raise self.stalled
            if time.monotonic() >= deadline and not started:
                raise LoaderTimeoutError(
                    f"{self._who(child)} did not start within {max(self.timeout, _START_S):.0f} s; the machine may "
                    f"be overloaded — raise workers=stoker.Workers(timeout=...), use fewer processes "
                    f"(Workers(processes=...)), or worker threads (Workers(processes=0))")
            if time.monotonic() >= deadline and pending:   # the child waits for slots the GPU still reads
                what = next(s.guard.what for s in self.ring.free if s.guard is not None)
                raise LoaderTimeoutError(f"batch {b}: no free slot to write it into after {self.timeout:g} s: "
                                         f"{what} had not finished; the GPU may be hung or its copy engine "
                                         f"starved by other work")
            if time.monotonic() >= deadline:
                raise LoaderTimeoutError(
                    f"batch {b}: no complete batch after {self.timeout:.0f} s from {self._who(child)}, alive; "
                    f"storage may be stalled or a transform hangs — raise workers=stoker.Workers(timeout=...) "
                    f"if samples are genuinely this slow")
        if msg[0] == "error":
            raise rebuild(msg[2])
        _, _, sid, size, objects, extras, shape = msg
        slot = self.by_id[sid]
        slot.shape_rows(*shape)   # the child wrote the batch at this shape (aspect buckets: its bucket's)
        slot.batch, slot.size, slot.remaining = b, size, 0
        if slot.labels_np is None:
            slot.objects[:size] = objects
        slot.extras = extras
        with self.cond:
            self.ring.hand_out(slot)
            self.last_given = (b, slot)
        return slot

    def _receive(self, child: _Child, wait_s: float) -> tuple | None:
        """`child`'s next batch (or error) message, handling the others; None after `wait_s` without
        one. A child that has died (this one, or any other before its batches were done) raises
        WorkerError naming it."""
        end = time.monotonic() + wait_s
        while True:
            msg = ()   # nothing read yet (None: the pipe closed)
            watched = [c.process.sentinel for c in self.children if c is not child and not c.ended]
            ready = wait_any([child.conn, child.process.sentinel, *watched], max(end - time.monotonic(), 0))
            if child.conn in ready:
                try:
                    msg = child.conn.recv()
                except (EOFError, OSError):   # the child's end closed: it is exiting
                    msg = None
                    child.process.join(1.0)
                if msg is not None:
                    kind = msg[0]
                    if kind == "attached":
                        if child.started_at is None:
                            child.started_at = time.monotonic()
                        self._attached(child, msg[1])
                        continue
                    if kind == "refused":   # the dataset is not the one this process opened
                        raise rebuild(msg[1])
                    if kind == "fatal":
                        raise WorkerError(f"{self._who(child)} failed outside any sample: {msg[1]}")
                    self._count(child, msg[-1])
                    return msg[:-1]
            if msg is None or not child.process.is_alive() or \
                    (child.process.sentinel in ready and not child.conn.poll()):
                raise self._died(child)
            for other in self.children:   # another child gone: an exit 0 is one done with its batches
                if other is not child and other.process.sentinel in ready:
                    other.process.join(1.0)
                    other.ended = True
                    if other.process.exitcode != 0:
                        raise self._died(other)
            if not ready or time.monotonic() >= end:
                return None

    def _died(self, child: _Child) -> WorkerError:
        """The error for a child that exited before its batches were done: who, how, and what to do."""
        child.process.join(1.0)
        try:   # what it sent before it died: whether it had started (its batches no longer matter)
            while child.started_at is None and child.conn.poll():
                if child.conn.recv()[0] == "attached":
                    child.started_at = time.monotonic()
        except (EOFError, OSError):
            pass
        code, who = child.process.exitcode, self._who(child)
        if child.started_at is None:   # it never mapped its slots: it failed while starting
            return WorkerError(start_failure(code, child.process.pid, has_main_guard(main_script()), who))
        how = f"was killed by {signal_name(-code)} (exit code {code})" if code is not None and code < 0 else \
            f"exited with code {code}"
        fix = killed_fix(-code) if code is not None and code < 0 else \
            "use worker threads (Workers(processes=0)) to see the failure in this process"
        others = "" if len(self.children) == 1 else "; the other worker processes are stopped with it"
        return WorkerError(f"{who} {how} before its batches were done; the pass is over{others}: start a new "
                           f"one. {fix[0].upper()}{fix[1:]}")

    def _count(self, child: _Child, counters: dict) -> None:
        """Add what `child` counted since its last report to the Loader's stats."""
        stats = self.stats
        for k in COUNTERS:
            delta = counters[k] - child.counted[k]
            child.counted[k] = counters[k]
            setattr(stats, k, getattr(stats, k) + (int(delta) if k in ("samples", "skipped") else delta))
        child.pool_threads = counters.get("pool_threads", 0)   # a figure of now: the children's together
        pool = sum(c.pool_threads for c in self.children)
        if pool:
            stats.pool_threads, stats.pool_threads_peak = pool, max(stats.pool_threads_peak, pool)
        keys = counters["skipped_keys"]
        new, child.skipped_keys = keys[child.skipped_keys:], len(keys)
        if new and len(stats.skipped_keys) < 100:
            stats.skipped_keys.extend(new[:100 - len(stats.skipped_keys)])

    def settle(self) -> bool:
        """Send every free slot whose guard has passed to the child of the next run batch without one
        (this thread is the CUDA actor, as in `Run.settle`); True while some guard is still pending. In
        a run that ends, slots past its last batch stay here."""
        pending, send = False, []
        n = len(self.children)
        with self.cond:
            keep: deque[Slot] = deque()
            for slot in self.ring.free:
                if slot.guard is not None and not slot.guard.done():
                    if time.perf_counter() - slot.guarded_at > self.timeout and self.stalled is None:
                        self.stalled = LoaderTimeoutError(
                            f"a batch slot cannot be refilled: {slot.guard.what} had not finished after "
                            f"{self.timeout:g} s; the GPU may be hung or its copy engine starved by other work")
                    keep.append(slot)
                    pending = True
                elif self.open_ended or self.next_send < len(self.batch_sizes):
                    slot.guard = None
                    send.append((self.children[self.next_send % n], self._id(slot)))
                    self.next_send += 1
                else:
                    slot.guard = None
                    keep.append(slot)
            self.ring.free = keep
        for child, sid in send:
            self._send_slot(child, sid)
        return pending

    def _send(self, child: _Child, msg: tuple) -> None:
        with self._send_lock:
            try:
                child.conn.send(msg)
            except (OSError, ValueError):   # the child is gone: the next receive says how
                pass

    def stop(self, join_timeout: float = 5.0, give_back: bool = True) -> None:
        """Stop the children (asked, then terminated, then killed, each bounded) and remove every shared
        memory name left. Safe to call repeatedly, from any thread. A fork()ed child of the training
        process leaves them alone: they are its parent's children, and their memory its parent's to unlink."""
        if self.forked:
            return
        self.stop_event.set()
        with self.lock:
            mark, self._mark = self._mark, -1
        native.unmark_process(mark)
        started = [c for c in self.children if c.process.pid is not None] if self._started else []
        for child in started:
            self._send(child, ("stop",))
        deadline = time.monotonic() + join_timeout
        for child in started:
            child.process.join(max(0.0, deadline - time.monotonic()))
        for child in started:
            if child.process.is_alive():
                child.process.terminate()
        for child in started:
            child.process.join(1.0)
            if child.process.is_alive():
                child.process.kill()
                child.process.join(1.0)
        for child in self.children:
            try:
                child.conn.close()
                child.end.close()
            except OSError:
                pass
        self.buffers.unlink_all()

    def give_back(self) -> None:
        """The slots the children held are not returned to the ring: each pass has a ring of its own."""

    def alive(self) -> int:
        return sum(c.process.is_alive() for c in self.children if c.process.pid is not None) if self._started else 0


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while a child is spawned (the main thread only): an ignored signal stays ignored
    across exec, so the child's interpreter never installs its KeyboardInterrupt handler, and a Ctrl-C
    to the process group while it starts (seconds: it imports the main script and stoker) cannot kill
    it; the training script decides. The spawn itself (fork and exec, the payload follows on the
    pipe) takes milliseconds, the one window in which this process would miss a Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:   # set outside Python: it could not be put back
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


