"""Live data wait: each step's time in `next()` as running figures (`Loader.data_wait`), on one rank and
reduced over two real ranks (torch.distributed with gloo on this machine), naming the slowest."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from stoker import Loader, Sampling, Workers
from stoker.errors import ConfigError
from stoker.transforms import RandomResizedCrop
from test_native_rows import build


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("wait") / "ds", seed=3, shards=1)


def test_one_rank_counts_every_step_and_its_share_of_the_wall_time(pack: Path) -> None:
    with Loader(pack, 4, transforms=[RandomResizedCrop(32)], device="numpy", workers=Workers(num_threads=1)) as ld:
        assert ld.data_wait() == {"data_wait_steps": 0.0, "data_wait_share": 0.0, "data_wait_ms": 0.0,
                                  "data_wait_max_ms": 0.0}
        for k, _ in enumerate(ld):
            time.sleep(0.01)   # the step: the loader runs ahead meanwhile
        got = ld.data_wait()
        assert got["data_wait_steps"] == len(ld) == k + 1
        assert 0.0 < got["data_wait_share"] < 1.0 and got["data_wait_max_ms"] >= got["data_wait_ms"] > 0.0
        assert abs(ld.stats.consumer_wait_s - sum(ld.stats._waits.recent)) < 1e-9   # under 100 steps: all of them
        assert ld.data_wait(across_ranks=False) == got
        with pytest.raises(ConfigError, match="init_process_group"):
            ld.data_wait(across_ranks=True)


def _rank(rank: int, port: int, pack: str, out: str) -> None:
    import torch.distributed as dist

    from stoker import adapt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # rank 1's loader is slow (a per-sample op that sleeps): its steps wait for data, rank 0's do not
        slow = [adapt(lambda a: (time.sleep(0.02), a)[1], input="numpy")] if rank == 1 else []
        with Loader(pack, 4, transforms=[RandomResizedCrop(32), *slow], device="numpy",
                    sampling=Sampling(rank=rank, world_size=2), workers=Workers(num_threads=1)) as ld:
            for _ in ld:
                time.sleep(0.005)
            got = ld.data_wait()   # torch.distributed is initialised: reduced over both ranks
        if rank == 0:
            Path(out).write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_two_ranks_reduce_their_waits_and_name_the_slowest(pack: Path, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "wait.json"
    mp.spawn(_rank, args=(port, str(pack), str(out)), nprocs=2, join=True)
    got = json.loads(out.read_text())
    assert got["slowest_rank"] == 1
    for key in ("data_wait_share", "data_wait_ms", "data_wait_max_ms"):
        assert got[f"{key}_max"] >= got[f"{key}_mean"] >= 0.0
    assert got["data_wait_share_max"] > got["data_wait_share"]   # rank 0's own figure is the smaller
    assert np.isclose(got["data_wait_share_mean"], (got["data_wait_share"] + got["data_wait_share_max"]) / 2)
