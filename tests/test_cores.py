"""`stoker bench --cores N` and `stoker doctor --cores N`: the run pinned to N cores, a section per N."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from stoker.cli import main
from stoker.errors import ConfigError
from stoker.packing import PackOptions, pack
from stoker.tools import cores as cores_mod
from stoker.tools.synth import make_tiny_jpegs

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
#: the counts a test runs at: 1, and 1,2 where this process may use 2 cores or more
COUNTS = [1, 2] if len(CPUS) >= 2 else [1]


def _masks() -> set[tuple[int, ...]]:
    """The affinity mask of every thread of this process (a thread that ends while they are read is left out)."""
    masks = set()
    for t in os.listdir("/proc/self/task"):
        try:
            masks.add(tuple(sorted(os.sched_getaffinity(int(t)))))
        except ProcessLookupError:   # a loader thread that ended since the listing
            pass
    return masks


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_jpegs(tmp_path_factory.mktemp("cores") / "data", 104, classes=3, size=(48, 64))
    out = tmp_path_factory.mktemp("cores") / "packed"
    pack(folder, out, options=PackOptions(workers=1), progress=False)
    return out


#: what the model saw at each forward pass during `stoker doctor` (the run's own thread, while it ran)
SEEN: list[dict] = []


class _Recording(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append({"masks": _masks(), "torch_threads": torch.get_num_threads()})
        return self.head(x.float().mean(dim=(2, 3)))


def recording_model() -> torch.nn.Module:
    return _Recording()


def test_parse_and_check_the_core_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cores_mod.parse_cores("16, 8") == (16, 8) and cores_mod.parse_cores("1") == (1,)
    for bad in ("0", "x", "4,", "-1"):
        with pytest.raises(ConfigError, match="expected positive integers"):
            cores_mod.parse_cores(bad)
    with pytest.raises(ConfigError) as exc:
        cores_mod.check_cores([len(CPUS) + 1])
    assert f"this process may run on {len(CPUS)} core(s)" in str(exc.value)
    assert f"use at most --cores {len(CPUS)}" in str(exc.value)
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(ConfigError, match="os.sched_setaffinity .* which this platform does not have"):
        cores_mod.check_cores([1])
    assert cores_mod.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_pinned_pins_every_thread_and_restores_each_mask() -> None:
    stop = threading.Event()
    early = threading.Thread(target=stop.wait, name="started-before", daemon=True)   # a pool made earlier
    early.start()
    before = _masks()
    try:
        with cores_mod.pinned(1) as cpus:
            assert cpus == CPUS[:1]
            assert _masks() == {tuple(CPUS[:1])}   # the thread started before the block too
            child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                   capture_output=True, text=True, check=True)
            assert child.stdout.strip() == str(CPUS[:1])   # a process started inside inherits it
            from stoker._system import threads_per_process
            assert threads_per_process() == 1   # the Loader's default thread count follows the mask
    finally:
        stop.set()
        early.join(5)
    assert _masks() == before


def test_cli_doctor_runs_pinned_at_each_count_with_a_section_each(packed: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    SEEN.clear()
    spec = ",".join(map(str, COUNTS))
    assert main(["doctor", str(packed), "--batch-size", "8", "--size", "32", "--device", "cpu", "--cores", spec,
                 "--model", f"{__name__}:recording_model"]) == 0
    out = capsys.readouterr().out
    assert _masks() == {tuple(CPUS)}   # restored after the run
    # every forward pass ran with the whole process on the first N CPUs, N the run's count, in order
    masks = [next(iter(s["masks"])) for s in SEEN]
    assert all(len(s["masks"]) == 1 for s in SEEN)
    assert sorted(set(masks), key=masks.index) == [tuple(CPUS[:n]) for n in COUNTS]
    for n in COUNTS:
        assert f"stoker doctor: {packed} at {n} core(s) (CPUs " in out
    if len(COUNTS) > 1:
        table = out.split("\n\n")[0].splitlines()
        assert table[0].startswith("| cores | loader threads |") and "| route | GPU share |" in table[0]
        rows = [line.split(" | ") for line in table[2:]]
        assert [r[0].strip("| ") for r in rows] == [str(n) for n in COUNTS]
        assert all("cpu native" in r[6] or "cpu python" in r[6] for r in rows) and all(r[7] == "- |" for r in rows)
    else:
        assert "route            cpu " in out


def test_cli_doctor_json_has_a_run_per_count(packed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", str(packed), "--batch-size", "8", "--size", "32", "--device", "cpu", "--json",
                 "--cores", ",".join(map(str, COUNTS))]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["cores"] == COUNTS and [r["cores"] for r in obj["runs"]] == COUNTS
    for run, n in zip(obj["runs"], COUNTS):
        assert run["cpus"] == CPUS[:n] and run["route"].startswith("cpu ") and run["gpu_share"] is None
        # without a GPU the model takes half the cores and the loader the rest (at least one each)
        assert run["threads"] == max(1, n - max(1, n // 2))


def test_cli_refuses_more_cores_than_there_are_before_running(packed: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.tools import doctor

    monkeypatch.setattr(doctor, "run_doctor", lambda *a, **k: pytest.fail("ran before the counts were checked"))
    assert main(["doctor", str(packed), "--cores", f"1,{len(CPUS) + 1}"]) == 2
    err = capsys.readouterr().err
    assert f"stoker doctor: error: --cores {len(CPUS) + 1}: this process may run on {len(CPUS)} core(s)" in err
    assert main(["bench", "--cores", f"{len(CPUS) + 1}"]) == 2
    assert f"use at most --cores {len(CPUS)}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["doctor", str(packed), "--cores", "0"])
    assert "argument --cores: expected positive integers" in capsys.readouterr().err


def test_bench_refuses_more_workers_than_cores(tiny_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--data", str(tiny_root), "--cores", "1", "--workers", "2", "--pipelines", "ceiling"]) == 2
    assert "--workers 2 is more than the 1 core(s) of --cores 1" in capsys.readouterr().err


@pytest.mark.slow   # a child process per pipeline and count
def test_cli_bench_runs_pinned_at_each_count_with_a_section_each(tiny_root: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.tools import bench

    seen: list[tuple[set, str]] = []
    measure = bench._measure_isolated

    def recorded(spec: bench._Spec) -> dict:   # the parent while it starts a pipeline's process, and the child
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
        seen.append((_masks(), child.stdout.strip()))
        return measure(spec)

    monkeypatch.setattr(bench, "_measure_isolated", recorded)
    assert main(["bench", "--data", str(tiny_root), "--batch-size", "32", "--rounds", "1", "--out", str(tmp_path),
                 "--pipelines", "stoker-train,ceiling", "--cores", ",".join(map(str, COUNTS)), "-q"]) == 0
    out = capsys.readouterr().out
    assert [(m, c) for m, c in seen] == [({tuple(CPUS[:n])}, str(CPUS[:n])) for n in COUNTS for _ in range(2)]
    assert _masks() == {tuple(CPUS)}
    for n in COUNTS:
        obj = json.loads((tmp_path / f"bench-cores{n}.json").read_text())
        assert obj["cores"] == n and obj["cpus"] == CPUS[:n] and obj["workers"] == n
        assert obj["machine"]["usable_cores"] == n
        train = next(p for p in obj["pipelines"] if p["name"] == "stoker-train")
        assert train["route"].startswith("cpu native") or train["route"].startswith("cpu python")
        assert f"## {n} core(s) (CPUs " in out
        assert "- stoker-train: stoker.Loader" in out and "; route: cpu " in out
    if len(COUNTS) > 1:
        head, *rest = out.split("\n\n")[1].splitlines()
        assert head == "| cores | stoker-train | ceiling | GPU share |"
        assert [r.split(" | ")[0].strip("| ") for r in rest[1:]] == [str(n) for n in COUNTS]
