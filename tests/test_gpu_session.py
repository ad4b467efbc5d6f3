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

from conftest import load_benchmark
from stoker.cli import build_parser
from stoker.tools.bench import peer_added
from stoker.tools.bench_gpu import device_pipelines

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def _text() -> str:
    # the script's line continuations joined, so a pipeline list split over lines reads as one
    return SCRIPT.read_text().replace("\\\n", "")


def _variable(name: str) -> str:
    (value,) = re.findall(rf'^{name}="([^"]*)"', SCRIPT.read_text(), re.M)
    return value


def _profile(name: str, models: list[str]) -> list[str]:
    """A profile's pipeline list with {model} spelled out for each model."""
    out: list[str] = []
    for p in _variable(name).split():
        out += [p.replace("{model}", m) for m in models] if "{model}" in p else [p]
    return out


def test_the_script_parses_and_names_only_real_pipelines_and_models() -> None:
    subprocess.run([BASH, "-n", str(SCRIPT)], check=True)
    text = _text()
    (models,) = re.findall(r'^MODELS=\$\{MODELS:-([^}]*)\}', text, re.M)
    models = models.split()
    assert models == ["resnet50", "resnet18"]
    with peer_added(load_benchmark("bench_dali").PEER):   # the dali pipelines run through benchmarks/bench_dali.py
        catalog = device_pipelines(models, check=False)
    full = _profile("FULL_PIPELINES", models)
    assert sorted(full) == sorted(catalog)   # every loader and every training feed, each once
    quick = _profile("QUICK_PIPELINES", models)
    assert set(quick) <= set(catalog) and len(quick) == len(set(quick))
    # the quick run: the loaders alone with CPU and GPU decode and the two split (decode="auto"), and each
    # model's synthetic, baseline and stoker feeds
    assert {"cuda-stoker", "cuda-stoker-gpu", "cuda-stoker-auto"} <= set(quick)
    assert all(f"train-{m}-{feed}" in quick for m in models for feed in ("synthetic", "baseline", "stoker"))
    # every other feed too (the GPU decode one is the loader's step; DALI and the loaders' baseline wait for
    # the full run): a feed `stoker bench` adds belongs in the quick run
    left_out = {"cuda-baseline", "cuda-dali"} | {f"train-{m}-{feed}" for m in models for feed in ("stoker-gpu", "dali")}
    assert set(quick) == set(catalog) - left_out
    (bench_function,) = re.findall(r"^bench\(\) \{.*?^\}$", text, re.M | re.S)
    assert "-m stoker.cli bench" in bench_function and "benchmarks/bench_dali.py" in bench_function
    bench_flags = set(re.findall(r"--[a-z][\w-]*", bench_function))
    bench_flags |= set(re.findall(r"--[a-z][\w-]*", " ".join(re.findall(r'^\s+bench \S+ (--[^\n]*)', text, re.M))))
    known = {o for a in build_parser()._subparsers._group_actions[0].choices["bench"]._actions for o in a.option_strings}
    assert {"--pipelines", "--models", "--steps"} <= bench_flags <= known, bench_flags - known
    scripts = set(re.findall(r"benchmarks/\w+\.py", text))
    assert "benchmarks/bench_gpu_decode.py" in scripts
    assert all((SCRIPT.parents[1] / name).is_file() for name in scripts), scripts


def test_the_quick_runs_limits_fit_a_time_limited_host() -> None:
    """15 minutes of machine time with a 1-2 minute start, commands of at most 10 minutes: the quick run
    is two commands, the CUDA tests and then the rest at 16 and 8 cores, each of at most 9 minutes, each
    step under a limit of its own, all of it under 13 minutes."""
    limits = dict(kv.split("=") for kv in _variable("QUICK_LIMITS").split())
    steps = ["setup", "env", "cudatests", "loader", "train-resnet50", "train-resnet18", "targets"]
    assert list(limits) == steps
    quick = [int(v) for k, v in limits.items() if k != "cudatests"]
    assert sum(quick) <= 9 * 60 and sum(quick) + int(limits["cudatests"]) <= 13 * 60
    assert int(limits["cudatests"]) >= 111 + 30   # the H200's 111 s, with room
    assert all(int(v) <= 10 * 60 for v in limits.values())
    text = SCRIPT.read_text()
    assert "CORES=${CORES-16,8}" in text and 'STEPS=(setup env loader "${MODEL_STEPS[@]}" targets)' in text


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


@pytest.mark.slow   # about a minute on 2 cores: each bench pipeline starts a fresh process (CI runs it: `make test`)
def test_a_cpu_rehearsal_of_the_quick_run_hands_back_one_archive_after_each_step(tmp_path: Path) -> None:
    """The quick profile on the CPU, tiny, its two calls as one (the CUDA tests, then the rest): every step
    in order under its limit, a step that overruns its limit stopped (cudatests, given 1 s) and the run
    going on, the loader and a training bench through the pipeline list ({model} filled in) pinned to each
    of CORES in turn, the split decode loader saying in the step's log why it decodes on the CPU alone
    here, the targets, one archive with all of it."""
    env = {**_session_env(tmp_path), "MODELS": "stoker.tools.train:small_cnn", "CORES": "1",
           "PIPELINES": "cuda-stoker cuda-stoker-auto train-{model}-synthetic", "LIMITS": "cudatests=1"}
    steps = ["cudatests", "setup", "env", "loader", "train-small_cnn", "targets"]
    done = subprocess.run([BASH, str(SCRIPT), "--device", "cpu", "quick", *steps], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    out = tmp_path / "out"
    session = (out / "session.log").read_text()
    assert re.findall(r"^== (\S+) \(limit (\d+) s\)", session, re.M) == [
        ("cudatests", "1"), ("setup", "30"), ("env", "20"), ("loader", "150"), ("train-small_cnn", "150"),
        ("targets", "15")], log[-3000:]
    assert "[timed out: step cudatests reached its limit of 1 s]" in (out / "cudatests.log").read_text()
    assert done.returncode == 1   # the stopped step counts as a failure
    assert "--cores 1" in session and "--workers" not in session
    bench = json.loads((out / "bench-loader" / "bench-cores1.json").read_text())
    assert [p["name"] for p in bench["pipelines"]] == ["cuda-stoker", "cuda-stoker-auto"], log[-3000:]
    auto = bench["pipelines"][1]
    assert auto["gpu_share"] == 0.0 and auto["gpu_split"].startswith("CPU only: no GPU JPEG decoder works here")
    loader_log = (out / "loader.log").read_text()
    assert re.search(r"^\[cuda-stoker-auto\] .* stoker\.bench INFO cuda-stoker-auto: 0% of each batch's JPEGs on "
                     r"the GPU \(CPU only: no GPU JPEG decoder works here", loader_log, re.M), loader_log[-3000:]
    assert "seconds per phase over the timed rounds" in loader_log
    train = json.loads((out / "bench-train-small_cnn" / "bench-cores1.json").read_text())
    assert [p["name"] for p in train["pipelines"]] == ["train-small_cnn-synthetic"]
    assert "--data" in session   # the training bench reused the loader's images
    assert "| start-up share of the run |" in (out / "targets.log").read_text()   # reported, not gated
    conditions = (out / "conditions.md").read_text()
    assert "profile: quick" in conditions and "cudatests=1" in conditions
    assert "page cache" in conditions and "decode-bound, not I/O-bound" in conditions
    assert "float32 batches cross" in conditions and "default" in conditions and "no overlap" in conditions
    assert {"env.log", "cudatests.log", "loader.log", "train-small_cnn.log", "targets.log", "session.log",
            "conditions.md", "bench-loader/bench-cores1.json", "bench-loader/bench-cores1.md",
            "bench-train-small_cnn/bench-cores1.json"} <= _archived(tmp_path / "results")
    assert "TORCH_CUDA_SANITIZER" not in SCRIPT.read_text()


def test_the_bench_passes_on_its_pipeline_processes_log_lines(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    """What the session's step logs carry of each pipeline's process (the GPU decode path's timers, say)."""
    from stoker.tools import bench

    result = bench._RESULT_MARK + json.dumps({"images_per_s": 1.0})
    done = subprocess.CompletedProcess([], 0, stdout=result + "\n", stderr="12:00:00 stoker INFO decode 3.1 ms\n")
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: done)
    spec = bench._Spec(pipeline="cuda-stoker", root="", packed="", batch_size=8, workers=1, rounds=1)
    monkeypatch.setenv(bench.CHILD_LOGS_ENV, "1")
    assert bench._measure_isolated(spec) == {"images_per_s": 1.0}
    assert f"[{spec.pipeline}] 12:00:00 stoker INFO decode 3.1 ms" in capsys.readouterr().err
    monkeypatch.setenv(bench.CHILD_LOGS_ENV, "0")
    bench._measure_isolated(spec)
    assert capsys.readouterr().err == ""


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
