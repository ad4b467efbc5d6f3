"""benchmarks/gpu_session.sh, the GPU host's measurement script: it must name only pipelines, models,
flags and steps that exist, so a GPU session does not lose a call to a typo, and it is rehearsed here
with --device cpu on tiny data (the same steps, the device aside), including what it hands back when
it is stopped mid-run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from stoker.cli import build_parser
from stoker.tools.bench_gpu import device_pipelines

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def _text() -> str:
    # the script's line continuations joined, so a pipeline list split over lines reads as one
    return SCRIPT.read_text().replace("\\\n", "")


def test_the_script_parses_and_names_only_real_pipelines_and_models() -> None:
    subprocess.run([BASH, "-n", str(SCRIPT)], check=True)
    text = _text()
    # each model once (a rerun names its model again)
    models = list(dict.fromkeys(m for found in re.findall(r"--models (\S+)", text) for m in found.split(",")))
    catalog = device_pipelines(models, check=False)
    named = [n for m in re.finditer(r"--pipelines ([\w,-]+)", text) for n in m.group(1).split(",")]
    assert sorted(named) == sorted(catalog)   # every loader and every training feed, each once
    bench_flags = set(re.findall(r"--[a-z][\w-]*", " ".join(re.findall(r"stoker\.cli bench[^\n]*", text))))
    known = {o for a in build_parser()._subparsers._group_actions[0].choices["bench"]._actions for o in a.option_strings}
    assert bench_flags <= known, bench_flags - known
    scripts = set(re.findall(r"benchmarks/\w+\.py", text))
    assert "benchmarks/bench_gpu_decode.py" in scripts
    assert all((SCRIPT.parents[1] / name).is_file() for name in scripts), scripts


def test_the_wheel_script_parses_and_refuses_an_unknown_cuda(tmp_path: Path) -> None:
    wheels = SCRIPT.with_name("gpu_wheels.sh")
    subprocess.run([BASH, "-n", str(wheels)], check=True)
    bad = subprocess.run([BASH, str(wheels), str(tmp_path / "w")], capture_output=True, text=True,
                         env={**os.environ, "CUDA": "11"})
    assert bad.returncode == 2 and "CUDA must be 12 or 13" in bad.stderr and not (tmp_path / "w").exists()


def test_an_unknown_step_is_refused_and_env_runs(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    bad = subprocess.run([BASH, str(SCRIPT), "measure-everything"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown step 'measure-everything'" in bad.stderr
    ok = subprocess.run([BASH, str(SCRIPT), "env"], capture_output=True, text=True, env=env, timeout=120)
    log = (tmp_path / "out" / "env.log").read_text()
    assert re.search(r"^torch \S+ CUDA \S+ available (True|False)$", log, re.M), ok.stdout[-2000:]
    assert "stoker " in log and (tmp_path / "out" / "session.log").exists()


def test_its_python_snippets_compile() -> None:
    snippets = re.findall(r"<<'EOF'\n(.*?)\nEOF\n", SCRIPT.read_text(), re.S)
    assert len(snippets) == 2   # the environment report, the GPU decoder report
    for code in snippets:
        compile(code, str(SCRIPT), "exec")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_with_an_existing_interpreter_downloads_nothing() -> None:
    # a GPU host without a package index has torch already; `make demo` used to build a .venv and pip
    # install torch==2.13.0 there first, and failed
    root = SCRIPT.parents[1]
    dry = subprocess.run(["make", "-n", "-C", str(root), "demo", "STOKER_PYTHON=python3"], capture_output=True,
                         text=True, check=True).stdout
    assert "pip" not in dry and "venv" not in dry
    assert "python3 setup.py -q build_ext --inplace" in dry and "python3 -m stoker.cli demo" in dry
    assert "make demo STOKER_PYTHON=" in SCRIPT.read_text()   # the GPU session runs `make demo` itself


ROOT = SCRIPT.parents[1]
TINY = {"IMAGES": "24", "BATCH": "8", "ROUNDS": "1", "LOADER_STEPS": "2", "TRAIN_STEPS": "1", "WARMUP_STEPS": "1",
        "DECODE_IMAGES": "16", "WORKERS": "1"}


def _session_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, **TINY, "OUT": str(tmp_path / "out"), "RESULTS": str(tmp_path / "results"),
            "PY": sys.executable, "PYTHONPATH": str(ROOT / "src")}


def _archived(results: Path) -> set[str]:
    (archive,) = results.glob("gpu-session-*.tar.gz")
    with tarfile.open(archive) as tar:
        return {name.removeprefix("./") for name in tar.getnames()}


@pytest.mark.slow   # about 30 s: every bench pipeline starts a fresh process (CI runs it: `make test`)
def test_a_cpu_rehearsal_runs_the_loader_bench_and_the_targets_and_hands_back_the_results(tmp_path: Path) -> None:
    done = subprocess.run([BASH, str(SCRIPT), "--device", "cpu", "env", "loader", "targets"], cwd=ROOT,
                          env=_session_env(tmp_path), capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    out = tmp_path / "out"
    bench = json.loads((out / "bench-loader" / "bench.json").read_text())
    assert {p["name"] for p in bench["pipelines"]} >= {"cuda-baseline", "cuda-stoker"}, log[-3000:]
    assert "| start-up share of the run |" in (out / "targets.log").read_text()   # reported, not gated
    conditions = (out / "conditions.md").read_text()
    assert "page cache" in conditions and "decode-bound, not I/O-bound" in conditions
    assert "float32 batches cross" in conditions and "default" in conditions and "no overlap" in conditions
    assert {"env.log", "loader.log", "targets.log", "session.log", "conditions.md",
            "bench-loader/bench.json", "bench-loader/bench.md"} <= _archived(tmp_path / "results")
    assert "TORCH_CUDA_SANITIZER" not in SCRIPT.read_text()


def test_a_session_stopped_mid_step_still_hands_back_its_finished_steps(tmp_path: Path) -> None:
    proc = subprocess.Popen([BASH, str(SCRIPT), "--device", "cpu", "env", "cudatests"], cwd=ROOT,
                            env=_session_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "out" / "cudatests.log").exists() and time.monotonic() < deadline:
            time.sleep(0.1)   # env is done and archived once cudatests has begun
        assert proc.poll() is None, "the session ended before it could be stopped"
        os.killpg(proc.pid, signal.SIGTERM)   # what a time limit does to the command
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert {"env.log", "conditions.md", "session.log"} <= _archived(tmp_path / "results")
