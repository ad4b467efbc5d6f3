"""The CUDA tests' skip decisions, checked where they matter most: on this CPU machine a GPU test must
skip, never error, whatever state an optional library is in (a torchvision built for another torch
is found by find_spec but raises RuntimeError on import)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parent / "cuda" / "cuda_helpers.py"


def _helpers():
    spec = importlib.util.spec_from_file_location("stoker_cuda_helpers", HELPERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def broken_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_torchvision_that_raises_on_import_is_not_importable(broken_torchvision: None) -> None:
    helpers = _helpers()
    assert importlib.util.find_spec("torchvision") is not None   # what a find_spec skip would have trusted
    assert helpers.importable("torchvision") is False
    assert "torchvision" not in helpers.gpu_decoders()


def test_a_module_that_imports_is_importable() -> None:
    helpers = _helpers()
    assert helpers.importable("json") is True and helpers.importable("no_such_module_here") is False
