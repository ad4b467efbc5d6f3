"""Importing stoker works where POSIX-only modules do not exist (Windows), and writing shards leaves
no "Exception ignored" noise behind (Python 3.13 printed one per shard)."""

from __future__ import annotations

import gc
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from stoker.shards import ShardWriter, _HashingSink
from stoker.storage import LocalStorage
from stoker.loader.options import Workers

POSIX_ONLY = ("resource", "fcntl", "termios", "pwd", "grp", "posix")

# A child interpreter where every module in BLOCKED fails to import *when stoker's own code imports
# it* (the standard library and third-party packages keep theirs: Windows has their equivalents).
_CHILD = textwrap.dedent("""
    import importlib, pkgutil, sys
    BLOCKED = set(sys.argv[1].split(","))

    def importer_is_stoker():
        f = sys._getframe(1)
        while f is not None:
            name = f.f_globals.get("__name__", "")
            if not name.startswith(("importlib", "_frozen_importlib")) and f.f_code.co_name != "find_spec":
                return name == "stoker" or name.startswith("stoker.")
            f = f.f_back
        return False

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED and importer_is_stoker():
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: not on Windows)", name=name)
            return None

    for name in BLOCKED:
        sys.modules.pop(name, None)
    sys.meta_path.insert(0, Block())
    import stoker
    from stoker.errors import MissingDependencyError
    names = sorted(m.name for m in pkgutil.walk_packages(stoker.__path__, "stoker."))
    failed, no_torch = [], []
    for name in names:
        try:
            importlib.import_module(name)
        except MissingDependencyError:
            no_torch.append(name)
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    print("imported", len(names) - len(failed) - len(no_torch), "of", len(names))
    print("\\n".join(failed))
    sys.exit(1 if failed else 0)
""")


def _import_all(blocked: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    script = f"import sys; sys.path.insert(0, {src!r})\n" + _CHILD
    return subprocess.run([sys.executable, "-c", script, ",".join(blocked)], capture_output=True, text=True,
                          timeout=300)


def test_every_module_imports_without_posix_only_modules() -> None:
    proc = _import_all(POSIX_ONLY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = int(proc.stdout.split()[1])
    assert count >= 20   # the walk found the package's modules (loader and friends need torch)


def test_the_blocker_catches_a_top_level_posix_import() -> None:
    # the check above can fail: block a module that only stoker imports, at the top of codecs.py
    proc = _import_all(("simplejpeg",) + POSIX_ONLY)
    assert proc.returncode == 1
    assert "stoker.codecs: ModuleNotFoundError: No module named 'simplejpeg' (blocked" in proc.stdout


def test_cpu_seconds_without_resource(monkeypatch) -> None:
    import psutil

    from stoker import profiling

    psutil.Process().children(recursive=True)   # psutil's own platform modules load first
    monkeypatch.setitem(sys.modules, "resource", None)
    assert profiling.cpu_seconds() > 0


class _StrictSink:
    """A storage sink whose flush fails once committed or aborted, like a closed file."""

    def __init__(self, inner) -> None:
        self.inner, self.done = inner, False

    def write(self, data):
        return self.inner.write(data)

    def flush(self) -> None:
        if self.done:
            raise ValueError("flush of closed file")
        self.inner.flush()

    def commit(self) -> None:
        self.done = True
        self.inner.commit()

    def abort(self) -> None:
        self.done = True
        self.inner.abort()


def test_a_finished_or_aborted_shard_leaves_no_unraisable_exception(tmp_path: Path, monkeypatch) -> None:
    storage = LocalStorage(tmp_path)
    opened = storage.open_shard_sink
    monkeypatch.setattr(storage, "open_shard_sink", lambda name: _StrictSink(opened(name)))
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    for finish in (True, False):
        writer = ShardWriter(storage, 0 if finish else 1, batch_bytes=10)
        writer.add("a", b"x" * 64, "raw", 4, 4, 0)
        writer.add("b", b"y" * 64, "raw", 4, 4, 1)
        if finish:
            info = writer.finish()
            assert info.rows == 2
        else:
            writer.abort()
        del writer
        gc.collect()
    assert unraisable == []
    assert (tmp_path / "shard-00000.arrow").is_file() and not (tmp_path / "shard-00001.arrow").exists()


def test_the_hashing_sink_never_flushes_a_committed_file(tmp_path: Path, monkeypatch) -> None:
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    strict = _StrictSink(LocalStorage(tmp_path).open_shard_sink("shard-00000.arrow"))
    sink = _HashingSink(strict)
    sink.write(b"abc")
    sink.flush()
    strict.commit()     # the file is done; the wrapper is closed later (Python 3.13: by IOBase's finalizer)
    sink.close()        # the finalizer's call: up to 3.12 its errors were silent, 3.13 prints them
    del sink
    gc.collect()
    assert unraisable == []
    assert (tmp_path / "shard-00000.arrow").read_bytes() == b"abc"


def test_every_logger_stoker_uses_is_documented() -> None:
    """Users configure loggers by name: each name in the code appears in docs/loader.md's table."""
    root = Path(__file__).resolve().parents[1]
    names = set()
    for path in (root / "src" / "stoker").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        names.update(re.findall(r"""getLogger\(["']([\w.]+)["']\)""", text))
        assert "getLogger(__name__)" not in text, f"{path.name}: name the logger users configure, not the module"
        names.update(re.findall(r"""LOGGER_NAME = ["']([\w.]+)["']""", text))
    names -= {"PIL", "stoker"}   # the CLI quiets Pillow and attaches its handler to the parent logger
    assert names >= {"stoker.loader", "stoker.progress"}
    table = (root / "docs" / "loader.md").read_text(encoding="utf-8")
    assert [n for n in sorted(names) if f"| `{n}` |" not in table] == []


def test_skipped_samples_log_on_stoker_loader(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torch")
    from stoker import Loader, RandomResizedCrop

    folder = tmp_path / "imgs" / "a"
    folder.mkdir(parents=True)
    for i in range(4):
        Image.new("RGB", (20, 20), (i * 40, 0, 0)).save(folder / f"{i}.jpg")
    (folder / "bad.jpg").write_bytes(b"\xff\xd8\xffnot a jpeg")
    with caplog.at_level(logging.WARNING, logger="stoker.loader"):
        with Loader(tmp_path / "imgs", 5, transforms=[RandomResizedCrop(8)], 
                    order="sequential", workers=Workers(on_error="skip")) as loader:
            next(iter(loader))
    records = [r for r in caplog.records if "bad.jpg" in r.getMessage()]
    assert records and all(r.name == "stoker.loader" for r in records)
