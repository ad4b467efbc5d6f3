"""The tools' torchvision (`stoker.tools.tvimport`): one whose compiled ops do not load (PyPI's CUDA
build beside a CPU torch) still gives its transforms and models, and says so; one that does not import
at all, or is not installed, is named as such by the bench and the doctor, never as a traceback and
never as "not installed" when it is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import BrokenImport
from stoker.errors import ConfigError
from stoker.tools import tvimport


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """tvimport deciding again (it decides once per process), and torchvision imported anew."""
    monkeypatch.setattr(tvimport, "_STATE", {})
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)


def test_an_installed_torchvision_gives_transforms_and_models_whatever_its_ops(fresh: None) -> None:
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        pytest.skip('torchvision is not installed (pip install -e ".[test-torchvision]")')
    tv = tvimport.import_torchvision()
    assert tv is not None and tvimport.status().startswith(f"torchvision {tv.__version__}")
    from stoker.tools.baseline import baseline_transform
    from stoker.tools.train import load_model

    assert baseline_transform(True)[1] == f"torchvision {tv.__version__}"
    if not tv.extension._has_ops():   # this machine's case: a CUDA build beside a CPU torch
        assert "without its compiled ops" in tvimport.status()
    assert type(load_model("resnet18")).__name__ == "ResNet"
    assert type(load_model("torchvision.models:resnet18")).__name__ == "ResNet"


def test_a_torchvision_that_does_not_import_is_named_not_called_missing(fresh: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "meta_path", [BrokenImport("torchvision"), *sys.meta_path])
    assert tvimport.import_torchvision() is None
    status = tvimport.status()
    assert "does not import" in status and "torchvision::nms" in status and "not installed" not in status
    from stoker.tools.baseline import baseline_transform
    from stoker.tools.train import check_model

    assert status in baseline_transform(True)[1]   # the bench labels its fallback with why
    for spec in ("resnet50", "torchvision.models:resnet50"):
        with pytest.raises(ConfigError, match="does not import.*module:callable"):
            check_model(spec)


def test_a_missing_torchvision_is_named_with_its_install(fresh: None, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    class Missing:
        def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
            if fullname == "torchvision":
                raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")

    monkeypatch.setattr(sys, "meta_path", [Missing(), *sys.meta_path])
    assert tvimport.import_torchvision() is None
    assert tvimport.status().startswith("torchvision not installed (pip install torchvision")
