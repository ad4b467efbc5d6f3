"""The remote shard cache under hostile conditions, against a real S3 API on localhost (moto's server
behind the recording proxy of tests/s3_helpers.py): a damaged cached file, two processes sharing one
cache folder, a full disk under the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("s3fs", reason="needs the remote extra: pip install 'stoker[remote]'")
pytest.importorskip("moto", reason="needs moto[server]: pip install -e '.[test-remote]'")

from stoker import Loader, RandomResizedCrop, Storage, Workers  # noqa: E402
from stoker.audit import verify  # noqa: E402
from stoker.errors import OutputError  # noqa: E402
from stoker.packing import PackOptions, pack  # noqa: E402
from stoker.shards import read_manifest  # noqa: E402
from stoker.storage import LocalStorage, RemoteStorage  # noqa: E402

from .rhelpers import TESTS  # noqa: E402

sys.path.insert(0, str(TESTS))
from s3_helpers import SHARD_SIZE, S3Server, pack_remote_set, s3, upload_pack  # noqa: E402,F401 (s3: a fixture)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 shards of 2 small JPEGs (labels 0..2)."""
    return pack_remote_set(tmp_path_factory.mktemp("remote-faults"))


@pytest.fixture
def url(s3: S3Server, packed: Path) -> str:
    """A fresh bucket holding a copy of `packed`; the request log starts empty."""
    return upload_pack(s3, packed, "faults")


def batches(source: Any, **kw: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    on_error = kw.pop("on_error", "raise")
    with Loader(source, 8, workers=Workers(num_threads=2, on_error=on_error), seed=3,
                transforms=[RandomResizedCrop(32)], order="sequential", storage=Storage(**kw)) as loader:
        return [(images.numpy().copy(), labels.numpy().copy()) for images, labels in loader]


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (a, la), (b, lb) in zip(got, want):
        assert np.array_equal(la, lb)
        assert np.array_equal(a, b)


def test_damaged_cached_shard_is_hashed_and_fetched_again(s3: S3Server, url: str, packed: Path,
                                                          tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    want = batches(packed)
    assert_same(batches(url, cache_dir=cache, storage_options=s3.storage_options()), want)
    manifest = read_manifest(LocalStorage(packed))
    victim = manifest.shards[3]
    cached = cache / f"{victim.sha256}.arrow"
    data = bytearray(cached.read_bytes())
    for k in range(len(data) // 3, 2 * len(data) // 3, 97):  # image bytes, same size: trusted by name and size
        data[k] ^= 0x5A
    cached.write_bytes(bytes(data))
    s3.reset_log()
    assert_same(batches(url, cache_dir=cache, storage_options=s3.storage_options()), want)
    assert s3.log.gets(victim.file), "the damaged copy was not fetched again"
    assert len({r.path.split("?")[0] for r in s3.log.gets(".arrow")}) == 1  # only the damaged one
    # verify blames nothing: the bucket is intact, the cache repairs itself
    cached.write_bytes(bytes(data))
    report = verify(RemoteStorage(url, storage_options=s3.storage_options(), cache_dir=cache))
    assert report.ok, report.format()


def test_damaged_cached_labels_are_read_again(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    want = batches(packed)
    assert_same(batches(url, cache_dir=cache, storage_options=s3.storage_options()), want)
    metas = sorted(cache.glob("*.meta.arrow"))
    assert metas
    for meta in metas:  # rows and columns as expected, labels changed: parses fine, says the wrong thing
        with pa.memory_map(str(meta)) as mm:
            table = pa.ipc.open_file(mm).read_all()
        labels = pa.array([(v + 1) % 3 for v in table.column("label").to_pylist()], table.schema.field("label").type)
        table = table.set_column(table.schema.get_field_index("label"), "label", labels)
        with pa.OSFile(str(meta), "wb") as out, pa.ipc.new_file(out, table.schema) as writer:
            writer.write_table(table)
    assert_same(batches(url, cache_dir=cache, storage_options=s3.storage_options()), want)


_SHARING_JOB = textwrap.dedent("""
    import json, sys
    from stoker import Loader, RandomResizedCrop, Storage, Workers
    url, options, cache, limit, epochs, seed = sys.argv[1:]
    with Loader(url, 4, workers=Workers(num_threads=2, prefetch=1), seed=int(seed), transforms=[RandomResizedCrop(32)],
                order="shard_window", storage=Storage(cache_dir=cache, cache_limit=int(limit),
                storage_options=json.loads(options))) as loader:
        for epoch in range(int(epochs)):
            loader.set_epoch(epoch)
            n = sum(len(labels) for _, labels in loader)
            assert n == len(loader.dataset), n
    print("done", flush=True)
""")


def test_two_jobs_sharing_a_cache_folder_do_not_evict_each_other(s3: S3Server, url: str, packed: Path,
                                                                 tmp_path: Path) -> None:
    sizes = sorted(f.stat().st_size for f in packed.glob("shard-*.arrow"))
    limit = sum(sizes[-12:])  # half the dataset: every job evicts all the time
    cache = tmp_path / "shared-cache"
    jobs = [subprocess.Popen([sys.executable, "-c", _SHARING_JOB, url, json.dumps(s3.storage_options()), str(cache),
                              str(limit), "4", str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for seed in (1, 2)]
    failures = []
    for job in jobs:
        try:
            out, err = job.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in jobs:
                other.kill()
            pytest.fail("a job sharing the cache folder hung")
        if job.returncode != 0 or "done" not in out:
            failures.append(err[-2000:])
    assert not failures, "\n---\n".join(failures)


def test_full_disk_under_the_cache_names_the_cache_folder(s3: S3Server, url: str, packed: Path,
                                                          tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux), whose every write fails with ENOSPC, as a full disk's do")
    cache = tmp_path / "cache"
    cache.mkdir()
    # every download's temporary file of this process lands on /dev/full: the kernel's own ENOSPC
    for info in read_manifest(LocalStorage(packed)).shards:
        (cache / f".{info.sha256}.{os.getpid()}.tmp").symlink_to("/dev/full")
    with pytest.raises(OutputError) as caught:
        batches(url, cache_dir=cache, storage_options=s3.storage_options(), on_error="skip")
    message = str(caught.value)
    assert str(cache) in message and "disk is full" in message
    assert "needs" in message and "bytes" in message and "cache_dir" in message
    assert url not in message.split(" while downloading ")[0]  # the folder is to blame, not the bucket
    assert "re-pack" not in message


def test_staging_onto_a_file_system_that_fills_up_names_it(packed: Path, tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux), whose every write fails with ENOSPC, as a full disk's do")
    from stoker.staging import _copy_verified
    info = read_manifest(LocalStorage(packed)).shards[0]
    dest = tmp_path / "shm"
    dest.mkdir()
    # what a second stager filling the tmpfs since the free-space check looks like: the kernel's ENOSPC
    (dest / f".{info.file}.tmp").symlink_to("/dev/full")
    with pytest.raises(OutputError) as caught:
        _copy_verified(packed / info.file, dest / info.file, info.sha256, info.bytes)
    assert str(dest) in str(caught.value) and "filled up" in str(caught.value) and "bytes" in str(caught.value)


def test_cache_limit_error_under_shard_window_names_a_fix_that_applies(s3: S3Server, url: str, packed: Path,
                                                                       tmp_path: Path) -> None:
    from stoker.errors import ConfigError
    biggest = max(f.stat().st_size for f in packed.glob("shard-*.arrow"))
    with pytest.raises(ConfigError) as caught:
        with Loader(url, 8, workers=2, order="shard_window", transforms=[RandomResizedCrop(32)],
                    storage=Storage(cache_dir=tmp_path / "c", cache_limit=biggest,
                                    storage_options=s3.storage_options())) as loader:
            next(iter(loader))
    message = str(caught.value)
    assert "order='shard_window'" not in message  # it already is
    assert "raise Storage(cache_limit=) to at least" in message and "lower Workers(prefetch=)" in message
