"""The process mode's batch slots in shared memory: each slot's images (and numeric labels) in one
segment that the training process and its worker process both map (`SharedBuffers`, used by
`procs.py`).

Where the memory lives: on Linux, an anonymous file (`memfd_create`): it has no name, so a job
killed at once (parent, worker process and resource tracker by one SIGKILL, as a scheduler's
cancel does) leaves nothing behind, and `/dev/shm`'s size (Docker's default is 64 MB) does not
bound it; the worker process receives its descriptor (inherited at its start, or passed over the
pipe). Elsewhere, a POSIX shared-memory name (`shm_open`), unlinked once the worker process has
mapped it and registered with multiprocessing's resource tracker meanwhile; a ring larger than the
space left in `/dev/shm` is refused before the worker process starts, naming both sizes. Either way
the pages are reserved when a slot is made (`posix_fallocate`), so memory that is not there is an
error naming the fix, not a SIGBUS in the worker process later.
"""

from __future__ import annotations

import mmap
import os
import secrets
import sys
import weakref
from dataclasses import dataclass
from multiprocessing import reduction, resource_tracker
from pathlib import Path
from typing import Any

import numpy as np

from .._torch import torch
from ..errors import ConfigError
from .slots import Slot, _use_count, ring_bytes, row_shape

try:   # POSIX shared memory, as multiprocessing.shared_memory uses it (not on Windows)
    import _posixshmem
except ImportError:   # pragma: no cover - Windows
    _posixshmem = None

__all__ = ["SharedBuffers", "Segment", "attach", "check_shm_fits", "views"]

#: memfd_create (Linux): slots without a name; None elsewhere (POSIX names in /dev/shm)
_memfd = getattr(os, "memfd_create", None)
_ALIGN = 64     # the labels' offset in a slot's segment
_SHM = Path("/dev/shm")
_FIXES = ("raise it (`docker run --shm-size=1g`, or a memory-backed emptyDir at /dev/shm in Kubernetes), lower "
          "workers=stoker.Workers(prefetch=...) or batch_size=, or use worker threads (Workers(processes=0))")


def _cudart() -> Any:
    """CUDA's runtime API through torch (cudaHostRegister / cudaHostUnregister); tests swap in a fake."""
    return torch.cuda.cudart()


def _shm_free() -> tuple[Path, int, int]:
    """(/dev/shm, its free bytes, its size in bytes); tests swap in a small one."""
    st = os.statvfs(_SHM)
    return _SHM, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def check_shm_fits(n_slots: int, batch_size: int, height: int, width: int, frames: int = 0) -> None:
    """Refuse, before the worker process starts, a ring that does not fit in what /dev/shm has free
    (only where the slots are files there: no memfd_create)."""
    if _memfd is not None or not _SHM.is_dir():
        return
    where, free, total = _shm_free()
    need = ring_bytes(n_slots, batch_size, height, width, frames)
    if need > free:
        raise ConfigError(f"Workers(processes=...) keeps its batch ring in shared memory: {n_slots} slots x "
                          f"{batch_size} images x {height}x{width}x3 bytes = {need / 2**20:.1f} MiB, but {where} has "
                          f"{free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB (Docker's default is 64 MB): "
                          + _FIXES)


def _reserve(fd: int, nbytes: int) -> None:
    """Take the pages now: shared memory that is not there fails here, not with SIGBUS on first write."""
    if not hasattr(os, "posix_fallocate"):   # pragma: no cover - macOS
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        where = "memory" if _memfd is not None else f"{_SHM}"
        raise ConfigError(f"Workers(processes=...) cannot reserve a {nbytes / 2**20:.1f} MiB batch slot in shared "
                          f"memory ({where}: {exc.strerror or exc}); " + _FIXES) from None


def _shm_map(name: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
            try:
                _reserve(fd, nbytes)
            except ConfigError:
                _posixshmem.shm_unlink("/" + name)
                raise
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    """Remove a segment's name (the memory stays while a process maps it); forget it in the tracker."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
    resource_tracker.unregister("/" + name, "shared_memory")


class Descriptor:
    """A memfd crossing to the worker process at its start: pickled as the descriptor the child
    inherits (multiprocessing's DupFd, valid only while the child is being spawned)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(dup: Any) -> int:
    return dup.detach()


@dataclass
class Segment:
    """One slot's shared memory, as the parent knows it."""

    name: str
    nbytes: int
    linked: bool = True   # its /dev/shm name still exists (until the child has mapped it)
    fd: int | None = None   # the memfd, open until the child has its own

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            _unlink(self.name)

    def release(self) -> None:
        """The child has the memory (or never will): drop the name or the descriptor."""
        self.unlink()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def ticket(self) -> tuple[str, int, Descriptor | None]:
        """What the child is given at its start to map this segment: (name, bytes, descriptor)."""
        return self.name, self.nbytes, None if self.fd is None else Descriptor(self.fd)


def _create(nbytes: int) -> tuple[mmap.mmap, Segment]:
    name = f"stoker-{os.getpid()}-{secrets.token_hex(6)}"
    if _memfd is None:
        mm = _shm_map(name, nbytes, create=True)
        resource_tracker.register("/" + name, "shared_memory")   # removed by the tracker if we die first
        return mm, Segment(name, nbytes)
    fd = _memfd(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        _reserve(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return mm, Segment(name, nbytes, linked=False, fd=fd)


def attach(name: str, nbytes: int, fd: int | None) -> mmap.mmap:
    """The worker process's mapping of a segment: by its descriptor (memfd), else by its name."""
    if fd is None:
        return _shm_map(name, nbytes, create=False)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _layout(batch_size: int, shape: tuple[int, ...], label_dtype: np.dtype | None) -> tuple[int, int, int]:
    """(image bytes, labels offset, segment bytes) of one slot."""
    images = batch_size * int(np.prod(shape))
    at = -(-images // _ALIGN) * _ALIGN
    labels = 0 if label_dtype is None else batch_size * np.dtype(label_dtype).itemsize
    return images, at, max(at + labels, 1)


def views(mm: mmap.mmap, batch_size: int, shape: tuple[int, ...], label_dtype: np.dtype | None
          ) -> tuple[np.ndarray, np.ndarray | None]:
    """A slot's images and labels over its mapping. Each is made on the mapping itself (not as a view of
    another array), so every view of the images references the images array: its reference count
    counts the holders (numpy collapses a view's base to the first array that is not a view)."""
    _, at, _ = _layout(batch_size, shape, label_dtype)
    img = np.ndarray((batch_size, *shape), np.uint8, buffer=mm)
    lab = None if label_dtype is None else np.ndarray((batch_size,), label_dtype, buffer=mm, offset=at)
    return img, lab


class SharedBuffers:
    """`slots.Buffers` for the process mode: each slot's images (and numeric labels) in one shared
    memory segment, as torch tensors over it, so a batch handed out is a view of memory the child wrote.

    `pin`: register each segment with CUDA (`cudaHostRegister`) so copies from it are asynchronous DMA
    as from `pin_memory=True` tensors; it is unregistered when the last view of it goes, before the
    mapping does (a finalizer on the array the tensors keep alive, which runs before that array lets go
    of the mapping)."""

    def __init__(self, pin: bool = False, arrays: bool = False) -> None:
        if _posixshmem is None:   # pragma: no cover - Windows
            raise ConfigError("Workers(processes=...) needs POSIX shared memory (Linux, macOS); use worker threads "
                              "(Workers(processes=0), the default) on this system")
        self.pin = pin
        self.arrays = arrays   # device="numpy": the slots as numpy arrays counting their holders (numpy_output)
        self.segments: weakref.WeakKeyDictionary[Slot, Segment] = weakref.WeakKeyDictionary()
        self._all: list[Segment] = []   # every segment made, to release what the child never mapped
        weakref.finalize(self, _release, self._all)   # a ring whose pass never started: its descriptors

    def allocate(self, batch_size: int, height: int, width: int, label_dtype: np.dtype | None,
                 frames: int = 0) -> Slot:
        shape = row_shape(height, width, frames)
        _, _, nbytes = _layout(batch_size, shape, label_dtype)
        mm, segment = _create(nbytes)
        self._all.append(segment)
        img, lab = views(mm, batch_size, shape, label_dtype)
        del mm   # the arrays keep the mapping
        if self.pin:
            _pin(img, nbytes)
        if self.arrays:   # as numpy_output.NumpyBuffers: the image array's reference count counts the holders
            slot = Slot(img, img, lab, lab, objects=[None] * batch_size)
            slot.owner = img
            del img, lab
            slot.uses = sys.getrefcount(slot.owner)
            self.segments[slot] = segment
            return slot
        images = torch.from_numpy(img)
        labels = None if lab is None else torch.from_numpy(lab)
        slot = Slot(images, images.numpy(), labels, None if labels is None else labels.numpy(),
                    objects=[None] * batch_size)
        slot.storage = images.untyped_storage()._cdata
        slot.uses = _use_count(slot.storage) if _use_count is not None else 0
        self.segments[slot] = segment
        return slot

    def weak(self, slot: Slot) -> Any:
        if self.arrays:
            from .numpy_output import ArrayWeakRef

            return ArrayWeakRef(slot.owner)
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(slot.images.untyped_storage())

    def unlink_all(self) -> None:
        """Remove every name still in /dev/shm and close every descriptor still held (mapped memory
        stays valid where it is mapped)."""
        _release(self._all)


def _release(segments: list[Segment]) -> None:
    for segment in segments:
        segment.release()
    segments.clear()


def _pin(images: np.ndarray, nbytes: int) -> None:
    """cudaHostRegister the `nbytes` of a slot's segment, which starts at its images array;
    cudaHostUnregister them when that array goes (before the mapping, which the array keeps alive: the
    labels, also in the segment, are copied when a batch is handed out)."""
    cudart, ptr = _cudart(), images.ctypes.data
    rc = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(getattr(rc, "value", rc)) != 0:
        raise ConfigError(f"cudaHostRegister of a {nbytes}-byte shared batch failed (error {rc}); use worker "
                          f"threads (Workers(processes=0)) or Workers(pin_memory=False)")
    weakref.finalize(images, cudart.cudaHostUnregister, ptr)
