"""A Loader across fork(): a forked child (a torch DataLoader fork worker, a plain os.fork()) never joins,
signals or locks its parent's threads. It may close or drop the parent's Loader (which only forgets them),
or iterate it (a new pass on threads of its own, the same batches the parent gets)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stoker
from conftest import make_image_folder

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")

SRC = Path(stoker.__file__).resolve().parents[1]

PRELUDE = """
import hashlib, os, sys
import stoker
from stoker import RandomHorizontalFlip, RandomResizedCrop

def make(persistent=False):
    return stoker.Loader(sys.argv[1], batch_size=4, transforms=[RandomResizedCrop(32), RandomHorizontalFlip()],
                         sampling=stoker.Sampling(seed=3), workers=stoker.Workers(num_threads=2, persistent=persistent))

def digest(loader):
    loader.set_epoch(0)
    h = hashlib.sha256()
    for images, labels in loader:
        h.update(images.contiguous().numpy().tobytes()); h.update(labels.numpy().tobytes())
    return h.hexdigest()
"""


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fork")
    make_image_folder(root / "imgs", n_per_class=6, sizes=((120, 160), (96, 128), (140, 100)))
    stoker.pack(root / "imgs", root / "packed")
    return root / "packed"


def _run(script: str, pack: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    # a generous limit against a hang (a child waiting on a thread it does not have), not a speed bound
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(script), str(pack)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("child", ["return", "close", "drop", "iterate", "iterate_persistent"])
def test_a_forked_child_of_a_running_loader_exits_cleanly(pack: Path, child: str) -> None:
    """The parent's Loader is mid-pass (its engine pool and worker threads running) when it forks. The child
    returns, closes it, drops it, or iterates a whole epoch: it exits 0 (today's main segfaulted in
    pthread_join of threads the child does not have), and what it iterates equals the parent's epoch."""
    script = f"""
    child = {child!r}
    loader = make(persistent=child == "iterate_persistent")
    want = digest(loader)
    it = iter(loader); next(it)
    assert loader.stats.engine, "the native engine must be running for this test to mean anything"
    pid = os.fork()
    if pid == 0:
        if child == "close":
            loader.close()
        elif child == "drop":
            del it, loader
            import gc; gc.collect()
        elif child.startswith("iterate"):
            got = digest(loader)
            loader.close()
            os._exit(0 if got == want else 4)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child ended with {{os.waitstatus_to_exitcode(status)}}"
    rest = sum(1 for _ in it)   # the parent's pass goes on untouched
    assert digest(loader) == want
    loader.close()
    print("ok")
    """
    out = _run(script, pack)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_torch_dataloader_fork_workers_around_a_loader(pack: Path) -> None:
    """A stoker Loader, already iterated in the parent (its pool started), wrapped in an IterableDataset that
    torch's DataLoader runs in two fork workers for two epochs: every worker yields the parent's epoch."""
    script = """
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    loader = make(persistent=True)
    want = digest(loader)

    class Wrap(IterableDataset):
        def __iter__(self):
            yield digest(loader)

    dl = DataLoader(Wrap(), batch_size=None, num_workers=2, multiprocessing_context="fork", persistent_workers=True)
    for epoch in range(2):
        got = list(dl)
        assert got == [want, want], (epoch, got, want)
    del dl
    assert digest(loader) == want
    loader.close()
    print("ok")
    """
    out = _run(script, pack)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def test_the_native_pool_refuses_to_run_in_a_forked_child() -> None:
    """The C pool itself: a child that calls run() on its parent's pool is told why, never hangs; closing and
    dropping it there only forgets it."""
    script = """
    from stoker import native
    pool = native.engine(2)
    pid = os.fork()
    if pid == 0:
        try:
            pool.run(*([None] * 18))
        except RuntimeError as exc:
            ok = "fork()ed child" in str(exc)
        except TypeError:
            ok = False
        pool.close(); del pool
        os._exit(0 if ok else 5)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
    pool.close()
    print("ok")
    """
    out = _run(script, Path("."))
    if "no libjpeg" in out.stderr:
        pytest.skip("the native region decoder is not built here")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
