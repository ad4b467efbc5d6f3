"""The process mode (`Workers(processes=1)`): the worker threads in one child process, writing into
ring slots in shared memory that the training process hands out as zero-copy batches.

Why: a worker thread still runs some Python per sample under the GIL (planning, a user transform,
PyAV's per-frame loop for clips), and the training loop's own Python (kernel dispatch) waits for the
same lock. In a child process those workers have a GIL of their own; the pixels still travel no
further than the ring, because the ring's slots are shared memory both processes map.

Who does what:

- The parent keeps the ring (`slots.BatchRing`, its slots made by `shared_slots.SharedBuffers`: one
  shared memory segment per slot, pinned with `cudaHostRegister` when CUDA is present) and every rule about
  it: a slot goes back to the child only once nothing references it and its guard fence has passed.
  `ProcessRun` is what the pass talks to in place of `slots.Run`, with the same methods.
- The child (`child_main`, started with the "spawn" context: never a fork of a threaded parent) gets
  the frozen `RenderSpec` (pickled), the dataset's path, the epoch's indices and the slots' names; it
  runs the same `slots.Run` and `render.Filler` as the thread mode, over a ring whose free slots are
  only those the parent sent (`_ChildRing`).
- The pipe between them carries small messages only: parent to child "slot k is free" (with its
  segment's name the first time), "extend" (a persistent Loader's next epoch: its indices) and
  "stop"; child to parent "attached", "batch b is in slot k" (with its size, the labels that are not
  numbers, the extra columns and the workers' counters) and errors with their traceback text.

Shared memory never outlives its pass (or a persistent Loader's run of epochs, which one child serves):
on Linux it has no name at all (see `shared_slots`), so no kill leaves anything in /dev/shm. The
memory itself lives while either process maps it. A child that dies (killed, out of memory) is an
error in the consumer naming its pid and how it died, found within the Loader's timeout, never a
hang; one that dies while starting is told apart from a script without a `__main__` guard.

The child ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and the training
script decides (it may catch it and finish its epoch, as with threads); the parent stops the child.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import signal
import threading
import time
import traceback
from collections import deque
from multiprocessing import reduction
from multiprocessing.connection import wait as wait_any
from typing import Any, Iterator

import numpy as np

from ..errors import ConfigError, LoaderClosedError, LoaderTimeoutError, ShardError, WorkerError
from .process_errors import (child_imports, has_main_guard, killed_fix, main_references, main_script, rebuild,
                             signal_name, start_failure)
from .shared_slots import SharedBuffers, _posixshmem, attach, check_shm_fits, views
from .slots import BatchRing, HandOut, Run, Slot, row_shape
from .stats import LoaderStats

__all__ = ["ProcessRun", "SharedBuffers", "check_process_mode", "child_main", "process_run"]

_POLL_S = 0.1   # how often a blocked wait re-checks the stop flag and the child's liveness, seconds
_START_S = 60.0  # the least time a worker process is given to start (a fresh interpreter importing stoker)
#: what the child adds up and sends with each batch (LoaderStats fields)
_COUNTERS = ("samples", "skipped", "read_s", "decode_s", "augment_s", "worker_wait_s")


# ---- errors across the boundary -------------------------------------------------------------------
def _portable(exc: BaseException | None, depth: int = 0) -> dict | None:
    """An exception as plain data: its class, args, attributes, traceback text and cause."""
    if exc is None or depth > 4:
        return None
    state = {}
    for k, v in vars(exc).items():
        try:
            pickle.dumps(v)
            state[k] = v
        except Exception:
            state[k] = repr(v)
    try:
        pickle.dumps(exc.args)
        args: tuple = exc.args
    except Exception:
        args = (str(exc),)
    return {"cls": (type(exc).__module__, type(exc).__qualname__), "args": args, "state": state,
            "tb": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, chain=False)),
            "cause": _portable(exc.__cause__, depth + 1)}


# ---- what can cross ------------------------------------------------------------------------------
def check_process_mode(spec: Any, dataset: Any, *, device: Any) -> bytes:
    """Refuse, when the Loader is made, what the process mode cannot do, naming the fix; else the
    pickled RenderSpec the child is given."""
    from ..reader import PackedDataset

    if _posixshmem is None:   # pragma: no cover - Windows
        raise ConfigError("Workers(processes=1) needs POSIX shared memory (Linux, macOS); drop processes=")
    from ..mainguard import unguarded_main_line

    unguarded = unguarded_main_line()   # before spawning: the child would run that line again and fail
    if unguarded is not None:
        raise ConfigError(f"Workers(processes=1) starts its worker process with 'spawn', which runs your script "
                          f"again: line {unguarded[1]} of {unguarded[0]} is top-level code; put the training code "
                          f"under `if __name__ == \"__main__\":`, or use worker threads (Workers(processes=0))")
    if not isinstance(dataset, PackedDataset) and getattr(dataset, "process_path", None) is None:
        raise ConfigError(f"Workers(processes=1) reopens the dataset in its worker process, which needs a packed "
                          f"dataset on local storage (or staged with Storage(stage=)); {dataset.path} is not one: "
                          f"pack it first (stoker pack SRC OUT), or use worker threads (drop processes=)")
    if device is not None and getattr(device, "decode", "cpu") == "gpu":
        raise ConfigError("Workers(processes=1) renders on the CPU in its worker process; decode='gpu' runs on the "
                          "training process's GPU: use DeviceOptions(decode='cpu'), or drop processes=")
    if multiprocessing.current_process().daemon:
        raise ConfigError(f"Workers(processes=1) starts a worker process, and this process "
                          f"({multiprocessing.current_process().name}) is daemonic (a multiprocessing.Pool or "
                          f"DataLoader worker), which may not have children: use worker threads here "
                          f"(Workers(processes=0), the default)")
    try:
        data = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ConfigError(f"Workers(processes=1) sends the transforms to its worker process by pickling them, and "
                          f"one cannot be pickled ({type(exc).__name__}: {exc}); define a user transform at the top "
                          f"level of a module (not a lambda or a nested function), or use worker threads (drop "
                          f"processes=)") from None
    lost = [obj for obj in main_references(data) if not child_imports(obj)]
    if lost:
        name = getattr(lost[0], "__qualname__", repr(lost[0]))
        raise ConfigError(f"Workers(processes=1) sends the transforms to its worker process by name, and {name!r} "
                          f"was defined in a notebook, `python -c` or the interactive prompt, which the worker process "
                          f"cannot import: move it into a .py module and import it from there (or define it at the "
                          f"top level of your script), or use worker threads (drop processes=)")
    return data


# ---- the parent's side -----------------------------------------------------------------------------
def process_run(parts: Any, dataset: Any, stats: LoaderStats, orders: list[tuple[int, np.ndarray, int]],
                sizes: list[int], threads: int, extra: int, open_ended: bool = False) -> "ProcessRun":
    """A pipeline's `ProcessRun` over a ring of its own in shared memory (`prefetch + 2 + extra` slots):
    each pipeline (one pass, or a persistent Loader's epochs in a row) starts a worker process, which
    maps the ring's segments once and then they are unlinked. `orders`: the pipeline's (epoch, indices,
    first sample) list, which `extend` finds the appended epochs in."""
    h, w = parts.spec.output_size
    check_shm_fits(parts.prefetch + 2 + extra, parts.batch_size, h, w, parts.spec.frames)
    ring = BatchRing(parts.prefetch + 2 + extra, parts.batch_size, h, w, label_dtype=parts.label_dtype,
                     pin_memory=parts.pin_memory, stats=stats,
                     buffers=SharedBuffers(parts.pin_memory, arrays=parts.buffers is not None),
                     frames=parts.spec.frames)
    where = getattr(dataset, "process_path", None) or str(dataset.path)   # a Mix: its sources
    return ProcessRun(ring, sizes, threads, spec=parts.child_spec, path=where, orders=orders,
                      stats=stats, timeout=parts.timeout, label_dtype=parts.label_dtype, open_ended=open_ended,
                      identities=dict(getattr(dataset, "_identities", {})))


class ProcessRun(HandOut):
    """`slots.Run`'s part for the pass (`next_batch`, `guard`, `settle`, `stop`, ...) with the workers
    in a child process. Only the thread that asks for batches (the consumer, or the device thread)
    reads the pipe; `stop` may come from any thread."""

    def __init__(self, ring: BatchRing, batch_sizes: list[int], num_threads: int, *, spec: bytes,
                 path: str, orders: list[tuple[int, np.ndarray, int]], stats: LoaderStats, timeout: float,
                 label_dtype: Any, open_ended: bool = False, identities: dict | None = None) -> None:
        self.ring = ring
        # open_ended: epochs may be appended (`extend`, a persistent Loader): the child runs on into them
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
        self.last_given: tuple[int, Slot] | None = None
        self.stalled: LoaderTimeoutError | None = None   # a slot's guard never completed
        self.ids: dict[Slot, int] = {}   # slot -> its id in the messages
        self.by_id: dict[int, Slot] = {}
        self.counted = dict.fromkeys(_COUNTERS, 0.0)   # the child's counters already added to `stats`
        self.skipped_keys = 0
        self._send_lock = threading.Lock()
        initial = [(sid, *self.buffers.segments[self.by_id[sid]].ticket())
                   for sid, _, _ in map(self._describe, list(ring.free))]
        ring.free.clear()
        parent, child = multiprocessing.get_context("spawn").Pipe(duplex=True)
        self.conn = parent
        segments = [(e, idx, start, len(self.batch_sizes)) for e, idx, start in orders]
        payload = {"spec": spec, "path": path, "orders": segments, "sizes": list(self.batch_sizes),
                   "open_ended": open_ended, "identities": identities or {},
                   "threads": num_threads, "timeout": timeout}
        slots = {"slots": initial, "geometry": (ring.batch_size, row_shape(ring.height, ring.width, ring.frames)),
                 "label_dtype": None if label_dtype is None else np.dtype(label_dtype).str}
        self.process = multiprocessing.get_context("spawn").Process(
            target=child_main, args=(child, slots), name="stoker-worker-process", daemon=True)
        self._child_end = child
        self.payload = payload   # sent once the child has started (the spawn itself stays short)
        self._initial = [sid for sid, _, _, _ in initial]   # their descriptors go to the child at its start
        self._started = False
        self.spawned_at = 0.0
        self.started_at: float | None = None   # when the child reported its slots mapped
        self.threads: list = []   # no threads of its own (passes count `alive()`)

    def extend(self, batch_sizes: list[int]) -> None:
        """Append an epoch's batches (an open-ended run); its order is the last of `orders`. Before the
        child starts, they join what it is given; after, they are sent."""
        with self.cond:
            (epoch, indices, start), = self.orders[self.sent_orders:]
            self.sent_orders += 1
            self.batch_sizes.extend(batch_sizes)
            segment = (epoch, indices, start, len(batch_sizes))
            if not self._started:
                self.payload["orders"].append(segment)
                self.payload["sizes"].extend(batch_sizes)
            else:
                self._send(("extend", segment, list(batch_sizes)))
            self.cond.notify_all()

    def _describe(self, slot: Slot) -> tuple[int, str | None, int]:
        """(id, segment name the first time the child hears of it, else None, segment bytes)."""
        sid = self.ids.get(slot)
        if sid is None:
            sid = self.ids[slot] = len(self.ids)
            self.by_id[sid] = slot
            segment = self.buffers.segments[slot]
            return sid, segment.name, segment.nbytes
        return sid, None, 0

    def _send_slot(self, sid: int, name: str | None, nbytes: int) -> None:
        """Tell the child slot `sid` is free; the first time, how to map it (its memfd follows the
        message on the same socket)."""
        segment = None if name is None else self.buffers.segments[self.by_id[sid]]
        fd = None if segment is None else segment.fd
        with self._send_lock:
            try:
                self.conn.send(("slot", sid, name, nbytes, fd is not None))
                if fd is not None:
                    reduction.send_handle(self.conn, fd, self.process.pid)
            except (OSError, ValueError):   # the child is gone: the next receive says how
                pass
        if segment is not None and fd is not None:
            segment.release()   # the child has its own descriptor now (or is gone)

    def start(self) -> None:
        # under the lock: `extend` adds to the payload until the child has it, then sends instead; and
        # `stop` joins only a child that did start (a failed start leaves nothing to join)
        with self.cond:
            self.spawned_at = time.monotonic()
            with _sigint_ignored():
                self.process.start()
            self._started = True
            for sid in self._initial:   # the child inherited their descriptors
                self.buffers.segments[self.by_id[sid]].release()
            self._send(("payload", self.payload))
        self._child_end.close()   # the child holds its end: EOF here once it is gone
        self.payload = {}   # the child has its copy (the indices need not stay here)

    # ---- consumer ---------------------------------------------------------------------------
    def _next_batch(self, b: int) -> Slot:
        # the child's start (a fresh interpreter importing stoker) is not the samples' time: the batch's
        # timeout runs from when the child has started, the start itself has a limit of its own
        started = self.started_at is not None
        deadline = time.monotonic() + self.timeout if started else \
            self.spawned_at + max(self.timeout, _START_S)
        with self.cond:
            self.ring.reclaim()
        while True:
            if not started and self.started_at is not None:
                started, deadline = True, max(time.monotonic(), self.started_at) + self.timeout
            pending = self.settle()
            msg = self._receive(min(_POLL_S, max(deadline - time.monotonic(), 0)))
            if msg is not None:   # the child reports its batches in order; each call reads the next
                if msg[1] != b:
                    raise WorkerError(f"stoker's worker process sent batch {msg[1]} when batch {b} was due; this "
                                      f"is a bug in stoker, please report it")
                break
            if self.stop_event.is_set():
                raise LoaderClosedError(f"the loader was closed while waiting for batch {b}")
            if self.stalled is not None:
                raise self.stalled
            if time.monotonic() >= deadline and not started:
                raise LoaderTimeoutError(
                    f"stoker's worker process (pid {self.process.pid}) did not start within "
                    f"{max(self.timeout, _START_S):.0f} s; the machine may be overloaded — raise "
                    f"workers=stoker.Workers(timeout=...), or use worker threads (Workers(processes=0))")
            if time.monotonic() >= deadline and pending:   # the child waits for slots the GPU still reads
                what = next(s.guard.what for s in self.ring.free if s.guard is not None)
                raise LoaderTimeoutError(f"batch {b}: no free slot to write it into after {self.timeout:g} s: "
                                         f"{what} had not finished; the GPU may be hung or its copy engine "
                                         f"starved by other work")
            if time.monotonic() >= deadline:
                raise LoaderTimeoutError(
                    f"batch {b}: no complete batch after {self.timeout:.0f} s from stoker's worker process "
                    f"(pid {self.process.pid}, alive); storage may be stalled or a transform hangs — raise "
                    f"workers=stoker.Workers(timeout=...) if samples are genuinely this slow")
        kind = msg[0]
        if kind == "error":
            raise rebuild(msg[2])
        _, _, sid, size, objects, extras = msg
        slot = self.by_id[sid]
        slot.batch, slot.size, slot.remaining = b, size, 0
        if slot.labels_np is None:
            slot.objects[:size] = objects
        slot.extras = extras
        with self.cond:
            self.ring.hand_out(slot)
            self.last_given = (b, slot)
        return slot

    def _receive(self, wait_s: float) -> tuple | None:
        """The child's next batch (or error) message, handling the others; None after `wait_s`
        without one. A child that has died raises WorkerError naming it."""
        end = time.monotonic() + wait_s
        while True:
            msg = ()   # nothing read yet (None: the pipe closed)
            ready = wait_any([self.conn, self.process.sentinel], max(end - time.monotonic(), 0))
            if self.conn in ready:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):   # the child's end closed: it is exiting
                    msg = None
                    self.process.join(1.0)
                if msg is not None:
                    kind = msg[0]
                    if kind == "attached":
                        if self.started_at is None:
                            self.started_at = time.monotonic()
                        for sid in msg[1]:
                            self.buffers.segments[self.by_id[sid]].release()
                        continue
                    if kind == "refused":   # the dataset is not the one this process opened
                        raise rebuild(msg[1])
                    if kind == "fatal":
                        raise WorkerError(f"stoker's worker process (pid {self.process.pid}) failed outside any "
                                          f"sample: {msg[1]}")
                    self._count(msg[-1])
                    return msg[:-1]
            if msg is None or not self.process.is_alive() or \
                    (self.process.sentinel in ready and not self.conn.poll()):
                self.process.join(1.0)
                code, pid = self.process.exitcode, self.process.pid
                if self.started_at is None:   # it never mapped its slots: it failed while starting
                    raise WorkerError(start_failure(code, pid, has_main_guard(main_script())))
                how = f"was killed by {signal_name(-code)} (exit code {code})" if code is not None and code < 0 else \
                    f"exited with code {code}"
                fix = killed_fix(-code) if code is not None and code < 0 else \
                    "use worker threads (Workers(processes=0)) to see the failure in this process"
                raise WorkerError(f"stoker's worker process (pid {pid}) {how} before its batches were done; the "
                                  f"pass is over: start a new one. {fix[0].upper()}{fix[1:]}")
            if not ready or time.monotonic() >= end:
                return None

    def _count(self, counters: dict) -> None:
        """Add what the child counted since its last report to the Loader's stats."""
        stats = self.stats
        for k in _COUNTERS:
            delta = counters[k] - self.counted[k]
            self.counted[k] = counters[k]
            setattr(stats, k, getattr(stats, k) + (int(delta) if k in ("samples", "skipped") else delta))
        keys = counters["skipped_keys"]
        new, self.skipped_keys = keys[self.skipped_keys:], len(keys)
        if new and len(stats.skipped_keys) < 100:
            stats.skipped_keys.extend(new[:100 - len(stats.skipped_keys)])

    def settle(self) -> bool:
        """Send the child every free slot whose guard has passed (this thread is the CUDA actor, as in
        `Run.settle`); True while some guard is still pending."""
        pending, send = False, []
        with self.cond:
            keep: deque[Slot] = deque()
            for slot in self.ring.free:
                if slot.guard is not None and not slot.guard.done():
                    if time.monotonic() - slot.guarded_at > self.timeout and self.stalled is None:
                        self.stalled = LoaderTimeoutError(
                            f"a batch slot cannot be refilled: {slot.guard.what} had not finished after "
                            f"{self.timeout:g} s; the GPU may be hung or its copy engine starved by other work")
                    keep.append(slot)
                    pending = True
                else:
                    slot.guard = None
                    send.append(self._describe(slot))
            self.ring.free = keep
        for item in send:
            self._send_slot(*item)
        return pending

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):   # the child is gone: the next receive says how
                pass

    def stop(self, join_timeout: float = 5.0, give_back: bool = True) -> None:
        """Stop the child (asked, then terminated, then killed, each bounded) and remove every shared
        memory name left. Safe to call repeatedly, from any thread."""
        self.stop_event.set()
        if self._started:
            self._send(("stop",))
            self.process.join(join_timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(1.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(1.0)
        try:
            self.conn.close()
            self._child_end.close()
        except OSError:
            pass
        self.buffers.unlink_all()

    def give_back(self) -> None:
        """The slots the child held are not returned to the ring: each pass has a ring of its own."""

    def alive(self) -> int:
        return int(self._started and self.process.is_alive())


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


# ---- the child's side ------------------------------------------------------------------------------
class _ChildRing:
    """What `slots.Run` needs of a ring, in the worker process: the slots the parent said are free.
    The parent decides when a slot is free (it alone sees the caller's references and GPU copies)."""

    def __init__(self) -> None:
        self.free: deque[Slot] = deque()

    def top_up(self) -> None:
        pass

    def reclaim(self) -> bool:
        return False

    def hand_out(self, slot: Slot) -> None:
        pass


def child_main(conn: Any, payload: dict) -> None:
    """The worker process: the thread mode's `Run` and `Filler` over the shared slots, reporting each
    finished batch to the parent in order. Ends on "stop", on the pipe closing (the parent is gone), or
    after the last batch. Ignores SIGINT (from its start on, see `_sigint_ignored`): the parent decides."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _child(conn, payload)
    except BaseException:
        try:
            conn.send(("fatal", traceback.format_exc()))
        except Exception:
            pass
    finally:
        conn.close()


def _child(conn: Any, payload: dict) -> None:
    from ..mix import open_in_process
    from .render import EpochChain, Filler, native_claims

    batch_size, shape = payload["geometry"]
    label_dtype = None if payload["label_dtype"] is None else np.dtype(payload["label_dtype"])
    maps: list[mmap.mmap] = []
    slots: dict[int, Slot] = {}
    ids: dict[int, int] = {}   # id(slot) -> its id in the messages

    def add_slot(sid: int, name: str, nbytes: int, fd: int | None) -> Slot:
        mm = attach(name, nbytes, fd)
        maps.append(mm)
        img, lab = views(mm, batch_size, shape, label_dtype)
        slot = Slot(img, img, None, lab, objects=[None] * batch_size)   # numpy rows: no torch needed to write
        slots[sid], ids[id(slot)] = slot, sid
        return slot

    ring = _ChildRing()
    for sid, name, nbytes, fd in payload["slots"]:
        ring.free.append(add_slot(sid, name, nbytes, fd))
    conn.send(("attached", [sid for sid, _, _, _ in payload["slots"]], None))
    msg = conn.recv()   # the rest of what it needs, sent once it started ("stop": the pass ended first)
    if msg[0] != "payload":
        return
    payload = {**payload, **msg[1]}
    spec = pickle.loads(payload["spec"])
    dataset = open_in_process(payload["path"])   # a packed folder, or a Mix of them
    try:
        _same_dataset(dataset, payload["identities"])
    except ShardError as exc:
        dataset.close()
        conn.send(("refused", _portable(exc)))
        return
    chain = EpochChain(spec)
    first = [0]   # the run batch the next epoch's batches start at

    def add(epoch: int, indices: np.ndarray, start: int, batches: int) -> None:
        chain.add(Filler(spec, dataset, epoch, indices, start), first[0])
        first[0] += batches

    for segment in payload["orders"]:
        add(*segment)
    stats = LoaderStats()
    run = Run(ring, payload["sizes"], payload["threads"], chain.prepare, chain.fill, stats.add, payload["timeout"],
              name="stoker-process", open_ended=payload["open_ended"], **native_claims(spec, chain, payload["threads"], payload["timeout"]))
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    def listen() -> None:   # the parent's messages: free slots, stop; EOF when the parent is gone
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                if msg[0] == "extend":   # a persistent Loader's next epoch
                    with run.cond:
                        add(*msg[1])
                        run.extend(msg[2])
                    continue
                _, sid, name, nbytes, has_fd = msg
                fd = reduction.recv_handle(conn) if has_fd else None
                slot = slots[sid] if name is None else add_slot(sid, name, nbytes, fd)
                if name is not None:
                    send(("attached", [sid], None))
                with run.cond:
                    ring.free.append(slot)
                    run.cond.notify_all()
        except (EOFError, OSError):
            pass
        run.stop(join_timeout=2.0, give_back=False)

    listener = threading.Thread(target=listen, name="stoker-process-pipe", daemon=True)
    listener.start()
    run.start()

    def counters() -> dict:
        with run.lock:
            out = {k: getattr(stats, k) for k in _COUNTERS}
            out["skipped_keys"] = list(stats.skipped_keys)
        return out

    try:
        b = -1
        while True:
            b += 1
            with run.cond:   # the batch gets a slot once the parent frees one (and, open-ended, once it exists):
                # waiting for the consumer is no fault
                while b not in run.assigned and not run.stop_event.is_set() and \
                        (run.open_ended or b < len(run.batch_sizes)):
                    run.cond.wait(_POLL_S)
                if b >= len(run.batch_sizes) or run.stop_event.is_set():
                    break
            try:
                slot = run.next_batch(b)
            except LoaderClosedError:
                break
            except BaseException as exc:   # a sample's error, a timeout: the parent raises it in order
                send(("error", b, _portable(exc), counters()))
                break
            n = slot.size
            objects = list(slot.objects[:n]) if slot.labels_np is None else None
            send(("batch", b, ids[id(slot)], n, objects, slot.extras, counters()))
    finally:
        run.stop(join_timeout=2.0, give_back=False)
        listener.join(2.0)
        dataset.close()


def _same_dataset(dataset: Any, identities: dict) -> None:
    """Refuse a dataset that is not the one the parent opened (a folder replaced by a new pack between
    epochs): its labels and sample order came from the parent's copy. Each read is then checked
    against the parent's shards, as the threads check theirs, so a change is the same ShardError."""
    if not identities:
        return
    ours = getattr(dataset, "_identities", {})
    for shard in sorted(set(identities) | set(ours)):
        if shard not in identities:   # a shard the parent never opened: the whole pack was replaced
            path = dataset.storage.join(shard)
            raise ShardError(f"{path}: the dataset was replaced by another pack after it was opened; reopen the "
                             "dataset (a new Loader) to read the new one", path=path)
    dataset._identities = dict(identities)
