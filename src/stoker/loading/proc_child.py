"""The worker process's side of the process mode (`procs.py`): the thread mode's `Run` and `Filler`
over the shared slots the training process sends, reporting each finished batch in order.

With `Workers(processes=N)`, worker process i of N renders the run's batches i, i + N, i + 2N, ...
(its local batch j is run batch i + j*N). Every batch's pixels, labels and replacements are pure
functions of (seed, epoch, sample, position), never of which thread or process renders it, so the
batches are the thread mode's bit for bit whatever N. The training process sends each free slot to the
process that renders the next batch still without one, in run order, so the process whose batch is
due always gets a slot (no process can hold the slots another one needs).
"""

from __future__ import annotations

import mmap
import pickle
import signal
import threading
import traceback
from collections import deque
from multiprocessing import reduction
from typing import Any

import numpy as np

from ..errors import LoaderClosedError, ShardError
from .shared_slots import attach, views
from .slots import Run, Slot
from .stats import LoaderStats

__all__ = ["COUNTERS", "POLL_S", "child_main", "portable"]

POLL_S = 0.1   # how often a blocked wait re-checks the stop flag, seconds
#: what the child adds up and sends with each batch (LoaderStats fields)
COUNTERS = ("samples", "skipped", "read_s", "decode_s", "augment_s", "worker_wait_s")


def portable(exc: BaseException | None, depth: int = 0) -> dict | None:
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
            "cause": portable(exc.__cause__, depth + 1)}


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
    after its last batch. Ignores SIGINT (from its start on, see `procs._sigint_ignored`): the parent
    decides."""
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
    from .engine import run_claims
    from .render import EpochChain, Filler

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
    me, n = payload["part"]   # this is worker process `me` of `n`: run batches me, me + n, ...
    spec = pickle.loads(payload["spec"])
    dataset = open_in_process(payload["path"])   # a packed folder, or a Mix of them
    try:
        _same_dataset(dataset, payload["identities"])
    except ShardError as exc:
        dataset.close()
        conn.send(("refused", portable(exc)))
        return
    chain = EpochChain(spec)
    first = [0]   # the run batch the next epoch's batches start at
    sizes: list[int] = list(payload["sizes"])   # every run batch's size (all processes')

    def add(epoch: int, indices: np.ndarray, start: int, batches: int) -> None:
        chain.add(Filler(spec, dataset, epoch, indices, start), first[0])
        first[0] += batches

    def prepare(j: int, slot: Slot) -> Any:   # local batch j is run batch me + j*n
        return chain.prepare(me + j * n, slot)

    for segment in payload["orders"]:
        add(*segment)
    stats = LoaderStats()
    run = Run(ring, sizes[me::n], payload["threads"], prepare, chain.fill, stats.add, payload["timeout"],
              name="stoker-process", open_ended=payload["open_ended"],
              **run_claims(spec, chain, payload["threads"], payload["timeout"], nice=payload.get("nice"),
                         most=payload.get("most")))
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
                        sizes.extend(msg[2])
                        run.extend(sizes[me::n][len(run.batch_sizes):])
                    continue
                _, sid, name, nbytes, has_fd = msg
                fd = reduction.recv_handle(conn) if has_fd else None
                slot = slots[sid] if name is None else add_slot(sid, name, nbytes, fd)
                if name is not None:
                    send(("attached", [sid], None))
                with run.cond:
                    ring.free.append(slot)
                    run.cond.notify_all()
                    run.slot_cond.notify_all()   # the workers waiting for a slot
        except (EOFError, OSError):
            pass
        run.stop(join_timeout=2.0, give_back=False)

    listener = threading.Thread(target=listen, name="stoker-process-pipe", daemon=True)
    listener.start()
    run.start()

    def counters() -> dict:
        with run.lock:
            out = {k: getattr(stats, k) for k in COUNTERS}
            out["skipped_keys"] = list(stats.skipped_keys)
            out["pool_threads"] = stats.pool_threads   # not a counter: the pool's size now
        return out

    try:
        b = -1
        while True:
            b += 1
            with run.cond:   # the batch gets a slot once the parent frees one (and, open-ended, once it exists):
                # waiting for the consumer is no fault
                while b not in run.assigned and not run.stop_event.is_set() and \
                        (run.open_ended or b < len(run.batch_sizes)):
                    run.cond.wait(POLL_S)
                if b >= len(run.batch_sizes) or run.stop_event.is_set():
                    break
            g = me + b * n   # the run batch
            try:
                slot = run.next_batch(b)
            except LoaderClosedError:
                break
            except BaseException as exc:   # a sample's error, a timeout: the parent raises it in order
                send(("error", g, portable(exc), counters()))
                break
            count = slot.size
            objects = list(slot.objects[:count]) if slot.labels_np is None else None
            # the batch's row shape too: an aspect bucket's batch is viewed at its own (Slot.shape_rows)
            send(("batch", g, ids[id(slot)], count, objects, slot.extras, tuple(slot.images.shape[1:3]), counters()))
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
