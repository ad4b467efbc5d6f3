"""The CPU rehearsal of the CUDA tests (tests/cuda_rehearsal.py), on planted tests run in a child pytest:
only torch's own "no CUDA" error becomes a skip, naming the line that reached the GPU; everything else
a test gets wrong fails, as on a GPU host."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

PLANTED = '''
import threading

import pytest
import torch

from stoker.loader import Loader

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def on_gpu():
    return torch.zeros(2, device="cuda")


def test_reaches_cuda_after_cpu_work():
    x = torch.arange(6).reshape(2, 3)
    assert x.sum() == 15
    x.cuda()
    raise AssertionError("not reached")


def test_reaches_cuda_at_once():
    torch.cuda.synchronize()


def test_in_a_fixture(on_gpu):
    pass


def test_through_a_thread():
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_catch(lambda: torch.empty(1).pin_memory())))
    thread.start()
    thread.join()
    raise RuntimeError("the device thread failed") from errors[0]


def _catch(fn):
    try:
        fn()
    except Exception as exc:
        return exc


def test_a_stale_keyword(tmp_path):
    Loader(tmp_path, 8, prefetch=2)


def test_a_wrong_layout():
    batch = torch.zeros(4, 3, 8, 8)
    assert batch.permute(0, 3, 1, 2).shape == batch.shape   # NHWC assumed: fails before any CUDA call
    torch.zeros(1, device="cuda")


def test_an_error_that_only_mentions_cuda():
    raise RuntimeError("CUDA is fine, the test is wrong")


def test_a_test_that_never_needs_the_gpu():
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
'''

OUTSIDE = '''
import torch


def test_outside_tests_cuda_nothing_is_reported_available():
    assert not torch.cuda.is_available()
'''


def _run(tmp_path: Path) -> dict[str, tuple[str, str]]:
    tests = tmp_path / "tests"
    (tests / "cuda").mkdir(parents=True)
    shutil.copy(TESTS / "cuda_rehearsal.py", tests / "cuda_rehearsal.py")
    (tests / "conftest.py").write_text('pytest_plugins = ["cuda_rehearsal"]\n')
    (tests / "cuda" / "test_planted.py").write_text(PLANTED)
    (tests / "test_outside.py").write_text(OUTSIDE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a GPU\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("STOKER_CUDA_REHEARSAL", None)
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "tests"],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        child = next(iter(case), None)
        outcome = "passed" if child is None else child.tag
        out[case.get("name")] = (outcome, (child.get("message") or "") if child is not None else "")
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rehearsal is what runs where no GPU is usable")
def test_only_torchs_no_cuda_error_becomes_a_skip_naming_where(tmp_path: Path) -> None:
    got = _run(tmp_path)
    outcome = {name: result[0] for name, result in got.items()}
    assert outcome == {
        "test_reaches_cuda_after_cpu_work": "skipped", "test_reaches_cuda_at_once": "skipped",
        "test_in_a_fixture": "skipped", "test_through_a_thread": "skipped",
        "test_a_stale_keyword": "failure", "test_a_wrong_layout": "failure",
        "test_an_error_that_only_mentions_cuda": "failure", "test_a_test_that_never_needs_the_gpu": "passed",
        "test_outside_tests_cuda_nothing_is_reported_available": "passed",
    }, got
    reason = {name: result[1] for name, result in got.items()}
    assert "ran on the CPU up to line" in reason["test_reaches_cuda_after_cpu_work"]
    assert "(x.cuda()), 2 lines into the body" in reason["test_reaches_cuda_after_cpu_work"]
    assert "nothing of the test body rehearsed" in reason["test_reaches_cuda_at_once"]
    assert "a fixture reached CUDA" in reason["test_in_a_fixture"]
    assert "raise RuntimeError" in reason["test_through_a_thread"]
    assert "prefetch" in reason["test_a_stale_keyword"]

