"""Distributed reading: disjoint rank slices, equal batch counts, every sample once per epoch;
plus one real two-process torchrun (gloo, CPU) run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from stoker.loader import Loader
from stoker.packing import pack
from stoker.loader.options import Sampling
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

TRAIN = [RandomResizedCrop(16), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import make_image_folder

    root = tmp_path_factory.mktemp("dist")
    folder = make_image_folder(root / "imgs", n_per_class=5, classes=("a", "b", "c"))  # 15 images
    pack(folder, root / "packed", progress=False)
    return root / "packed"


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("order", ["random", "shard_random", "shard_window"])
def test_ranks_split_every_epoch(packed: Path, world: int, drop_last: bool, order: str) -> None:
    n = 15
    loaders = [Loader(packed, 2, transforms=TRAIN, drop_last=drop_last, order=order,
                      seed=7, sampling=Sampling(rank=r, world_size=world), workers=1) for r in range(world)]
    for epoch in (0, 1):
        parts = []
        for ld in loaders:
            ld.set_epoch(epoch)
            labels = [int(v) for _, y in ld for v in y.tolist()]
            idx = ld.epoch_indices(epoch)
            assert labels == ld.dataset.labels[idx].tolist()  # what was yielded is what was planned
            parts.append(idx)
        assert len({len(ld) for ld in loaders}) == 1  # the same number of batches on every rank
        assert len({len(p) for p in parts}) == 1
        allidx = np.concatenate(parts)
        if drop_last:
            assert len(np.unique(allidx)) == len(allidx)  # disjoint
            assert n - len(allidx) < world * 2  # only the tails that make batches uneven are dropped
        else:
            assert sorted(set(allidx.tolist())) == list(range(n))  # every sample seen
            assert len(allidx) - n <= world - 1  # at most world - 1 repeats (DistributedSampler padding)
    for ld in loaders:
        ld.close()


SCRIPT = """
import json, os, sys
import torch.distributed as dist
from stoker.loader import Loader
from stoker.transforms import RandomResizedCrop

dist.init_process_group("gloo")
loader = Loader(sys.argv[1], 4, transforms=[RandomResizedCrop(16)], seed=3, workers=1)
assert (loader.rank, loader.world_size) == (dist.get_rank(), dist.get_world_size())
seen = [int(v) for _, labels in loader for v in labels.tolist()]
counts = [None] * loader.world_size
dist.all_gather_object(counts, (len(loader), loader.epoch_indices(0).tolist(), seen))
if loader.rank == 0:
    with open(sys.argv[2], "w") as fh:
        json.dump(counts, fh)
loader.close()
dist.destroy_process_group()
"""


def test_torchrun_two_processes_gloo(packed: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(packed), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (n0, idx0, seen0), (n1, idx1, seen1) = result
    assert n0 == n1 == 2  # 15 samples padded to 16: 8 per rank, batches of 4
    assert not set(idx0[:7]) & set(idx1[:7])
    assert sorted(set(idx0) | set(idx1)) == list(range(15))
    labels = Loader(packed, 4, transforms=[RandomResizedCrop(16)]).dataset.labels
    assert seen0 == labels[idx0].tolist() and seen1 == labels[idx1].tolist()


def test_default_threads_share_the_cpus_among_torchrun_ranks(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun every rank on a machine makes its own Loader: each takes its share of the CPUs,
    not all of them (2 ranks x all cores oversubscribes them)."""
    import stoker._system as system
    monkeypatch.setattr(system, "cpu_ids", lambda: list(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Loader(packed, batch_size=4, transforms=TRAIN).num_threads == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")   # more ranks than CPUs: still one thread each
    assert Loader(packed, batch_size=4, transforms=TRAIN).num_threads == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert Loader(packed, batch_size=4, transforms=TRAIN).num_threads == 8
    assert Loader(packed, batch_size=4, transforms=TRAIN, workers=3).num_threads == 3   # an explicit count is kept
