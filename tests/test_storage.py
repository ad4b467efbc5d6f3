"""The storage seam: local folders, and URLs refused rather than turned into local folders."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

from stoker.audit import describe, verify
from stoker.cli import main
from stoker.errors import ShardError, UnsupportedStorageError
from stoker.packing import PackOptions, pack
from stoker.reader import open_dataset
from stoker.sources import open_source
from stoker.storage import LocalStorage, open_storage, url_scheme

#: URLs no installed backend serves here: an unknown scheme, and schemes whose fsspec package
#: (gcsfs, adlfs) is not one of stoker's extras. s3:// and https:// are served (tests/test_remote.py).
URLS = ["foo://bucket/ds", "gs://bucket/ds", "az://container/ds"]


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for k in range(3):
            rgb = np.full((12, 16, 3), 30 * k, np.uint8)
            (root / cls / f"{k}.jpg").write_bytes(simplejpeg.encode_jpeg(rgb, quality=90))
    return root


@pytest.mark.parametrize("url", URLS)
def test_urls_are_refused_by_every_entry_point(url: str, folder: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match=rf"{url}: .*(install|no installed fsspec backend)"):
        pack(folder, url, options=PackOptions(workers=1), progress=False)
    for call in (open_dataset, describe, verify):
        with pytest.raises(UnsupportedStorageError, match=rf"{url}: .*(install|no installed fsspec backend)"):
            call(url)
    for src in (url, "s3://bucket/images"):  # images to pack are local, whatever the scheme
        with pytest.raises(UnsupportedStorageError, match="images to pack are read from local paths"):
            open_source(src)
    scheme = url.split(":")[0]
    assert not (tmp_path / f"{scheme}:").exists(), "a URL must never become a local folder"


@pytest.mark.parametrize("command", ["pack", "info", "verify"])
def test_cli_refuses_urls_and_writes_nothing(command: str, folder: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [command, str(folder), "foo://bucket/ds", "--no-progress"] if command == "pack" else [command, "foo://bucket/ds"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    # with fsspec: no backend for foo://; without it (a bare install): the extra to install
    assert re.search(r"foo://bucket/ds: .*(no installed fsspec backend serves foo://|pip install 'stoker\[remote\]')",
                     err), err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_file_urls_and_paths_are_local(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(folder, f"file://{out}", options=PackOptions(workers=1), progress=False)
    with open_dataset(out) as ds, open_dataset(f"file://{out}") as same:
        assert len(ds) == len(same) == 6
    assert verify(f"file://{out}").ok
    with pytest.raises(UnsupportedStorageError, match="local path"):
        open_storage("file://otherhost/data")
    assert url_scheme("relative/dir") is None and url_scheme("C:/data") is None
    assert url_scheme(Path("s3://bucket/x")) == "s3", "a URL that went through pathlib is still a URL"


def test_local_storage_writes_atomically_and_streams_shards(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "ds")
    assert not store.is_dir()
    store.makedirs()
    store.write_atomic("small.json", b"{}")
    store.append_line("journal", "one")
    store.append_line("journal", "two")
    assert store.read_bytes("journal") == b"one\ntwo\n" and store.size("small.json") == 2

    sink = store.open_shard_sink("shard-00000.arrow")
    sink.write(b"abc")
    assert store.list() == [".shard-00000.arrow.tmp", "journal", "small.json"], "invisible until commit"
    sink.commit()
    assert store.read_bytes("shard-00000.arrow") == b"abc"
    assert store.sha256("shard-00000.arrow") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"

    dropped = store.open_shard_sink("shard-00001.arrow")
    dropped.write(b"partial")
    dropped.abort()
    dropped.abort()
    assert store.list() == ["journal", "shard-00000.arrow", "small.json"]
    store.remove("journal")
    store.remove("journal")  # missing is fine
    assert not store.exists("journal")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("journal")


def test_local_path_refuses_symlinks_out_of_the_dataset(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "ds")
    store.makedirs()
    (tmp_path / "elsewhere").write_bytes(b"x")
    (tmp_path / "ds" / "link.arrow").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ShardError, match="outside the dataset directory"):
        store.local_path("link.arrow")
    store.write_atomic("inside.arrow", b"y")
    assert store.local_path("inside.arrow") == tmp_path / "ds" / "inside.arrow"
    before = store.identity("inside.arrow")
    store.write_atomic("inside.arrow", b"yy")
    assert store.identity("inside.arrow") != before


@pytest.mark.parametrize("missing, hint", [("fsspec", "pip install 'stoker[remote]'"),
                                           ("s3fs", "pip install 'stoker[remote]' brings fsspec and s3fs")])
def test_a_missing_remote_extra_is_named(missing: str, hint: str, folder: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Without the packages the `remote` extra installs, an s3:// URL is refused by every entry
    point with the pip command to run, and nothing is written locally."""
    pytest.importorskip("fsspec")
    registry = sys.modules["fsspec.registry"]._registry
    monkeypatch.setitem(sys.modules, missing, None)   # `import missing` raises ImportError
    for scheme in ("s3", "s3a"):   # fsspec keeps a backend class once imported: forget it here
        monkeypatch.delitem(registry, scheme, raising=False)
    monkeypatch.chdir(tmp_path)
    url = "s3://bucket/ds"
    calls = [lambda: open_dataset(url), lambda: describe(url),
             lambda: pack(folder, url, options=PackOptions(workers=1), progress=False)]
    if importlib.util.find_spec("torch") is not None:   # this module also runs where torch is not installed
        from stoker import Loader

        calls.append(lambda: Loader(url, 4))
    for call in calls:
        with pytest.raises(UnsupportedStorageError, match=re.escape(hint)):
            call()
    assert main(["pack", str(folder), url, "--no-progress"]) == 2
    assert hint in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["src"], "a URL must never become a local folder"


def test_a_missing_ray_extra_is_named_before_anything_is_written(folder: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["pack", str(folder), str(tmp_path / "out"), "--engine", "ray", "--no-progress"]) == 2
    assert "pip install 'stoker[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
