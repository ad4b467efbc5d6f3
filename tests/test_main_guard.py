"""A script that makes a `Workers(processes=1)` Loader from top-level code (no main guard) is told so
when the Loader is made, in one message naming the line and the guard, before any process starts;
the same script with the guard, or a call from a function the guard calls, is not refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stoker
from conftest import make_image_folder
from stoker.mainguard import unguarded_main_line

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("guard")
    stoker.pack(make_image_folder(root / "imgs", n_per_class=2), root / "packed", progress=False)
    return root / "packed"


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_top_level_code_is_named_before_a_process_starts(tmp_path: Path, packed: Path) -> None:
    done = run_script(tmp_path, f"""
        import stoker
        from stoker.transforms import Resize

        loader = stoker.Loader({str(packed)!r}, 4, transforms=[Resize((16, 16))],
                               workers=stoker.Workers(processes=1))
        for images, labels in loader:
            pass
        """)
    assert done.returncode != 0
    assert "line 5 of" in done.stderr and "train.py is top-level code" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr and "Workers(processes=0)" in done.stderr
    assert "bootstrapping" not in done.stderr and "spawn.py" not in done.stderr   # no child ever ran
    assert len(done.stderr.splitlines()) < 30


def test_guarded_code_and_functions_it_calls_run(tmp_path: Path, packed: Path) -> None:
    done = run_script(tmp_path, f"""
        import stoker
        from stoker.transforms import Resize


        def main():
            with stoker.Loader({str(packed)!r}, 4, transforms=[Resize((16, 16))],
                               workers=stoker.Workers(processes=1)) as loader:
                print(sum(len(labels) for _, labels in loader))


        if __name__ == "__main__":
            main()
        """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6"]


def test_unguarded_main_line_reads_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No script (an interactive session, `python -c`, this test runner's own main): nothing to refuse."""
    assert unguarded_main_line() is None   # called from a test function, not the main script's top level
    main = type(sys)("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert unguarded_main_line() is None   # no __file__
