"""Datasets in object storage, against a real S3 API over HTTP on localhost (moto's server behind a
recording proxy, see s3_helpers.py): same batches as local, the cache's promises, failures named."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("s3fs", reason="needs the remote extra: pip install 'stoker[remote]'")
pytest.importorskip("moto", reason="needs moto[server]: pip install -e '.[test-remote]'")

from s3_helpers import SHARD_SIZE, S3Server, pack_remote_set, s3, upload_pack  # noqa: E402,F401 (s3: a fixture)

from stoker import Loader, RandomResizedCrop  # noqa: E402
from stoker.audit import describe, verify  # noqa: E402
from stoker.errors import ConfigError, SampleError, ShardError  # noqa: E402
from stoker.packing import LOCK_NAME, PackOptions, pack  # noqa: E402
from stoker.reader import CachedDataset, open_dataset  # noqa: E402
from stoker.storage import RemoteStorage  # noqa: E402
from stoker.loader.options import Sampling, Storage, Workers

from conftest import make_image_folder  # noqa: E402



@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 shards of 2 small JPEGs (labels 0..2)."""
    return pack_remote_set(tmp_path_factory.mktemp("remote"))


_out_buckets = iter(range(10**6))


@pytest.fixture
def url(s3: S3Server, packed: Path) -> str:
    """A fresh bucket holding a copy of `packed`; the request log starts empty."""
    return upload_pack(s3, packed, "ds")


def remote_loader(s3: S3Server, url: str, cache: Path, *, cache_limit: Any = None, rank: int | None = None,
                  world_size: int | None = None, **kw: Any) -> Loader:
    kw.setdefault("transforms", [RandomResizedCrop(32)])
    limit = {} if cache_limit is None else {"cache_limit": cache_limit}
    storage = Storage(cache_dir=cache, storage_options=s3.storage_options(), **limit)
    return Loader(url, 8, seed=3, **kw, workers=2, storage=storage, sampling=Sampling(rank=rank, world_size=world_size))


def batches(loader: Loader) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(images.numpy().copy(), labels.numpy().copy()) for images, labels in loader]


def n_shards(packed: Path) -> int:
    return len(list(packed.glob("shard-*.arrow")))


@pytest.mark.parametrize("order", ["random", "shard_window"])
def test_batches_from_s3_equal_local_and_second_epoch_is_cached(s3: S3Server, url: str, packed: Path,
                                                                tmp_path: Path, order: str) -> None:
    assert n_shards(packed) == 24
    local = Loader(packed, 8, seed=3, transforms=[RandomResizedCrop(32)], order=order, workers=2)
    with remote_loader(s3, url, tmp_path / "cache", order=order) as remote:
        assert isinstance(remote.dataset, CachedDataset)
        for epoch in range(2):
            got, want = batches(remote), batches(local)
            assert len(got) == len(want)
            for (a, la), (b, lb) in zip(got, want):
                assert np.array_equal(a, b) and np.array_equal(la, lb)
            shard_gets = len(s3.log.gets(".arrow"))
            if epoch == 0:
                first = shard_gets
                assert remote.dataset.cache.stats.shards_fetched == n_shards(packed)
        assert shard_gets == first, "the second epoch downloaded again"
    local.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("stoker-cache")]  # closed with the Loader


def test_cache_never_exceeds_its_limit(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    sizes = sorted(f.stat().st_size for f in packed.glob("shard-*.arrow"))
    # room for 12 of the 24 two-sample shards: a window of 4 plus what the readers run ahead need
    assert len(sizes) == 24
    limit = sum(sizes[-12:])
    cache = tmp_path / "cache"
    on_disk: list[int] = []
    stop = threading.Event()

    def size(p: Path) -> int:
        try:
            return p.stat().st_size if p.is_file() and ".meta." not in p.name else 0
        except FileNotFoundError:   # evicted between the listing and the stat
            return 0

    def watch() -> None:
        while not stop.is_set():
            on_disk.append(sum(size(p) for p in cache.glob("*")) if cache.exists() else 0)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with Loader(url, 4, seed=3, transforms=[RandomResizedCrop(32)], 
                    order="shard_window", workers=Workers(num_threads=1, prefetch=1), storage=Storage(cache_dir=cache, cache_limit=limit, storage_options=s3.storage_options())) as loader:
            for _ in range(2):
                assert len(batches(loader)) == len(loader)
            stats = loader.dataset.cache.stats
    finally:
        stop.set()
        watcher.join()
    assert stats.peak_bytes <= limit and max(on_disk) <= limit
    assert stats.evictions > 0  # it really had to make room
    # a global random order needs every shard at once: refused up front, with the way out
    with pytest.raises(ConfigError, match="order='shard_window'.*or raise cache_limit"):
        with remote_loader(s3, url, tmp_path / "c2", order="random", cache_limit=limit) as loader:
            next(iter(loader))


def test_corrupt_shard_in_the_bucket_is_named(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    victim = sorted(packed.glob("shard-*.arrow"))[2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x55  # same size, one bit pattern changed
    s3.filesystem().pipe_file(f"{url[5:]}/{victim.name}", bytes(data))
    with remote_loader(s3, url, tmp_path / "cache", order="sequential") as loader:
        with pytest.raises(SampleError) as info:
            batches(loader)
    cause = info.value.__cause__
    assert isinstance(cause, ShardError)
    assert f"{url}/{victim.name}: checksum mismatch" in str(cause)
    assert not list((tmp_path / "cache").glob(".*.tmp"))  # nothing half-written left behind


def test_dropped_connection_mid_shard_is_retried(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    victim = sorted(packed.glob("shard-*.arrow"))[1].name
    local = Loader(packed, 8, seed=3, transforms=[RandomResizedCrop(32)], order="sequential", workers=2)
    s3.log.cut[victim] = 2  # the first two GETs of this shard stop after half their body
    with remote_loader(s3, url, tmp_path / "cache", order="sequential") as remote:
        got = batches(remote)
    assert s3.log.cut[victim] == 0  # both cuts happened
    assert len(s3.log.gets(victim)) >= 3
    for (a, la), (b, lb) in zip(got, batches(local)):
        assert np.array_equal(a, b) and np.array_equal(la, lb)
    local.close()


def _whole_shard_gets(s3: S3Server, packed: Path) -> dict[str, int]:
    """Shard file -> bytes, for each shard downloaded whole (as the proxy saw it), not the small
    ranged reads of its footer and label/size columns."""
    sizes = {f.name: f.stat().st_size for f in packed.glob("shard-*.arrow")}
    whole = {}
    for r in s3.log.gets(".arrow"):
        name = r.path.rsplit("/", 1)[-1].split("?")[0]
        first, last = (int(v) for v in re.match(r"bytes=(\d+)-(\d+)", r.range).groups())
        if first == 0 and last + 1 >= sizes[name]:
            whole[name] = sizes[name]
    return whole


def test_two_ranks_split_the_shards(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    total = n_shards(packed)
    seen, fetched, lengths, downloaded = [], [], [], []
    for rank in range(2):
        s3.reset_log()
        with remote_loader(s3, url, tmp_path / f"cache{rank}", order="shard_window", rank=rank,
                           world_size=2) as loader:
            idx = loader.epoch_indices(0)
            lengths.append(len(loader))
            assert len(batches(loader)) == len(loader)
            seen.append(set(idx.tolist()))
            fetched.append(set(loader.dataset.cache.stats.fetched))
        downloaded.append(_whole_shard_gets(s3, packed))
    assert lengths[0] == lengths[1]
    shard_bytes = sum(f.stat().st_size for f in packed.glob("shard-*.arrow"))
    for got, mine in zip(downloaded, fetched):   # what went over the wire: about half each
        assert set(got) == mine and sum(got.values()) <= shard_bytes * (total // 2 + 1) / total * 1.05
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(48))
    for f in fetched:
        assert len(f) <= total // 2 + 1  # about half the shards each, plus the one cut between them
    assert len(fetched[0] | fetched[1]) == total
    assert (tmp_path / "cache0" / "rank-0").is_dir() and (tmp_path / "cache1" / "rank-1").is_dir()


def test_info_and_verify_accept_urls(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    opts = {"storage_options": s3.storage_options(), "cache_dir": tmp_path / "cache"}
    info = describe(RemoteStorage(url, **opts))
    assert info.samples == 48 and info.shards == n_shards(packed)
    assert verify(RemoteStorage(url, **opts)).ok
    victim = sorted(packed.glob("shard-*.arrow"))[0]
    s3.filesystem().pipe_file(f"{url[5:]}/{victim.name}", victim.read_bytes()[:-10])
    report = verify(RemoteStorage(url, storage_options=s3.storage_options(), cache_dir=tmp_path / "other"))
    assert not report.ok and victim.name in report.format()


def test_open_dataset_takes_the_storage_options(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    options = Storage(cache_dir=tmp_path / "mine", storage_options=s3.storage_options())
    with open_dataset(url, storage=options) as ds, open_dataset(packed) as local:
        assert isinstance(ds, CachedDataset) and np.array_equal(ds.sample(3).data, local.sample(3).data)
    assert any((tmp_path / "mine").rglob("*.arrow"))   # the shard was cached where the options say


def test_open_dataset_reads_samples_on_demand(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    with open_dataset(packed) as local, \
            open_dataset(RemoteStorage(url, storage_options=s3.storage_options(), cache_dir=tmp_path / "c")) as ds:
        assert len(ds) == len(local) and np.array_equal(ds.labels, local.labels)
        assert s3.log.gets(".arrow") and all(r.range for r in s3.log.gets(".arrow"))  # metadata: ranged reads
        before = ds.cache.stats.shards_fetched
        assert before == 0
        for i in (0, 47, 20):
            a, b = ds.sample(i), local.sample(i)
            assert (a.key, bytes(a.data), a.label, a.shard, a.row) == (b.key, bytes(b.data), b.label, b.shard, b.row)
        assert ds.cache.stats.shards_fetched == 3


# ---- packing straight to object storage ---------------------------------------------------------

def _dataset_rows(ds: Any) -> list[tuple]:
    return [(s.key, s.label, bytes(s.data), s.shard) for s in (ds.sample(i) for i in range(len(ds)))]


@pytest.fixture
def bucket(s3: S3Server) -> str:
    name = f"out{next(_out_buckets)}"
    s3.filesystem().mkdir(name)
    s3.reset_log()
    return name


def test_pack_to_s3_equals_a_local_pack_manifest_last(s3: S3Server, bucket: str, packed: Path,
                                                      tmp_path: Path) -> None:
    url = f"s3://{bucket}/ds"
    summary = pack(packed.parent / "imgs", RemoteStorage(url, storage_options=s3.storage_options()),
                   options=PackOptions(workers=1, shard_size=SHARD_SIZE), progress=False)
    assert summary.out == url and f"in {url}:" in summary.format()
    puts = [r.path for r in s3.log.requests if r.method == "PUT" and "/ds/" in r.path]
    assert puts[-1].endswith("/ds/stoker.json"), "the manifest must be the last object written"
    names = {p.rsplit("/", 1)[-1] for p in s3.filesystem().ls(f"{bucket}/ds")}
    # journal gone, nothing else left (the lock of a pack into a URL is a local file: see RemoteStorage.lock)
    assert names == {f.name for f in packed.iterdir()} - {LOCK_NAME}
    remote = RemoteStorage(url, storage_options=s3.storage_options(), cache_dir=tmp_path / "cache")
    with open_dataset(remote) as ds, open_dataset(packed) as local:
        assert [s.sha256 for s in ds.manifest.shards] == [s.sha256 for s in local.manifest.shards]
        assert _dataset_rows(ds) == _dataset_rows(local)


def test_cli_pack_to_s3_resumes_after_a_kill(s3: S3Server, bucket: str, packed: Path, tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    url = f"s3://{bucket}/ds"
    env = {**os.environ, **s3.env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "stoker.cli", "pack", str(packed.parent / "imgs"), url, "--workers", "1",
           "--shard-size", str(SHARD_SIZE), "--no-progress"]
    s3.log.slow_put["/ds/shard-"] = 0.25  # slow uploads, so the kill lands mid-pack
    cwd = tmp_path / "cwd"   # where a URL mistaken for a path would leave an `s3:` folder
    cwd.mkdir()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while sum(r.method == "PUT" and "/ds/shard-" in r.path for r in s3.log.requests) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    remote = RemoteStorage(url, storage_options=s3.storage_options(), cache_dir=tmp_path / "cache")
    from stoker.errors import IncompletePackError
    with pytest.raises(IncompletePackError, match="--resume"):
        open_dataset(remote)  # shards but no manifest: never taken for a finished dataset
    uploaded_before = {r.path for r in s3.log.requests if r.method == "PUT" and "/ds/shard-" in r.path}
    s3.log.slow_put.clear()
    done = subprocess.run([*cmd, "--resume"], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"in {url}:" in done.stdout and not list(cwd.iterdir()), "nothing may be written locally"
    again = [r.path for r in s3.log.requests if r.method == "PUT" and "/ds/shard-" in r.path]
    assert len(again) - len(uploaded_before) < 24  # finished shards were kept, not uploaded again
    with open_dataset(remote) as ds, open_dataset(packed) as local:
        assert [s.sha256 for s in ds.manifest.shards] == [s.sha256 for s in local.manifest.shards]
        assert _dataset_rows(ds) == _dataset_rows(local)
    env["STOKER_CACHE"] = str(tmp_path / "cli-cache")
    info = subprocess.run([sys.executable, "-m", "stoker.cli", "info", url], env=env, capture_output=True, text=True,
                          timeout=120)
    assert info.returncode == 0 and "samples     48 in 24 shard(s)" in info.stdout, info.stderr
    checked = subprocess.run([sys.executable, "-m", "stoker.cli", "verify", url], env=env, capture_output=True,
                             text=True, timeout=120)
    assert checked.returncode == 0 and "24 shard(s) checked" in checked.stdout, checked.stderr


def test_a_dropped_loader_stops_its_download_threads(s3: S3Server, url: str, tmp_path: Path) -> None:
    import gc

    loader = remote_loader(s3, url, tmp_path / "cache", order="shard_window")
    next(iter(loader))
    assert [t for t in threading.enumerate() if t.name.startswith("stoker-cache")]
    del loader   # never closed
    gc.collect()
    deadline = time.monotonic() + 10
    while [t for t in threading.enumerate() if t.name.startswith("stoker")] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name.startswith("stoker")]


def test_resume_mid_epoch_from_s3(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    with remote_loader(s3, url, tmp_path / "cache", order="shard_window") as full:
        want = batches(full)
    with remote_loader(s3, url, tmp_path / "cache2", order="shard_window") as first:
        it = iter(first)
        for _ in range(2):
            next(it)
        state = first.state_dict()
    with remote_loader(s3, url, tmp_path / "cache3", order="shard_window") as resumed:
        resumed.load_state_dict(state)
        got = batches(resumed)
    assert len(got) == len(want) - 2
    for (a, la), (b, lb) in zip(got, want[2:]):
        assert np.array_equal(a, b) and np.array_equal(la, lb)


def test_a_dataset_over_plain_http(s3: S3Server, packed: Path, tmp_path: Path) -> None:
    """Any fsspec URL: here http(s)://, objects served by the same HTTP server to anyone (public-read),
    with no folder listing to rely on. Same batches as local; a denied URL is a clear error."""
    from stoker.errors import ManifestError

    fs = s3.filesystem()
    fs.mkdir("public")
    for f in sorted(packed.iterdir()):
        fs.put_file(str(f), f"public/packed/{f.name}")
        fs.chmod(f"public/packed/{f.name}", acl="public-read")
    url = f"{s3.endpoint}/public/packed"
    local = Loader(packed, 8, seed=3, transforms=[RandomResizedCrop(32)], order="shard_window", workers=2)
    with Loader(url, 8, seed=3, transforms=[RandomResizedCrop(32)], order="shard_window", workers=2, storage=Storage(cache_dir=tmp_path / "cache")) as remote:
        got, want = batches(remote), batches(local)
    local.close()
    assert len(got) == len(want) == 6
    for (a, la), (b, lb) in zip(got, want):
        assert np.array_equal(a, b) and np.array_equal(la, lb)
    fs.put_file(str(packed / "stoker.json"), "public/private/stoker.json")   # not public-read: 403
    with pytest.raises(ManifestError, match=r"/public/private/stoker.json: cannot read the manifest: .*403"):
        Loader(f"{s3.endpoint}/public/private", 8, storage=Storage(cache_dir=tmp_path / "c2"))


def test_readme_cloud_section_runs_as_written(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guide's (docs/guide.md) "Datasets in the cloud and on clusters" commands and code, copied as they are,
    against this S3 server (the credentials and endpoint from the environment, as a user's shell
    has them). Only locations are moved into tmp_path (/dev/shm, /scratch); the `--address` line
    needs a running Ray cluster, and the same command without it runs here."""
    import gc
    import re
    import shlex

    from stoker.cli import main

    pytest.importorskip("ray", reason="needs the ray extra: pip install 'stoker[ray]'")
    readme = (Path(__file__).parents[1] / "docs" / "guide.md").read_text()
    section = readme.split("## Datasets in the cloud and on clusters", 1)[1].split("\n## ", 1)[0]
    shell, python = re.findall(r"```(?:bash|python)\n(.*?)```", section, flags=re.S)
    assert "Loader(" in python and "stoker pack" in shell

    def here(text: str) -> str:
        return text.replace("/dev/shm", str(tmp_path / "shm")).replace("/scratch", str(tmp_path / "scratch"))

    (tmp_path / "shm").mkdir()
    make_image_folder(tmp_path / "data" / "train", n_per_class=6)
    monkeypatch.chdir(tmp_path)
    for key, value in {**s3.env(), "STOKER_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    s3.filesystem().mkdir("my-bucket")
    ran = []
    for line in shell.strip().splitlines():
        argv = shlex.split(here(line.split("#", 1)[0]))
        assert argv[0] == "stoker"
        if "--address" in argv:
            continue
        assert main(argv[1:]) == 0, line
        ran.append(argv[1])
    assert ran == ["pack", "pack", "info", "verify", "pack", "stage", "stage"]
    assert not list((tmp_path / "shm").iterdir())   # the staged copy was removed
    namespace: dict[str, Any] = {}
    exec(compile(here(python), "docs/guide.md", "exec"), namespace)
    loader = namespace["loader"]
    images, labels = next(iter(loader))
    assert tuple(images.shape) == (18, 3, 224, 224)  # 3 classes of 6: one batch
    loader.close()
    del namespace, loader
    gc.collect()
    assert not [t for t in threading.enumerate() if t.name.startswith("stoker")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "data", "scratch", "shm"]


def test_a_second_pack_into_the_same_url_fails_at_once(s3: S3Server, bucket: str, packed: Path, tmp_path: Path) -> None:
    url = f"s3://{bucket}/ds"
    opts = {"storage_options": s3.storage_options(), "cache_dir": tmp_path / "cache"}
    with RemoteStorage(url, **opts).lock(LOCK_NAME):   # a first pack, still running on this machine
        with pytest.raises(ConfigError, match="being written by another pack: pid"):
            pack(packed.parent / "imgs", RemoteStorage(url, **opts), options=PackOptions(workers=1), progress=False)
    assert not [r for r in s3.log.requests if r.method == "PUT"]   # nothing written to the bucket


def test_persistent_loader_over_s3_gives_the_same_epochs(s3: S3Server, url: str, packed: Path, tmp_path: Path) -> None:
    """persistent=True: each epoch still hands the cache its own order (the pipeline restarts per
    epoch for a remote dataset); the batches are those of a local persistent Loader."""
    local = Loader(packed, 8, seed=3, transforms=[RandomResizedCrop(32)], order="shard_window",
                   workers=Workers(num_threads=2, persistent=True))
    with remote_loader(s3, url, tmp_path / "cache", order="shard_window", persistent_workers=True) as remote:
        for _ in range(2):
            for (a, la), (b, lb) in zip(batches(remote), batches(local), strict=True):
                assert np.array_equal(a, b) and np.array_equal(la, lb)
    local.close()
