"""A fresh `pip install stoker` has no torch: pack, info, verify and NumPy batches must work without it,
and torch output must say how to install it. Each check runs in a child interpreter where `import torch` fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import make_image_folder

# Runs `code` with torch made unimportable (sys.modules["torch"] = None: what an install without
# torch looks like to `import torch`), then reports whether anything loaded torch after all.
_PRELUDE = "import sys\nsys.modules['torch'] = None\n"


def _run_without_torch(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    script = _PRELUDE + f"sys.path.insert(0, {src!r})\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_pack_info_verify_run_without_torch(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "imgs")
    proc = _run_without_torch("""
        from stoker.cli import main
        for argv in (["pack", "imgs", "packed", "--workers", "1"], ["info", "packed"],
                     ["verify", "packed", "--decode", "--workers", "1"]):
            rc = main(argv)
            assert rc == 0, (argv, rc)
        print("torch loaded:", sys.modules.get("torch") is not None)
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "torch loaded: False" in proc.stdout
    assert "packed 12 images" in proc.stdout
    assert (tmp_path / "packed" / "stoker.json").is_file()


def test_torch_outputs_without_torch_name_the_install_command(tmp_path: Path) -> None:
    # everything imports without torch (a Loader with device="numpy" needs none, tests/test_numpy_output.py);
    # what makes torch tensors says how to install it the moment it is asked for
    make_image_folder(tmp_path / "imgs")
    proc = _run_without_torch("""
        import stoker
        from stoker.errors import MissingDependencyError
        calls = {"Loader": lambda: stoker.Loader("imgs", 4), "DeviceOptions": lambda: stoker.DeviceOptions("cpu"),
                 "prefetch": lambda: stoker.prefetch([], "cpu")}
        for name, call in calls.items():
            try:
                call()
            except MissingDependencyError as exc:
                assert isinstance(exc, ImportError) and exc.package == "torch"
                print(name, "->", exc)
            else:
                raise SystemExit(f"stoker.{name} made torch output without torch")
        print("torch loaded:", sys.modules.get("torch") is not None)
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 4 and lines[-1] == "torch loaded: False"
    for line in lines[:3]:
        assert "PyTorch, which is not installed" in line
        assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in line   # CPU only
        assert "Apple silicon" in line and "CUDA" in line and "stoker[torch]" in line
    assert "device='numpy'" in lines[0]   # the Loader names the way without torch


def test_a_broken_torch_install_is_not_reported_as_missing(tmp_path: Path) -> None:
    # torch present but one of its own imports missing: the user must see that module's name
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("import a_module_torch_needs_but_lacks\n")
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {src!r}]\nimport stoker\nstoker.Loader\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "No module named 'a_module_torch_needs_but_lacks'" in proc.stderr
    assert "MissingDependencyError" not in proc.stderr
