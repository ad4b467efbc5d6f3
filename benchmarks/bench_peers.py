"""Every peer that installs here beside stoker and DataLoader + PIL, in one `stoker bench` run.

    python benchmarks/bench_peers.py [stoker bench's options]

The peers of `bench_dali.py` (NVIDIA DALI's CPU pipelines, `dali`, `dali-float`), `bench_turbo.py`
(TurboLoader's TBL, `turbo-tbl`), `bench_datago.py` (`datago`) and `bench_spdl.py` (`spdl`) added together,
each on its recommended fast path, so their ratios come from the same run as stoker's and the baseline's.
Default pipelines: the baseline, stoker's train, val, float, raw-pixel and bucket pipelines, and each
peer's; a peer that does not install or run here is reported as skipped, with its fix.
"""

from __future__ import annotations

import argparse
import contextlib

import bench_dali
import bench_datago
import bench_spdl
import bench_turbo
from stoker.cli import add_bench_arguments, run_command
from stoker.tools.bench import peer_added

PEERS = (bench_dali.PEER, bench_turbo.PEER, bench_datago.PEER, bench_spdl.PEER)
STOKER = ("baseline", "stoker-train", "stoker-val", "stoker-train-float", "stoker-train-raw256", "stoker-buckets")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_peers.py", description=__doc__.split("\n\n")[0])
    add_bench_arguments(p)
    args = p.parse_args(argv)
    if args.pipelines is None and args.device == "cpu" and args.recipe == "basic":
        args.pipelines = ",".join([*STOKER, "dali", "dali-float", *(n for peer in PEERS[1:] for n in peer.pipelines)])
    with contextlib.ExitStack() as stack:
        for peer in PEERS:
            stack.enter_context(peer_added(peer))
        return run_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
