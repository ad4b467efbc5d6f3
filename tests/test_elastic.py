"""Elastic resume: a state saved on W ranks continues on any number of ranks with exactly the samples
no rank has read yet, each once across the new ranks (checked sample by sample: every image has its
own label), for the orders whose epoch is one global order; plus a real torchrun (gloo) 2 -> 3."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from stoker.errors import ConfigError
from stoker.loader import Loader
from stoker.loader.options import Sampling
from stoker.order import from_ranges, to_ranges, unseen_positions
from stoker.packing import pack
from stoker.transforms import RandomResizedCrop

N = 15
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """15 images, one per class: a batch's labels say exactly which samples it holds."""
    from conftest import make_image_folder

    root = tmp_path_factory.mktemp("elastic")
    folder = make_image_folder(root / "imgs", n_per_class=1, classes=tuple(f"c{k:02d}" for k in range(N)))
    pack(folder, root / "packed", progress=False)
    return root / "packed"


def _loaders(packed: Path, world: int, order: str, drop_last: bool, bs: int = 2) -> list[Loader]:
    return [Loader(packed, bs, transforms=[RandomResizedCrop(8)], order=order, seed=5, drop_last=drop_last,
                   sampling=Sampling(rank=r, world_size=world), workers=1) for r in range(world)]


def _read(loader: Loader, batches: int | None = None) -> list[int]:
    seen = []
    for k, (_, labels) in enumerate(loader):
        seen += labels.tolist()
        if batches is not None and k + 1 == batches:
            break
    return seen


@pytest.mark.parametrize("order", ["random", "sequential", "shard_random"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("before, after, steps", [(2, 3, 2), (4, 2, 1), (3, 2, 3), (2, 4, 0), (2, 3, 4)])
def test_resume_on_another_world_size(packed: Path, order: str, drop_last: bool, before: int, after: int,
                                      steps: int) -> None:
    first = _loaders(packed, before, order, drop_last)
    seen_before = [_read(ld, steps) for ld in first]
    states = [ld.state_dict() for ld in first]
    # the state describes the epoch over all ranks: every rank saves the same progress
    assert all(s["remaining"] == states[0]["remaining"] for s in states)
    second = _loaders(packed, after, order, drop_last)
    for ld in second:
        ld.load_state_dict(states[0])
    seen_after = [_read(ld) for ld in second]
    assert len({len(s) for s in seen_after}) == 1   # every new rank gets the same number of samples
    assert len({len(ld) for ld in second}) == 1
    # (a first phase that read its whole epoch saved the start of the next: that one is read whole)
    epoch = states[0]["epoch"]
    before_set = {x for s in seen_before for x in s} if epoch == 0 else set()
    after_all = [x for s in seen_after for x in s]
    assert not before_set & set(after_all)   # nothing seen before is read again
    if drop_last:
        assert len(after_all) == len(set(after_all))   # each once
        left = N - len(before_set) - len(after_all)
        assert 0 <= left < after * 2   # only the tail that would make uneven batches is dropped
    else:
        assert before_set | set(after_all) == set(range(N))   # every sample read, once across the new ranks
        assert len(after_all) - len(set(after_all)) <= after - 1   # plus at most after - 1 padding repeats
    # what the new ranks read is what they planned, and the next epoch is a whole one again
    for ld, got in zip(second, seen_after):
        assert got == ld.dataset.labels[ld.epoch_indices(epoch)].tolist()
        assert ld.epoch == epoch + 1 and len(ld.epoch_indices(epoch + 1)) == ld.plan.epochs.samples()
        ld.close()
    for ld in first:
        ld.close()


def test_resume_twice_across_world_sizes(packed: Path) -> None:
    """2 ranks -> 3 ranks -> 2 ranks within one epoch: still each sample once."""
    seen: list[int] = []
    loaders = _loaders(packed, 2, "random", False, bs=1)
    for world_next, steps in ((3, 2), (2, None)):
        seen += [x for ld in loaders for x in _read(ld, 2)]
        state = loaders[0].state_dict()
        for ld in loaders:
            ld.close()
        loaders = _loaders(packed, world_next, "random", False, bs=1)
        for ld in loaders:
            ld.load_state_dict(state)
        assert loaders[0].state_dict().get("requeued") is True
    seen += [x for ld in loaders for x in _read(ld)]
    assert set(seen) == set(range(N)) and len(seen) - N <= 1


def test_same_world_size_keeps_the_exact_batches(packed: Path) -> None:
    """Resumed on as many ranks, a rank goes on with the very batches an uninterrupted pass gives."""
    whole = [_read(ld) for ld in _loaders(packed, 2, "random", False)]
    first = _loaders(packed, 2, "random", False)
    head = [_read(ld, 2) for ld in first]
    state = first[0].state_dict()
    second = _loaders(packed, 2, "random", False)
    for ld in second:
        ld.load_state_dict(state)
    assert [h + _read(ld) for h, ld in zip(head, second)] == whole


def test_orders_laid_out_per_world_size_refuse_another(packed: Path) -> None:
    state = _loaders(packed, 2, "shard_window", False)[0].state_dict()
    assert state["remaining"] is None
    with pytest.raises(ConfigError, match="order='shard_window' lays an epoch out per world size"):
        _loaders(packed, 3, "shard_window", False)[0].load_state_dict(state)


def test_progress_arithmetic() -> None:
    queue = np.arange(10)
    assert unseen_positions(queue, 2, 3, drop_last=False, contiguous=False).tolist() == list(range(6, 10))
    # contiguous parts of 4 (10 padded to 12): ranks read 0-3, 4-7, 8-9+0-1
    assert unseen_positions(queue, 1, 3, drop_last=False, contiguous=True).tolist() == [1, 2, 3, 5, 6, 7, 9]
    assert unseen_positions(queue, 4, 3, drop_last=False, contiguous=True).tolist() == []
    assert to_ranges(np.array([1, 2, 3, 5, 6, 7, 9])) == [[1, 4], [5, 8], [9, 10]]
    assert from_ranges([[1, 4], [9, 10]], 10).tolist() == [1, 2, 3, 9]
    with pytest.raises(ConfigError, match="not within the epoch's 10 samples"):
        from_ranges([[5, 11]], 10)


SCRIPT = """
import json, sys
import torch.distributed as dist
from stoker.loader import Loader
from stoker.transforms import RandomResizedCrop

dist.init_process_group("gloo")
phase, packed, state_file, out = sys.argv[1:5]
loader = Loader(packed, 2, transforms=[RandomResizedCrop(8)], seed=3, workers=1)
seen = []
if phase == "resume":
    with open(state_file) as fh:
        loader.load_state_dict(json.load(fh))
for k, (_, labels) in enumerate(loader):
    seen += labels.tolist()
    if phase == "save" and k == 1:
        break
gathered = [None] * loader.world_size
dist.all_gather_object(gathered, seen)
if loader.rank == 0:
    if phase == "save":
        with open(state_file, "w") as fh:
            json.dump(loader.state_dict(), fh)
    with open(out, "w") as fh:
        json.dump(gathered, fh)
loader.close()
dist.destroy_process_group()
"""


def test_torchrun_saved_on_two_ranks_resumed_on_three(packed: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    for phase, nproc in (("save", 2), ("resume", 3)):
        out = tmp_path / f"{phase}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(script), phase, str(packed), str(tmp_path / "state.json"), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results.append(json.loads(out.read_text()))
    (before, after) = results
    assert [len(s) for s in before] == [4, 4] and len({len(s) for s in after}) == 1
    seen_before = {x for s in before for x in s}
    seen_after = [x for s in after for x in s]
    assert not seen_before & set(seen_after) and seen_before | set(seen_after) == set(range(N))
    assert len(seen_after) - len(set(seen_after)) <= 2   # 7 left over 3 ranks: 3 each, 2 padding repeats


def test_loader_md_example_runs(packed: Path) -> None:
    text = (ROOT / "docs" / "loader.md").read_text(encoding="utf-8")
    section = text[text.index("### Resuming on another number of GPUs"):]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    scope = {"packed": str(packed)}
    exec(compile(code, "docs/loader.md", "exec"), scope)
    assert scope["seen"] == set(range(N))


def _forge(state: dict, **changes: object) -> dict:
    return {**state, **changes}


FORGED = [
    # a range listed twice, two overlapping ranges, ranges out of order: at another world size each would be read twice
    ("twice", lambda s: {"remaining": s["remaining"] + s["remaining"][-1:]}, "repeats"),
    ("overlap", lambda s: {"remaining": [[0, 6], [4, 9]]}, "overlaps"),
    ("unordered", lambda s: {"remaining": [[6, 9], [0, 3]]}, "overlaps or comes before"),
    ("empty_pair", lambda s: {"remaining": [[3, 3]]}, "0 <= start < stop"),
    ("remaining_int", lambda s: {"remaining": 5}, "'remaining' must be a list"),
    ("none_in_pair", lambda s: {"remaining": [[None, 3]]}, "'remaining' must be a list of [start, stop) int pairs"),
    ("float_in_pair", lambda s: {"remaining": [[0.0, 3]]}, "int pairs"),
    ("epoch_none", lambda s: {"epoch": None}, "'epoch' must be an int"),
    ("epoch_str", lambda s: {"epoch": "x"}, "'epoch' must be an int"),
    ("epoch_bool", lambda s: {"epoch": True}, "'epoch' must be an int"),
    ("epoch_negative", lambda s: {"epoch": -1}, "'epoch' must be an int >= 0"),
    ("sample_str", lambda s: {"sample": "4"}, "'sample' must be an int"),
    ("world_zero", lambda s: {"world_size": 0}, "'world_size' must be an int >= 1"),
    ("drop_last_int", lambda s: {"drop_last": 1}, "'drop_last' must be True or False"),
    ("batch_mismatch", lambda s: {"batch": s["batch"] + 3}, "does not add up"),
]


@pytest.mark.parametrize("name, change, words", FORGED, ids=[f[0] for f in FORGED])
@pytest.mark.parametrize("world_after", [2, 3])
def test_a_forged_state_is_refused_naming_the_field(packed: Path, name: str, change, words: str,
                                                    world_after: int) -> None:
    """A hand-merged or forged state is checked whole before any of it is used, at the same and at another
    world size: a ConfigError naming the field, never a raw TypeError or a silent duplicate."""
    loaders = _loaders(packed, 2, "random", False, bs=1)
    for ld in loaders:
        _read(ld, 3)
    state = loaders[0].state_dict()
    assert state["remaining"], "the test needs ranges left"
    forged = _forge(state, **change(state))
    target = _loaders(packed, world_after, "random", False, bs=1)[0]
    with pytest.raises(ConfigError, match=re.escape(words)):
        target.load_state_dict(forged)
    target.load_state_dict(state)   # the unmodified state still resumes
    assert target.state_dict()["epoch"] == state["epoch"]


def test_a_valid_hand_made_state_resumes_exactly(packed: Path) -> None:
    """Ranges written by hand (increasing, disjoint) are honoured: three ranks read exactly those samples once."""
    state = _loaders(packed, 2, "random", False, bs=1)[0].state_dict()
    state = {**state, "remaining": [[0, 4], [6, 9], [12, N]], "world_size": 1, "requeued": True}
    loaders = _loaders(packed, 3, "random", False, bs=1)
    for ld in loaders:
        ld.load_state_dict(state)
    seen = [x for ld in loaders for x in _read(ld)]
    full = _read(_loaders(packed, 1, "random", False, bs=1)[0])
    want = [full[p] for p in [*range(0, 4), *range(6, 9), *range(12, N)]]
    # 10 samples over 3 ranks: each rank reads 4, the last two padded as DistributedSampler pads
    assert set(seen) == set(want) and len(seen) == 12
