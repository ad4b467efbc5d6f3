"""ShardCache on its own: ordered prefetch, verification, the byte bound, eviction, retries, shutdown.

The storage here is a dict behind a range function; tests/test_remote.py runs the same cache
against a real S3 API over HTTP."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from stoker.errors import ConfigError, LoaderTimeoutError, ShardError
from stoker.shards import ShardInfo
from stoker._system import parse_size
from stoker.storage.cache import ShardCache, working_set_bytes


class Store:
    """Shards as bytes; counts range requests; can fail or cut requests on demand."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.blobs = {name: os.urandom(size) for name, size in sizes.items()}
        self.requests: list[tuple[str, int, int]] = []
        self.cut: dict[str, int] = {}  # name -> how many next requests return half their bytes
        self.fail: dict[str, int] = {}  # name -> how many next requests raise ConnectionResetError
        self.lock = threading.Lock()

    def infos(self) -> list[ShardInfo]:
        return [ShardInfo(n, 1, len(b), hashlib.sha256(b).hexdigest()) for n, b in self.blobs.items()]

    def fetch(self, name: str, start: int, end: int) -> bytes:
        with self.lock:
            self.requests.append((name, start, end))
            if self.fail.get(name):
                self.fail[name] -= 1
                raise ConnectionResetError("connection reset by peer")
            if self.cut.get(name):
                self.cut[name] -= 1
                return self.blobs[name][start:start + (end - start) // 2]
        return self.blobs[name][start:end]


def shard(i: int) -> str:
    return f"shard-{i:05d}.arrow"


def names(n: int) -> list[str]:
    return [shard(i) for i in range(n)]


def test_parse_size() -> None:
    assert parse_size("50GB") == 50 * 2**30  # binary multiples, as the CLI's --shard-size
    assert parse_size("1.5 MiB") == 3 * 2**19
    assert parse_size(4096) == 4096
    assert parse_size("2k") == 2048
    for bad in ("fifty", "5 parsecs", -1, True):
        with pytest.raises(ConfigError, match="size"):
            parse_size(bad)


def test_working_set_counts_overlapping_shards() -> None:
    sizes = {"a": 10, "b": 20, "c": 40}
    # a over positions 0-4, b over 3-9, c over 10-12: a and b overlap, c stands alone
    first, last = {"a": 0, "b": 3, "c": 10}, {"a": 4, "b": 9, "c": 12}
    assert working_set_bytes(first, last, sizes, lookahead=0) == 40
    assert working_set_bytes(first, last, sizes, lookahead=1) == 60  # c is needed while b is still read


def test_fetches_in_plan_order_verifies_and_hits_second_time(tmp_path: Path) -> None:
    store = Store({n: 3000 + i for i, n in enumerate(names(4))})
    with ShardCache(store.fetch, store.infos(), tmp_path, limit=10**6, threads=1, chunk_bytes=1000) as cache:
        order = names(4)[::-1]
        cache.plan(order)
        for name in order:
            path, _ = cache.get(name, timeout=10)
            assert path.read_bytes() == store.blobs[name]
            cache.release(name)
        assert cache.stats.fetched == order
        assert len(store.requests) == sum(-(-len(b) // 1000) for b in store.blobs.values())
        before = len(store.requests)
        cache.plan(order)
        for name in order:
            cache.get(name, timeout=10)
            cache.release(name)
        assert len(store.requests) == before  # everything was still cached
        assert cache.stats.hits >= 4
    # a new cache over the same directory adopts the verified files: no request at all
    with ShardCache(store.fetch, store.infos(), tmp_path, limit=10**6) as again:
        again.plan(order)
        for name in order:
            again.get(name, timeout=10)
            again.release(name)
        assert again.stats.adopted == 4 and len(store.requests) == before


def _size(p: Path) -> int:
    try:
        return p.stat().st_size if p.is_file() else 0
    except FileNotFoundError:  # evicted between the listing and the stat
        return 0


def test_never_exceeds_limit_and_evicts_released_shards(tmp_path: Path) -> None:
    store = Store({n: 1000 for n in names(8)})
    seen_on_disk = []
    with ShardCache(store.fetch, store.infos(), tmp_path, limit=2500, threads=3, chunk_bytes=300) as cache:
        cache.plan(names(8))
        for name in names(8):
            path, _ = cache.get(name, timeout=10)
            assert path.read_bytes() == store.blobs[name]
            seen_on_disk.append(sum(map(_size, tmp_path.iterdir())))
            time.sleep(0.02)  # let the downloaders run ahead as far as the limit allows
            cache.release(name)
        assert cache.stats.peak_bytes <= 2500
        assert cache.stats.evictions >= 6
    assert max(seen_on_disk) <= 2500


def test_a_shard_still_needed_is_never_evicted(tmp_path: Path) -> None:
    store = Store({n: 1000 for n in names(3)})
    with ShardCache(store.fetch, store.infos(), tmp_path, limit=2000, threads=2) as cache:
        cache.plan(names(3), uses={n: 2 for n in names(3)})
        a, _ = cache.get(shard(0), timeout=10)
        cache.get(shard(1), timeout=10)
        cache.release(shard(0))
        cache.release(shard(1))  # each still has one planned read left: shard 2 must wait
        with pytest.raises(LoaderTimeoutError, match="not downloaded within"):
            cache.get(shard(2), timeout=0.5)
        assert a.exists()
        cache.get(shard(0), timeout=10)
        cache.release(shard(0))  # shard 0 is done for the epoch: its room goes to shard 2
        path, _ = cache.get(shard(2), timeout=10)
        assert path.read_bytes() == store.blobs[shard(2)] and not a.exists()


def test_dropped_connections_are_retried(tmp_path: Path) -> None:
    store = Store({n: 5000 for n in names(2)})
    store.cut[shard(0)] = 2
    store.fail[shard(1)] = 3
    with ShardCache(store.fetch, store.infos(), tmp_path, limit=10**6, chunk_bytes=2000, backoff_s=0.01) as cache:
        cache.plan(names(2))
        for name in names(2):
            path, _ = cache.get(name, timeout=10)
            assert path.read_bytes() == store.blobs[name]
        assert cache.stats.retries == 5


def test_gives_up_after_retries_naming_the_shard(tmp_path: Path) -> None:
    store = Store({n: 500 for n in names(1)})
    store.fail[shard(0)] = 100
    with ShardCache(store.fetch, store.infos(), tmp_path, limit=10**6, retries=2, backoff_s=0.01,
                    where=lambda n: f"s3://bucket/ds/{n}") as cache:
        with pytest.raises(ShardError, match=r"s3://bucket/ds/shard-00000.arrow: range 0-500 failed 3 times"):
            cache.get(shard(0), timeout=10)
    assert not list(tmp_path.iterdir())  # no partial file left


def test_corrupt_shard_is_reported_never_served(tmp_path: Path) -> None:
    store = Store({n: 800 for n in names(2)})
    infos = store.infos()
    damaged = bytearray(store.blobs[shard(1)])
    damaged[100] ^= 0xFF
    store.blobs[shard(1)] = bytes(damaged)
    with ShardCache(store.fetch, infos, tmp_path, limit=10**6, where=lambda n: f"s3://b/ds/{n}") as cache:
        cache.plan(names(2))
        cache.get(shard(0), timeout=10)
        with pytest.raises(ShardError, match=r"s3://b/ds/shard-00001.arrow: checksum mismatch"):
            cache.get(shard(1), timeout=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{infos[0].sha256}.arrow"]


def test_limit_below_one_shard_is_refused(tmp_path: Path) -> None:
    store = Store({n: 800 for n in names(1)})
    with pytest.raises(ConfigError, match="cache_limit=500 bytes is smaller than shard shard-00000.arrow"):
        ShardCache(store.fetch, store.infos(), tmp_path, limit=500)


def test_close_stops_threads_and_removes_stale_partials(tmp_path: Path) -> None:
    stale = tmp_path / f".{'0' * 64}.999999999.tmp"  # a partial download of a process that is gone
    stale.write_bytes(b"x")
    store = Store({n: 100 for n in names(2)})
    before = set(threading.enumerate())
    cache = ShardCache(store.fetch, store.infos(), tmp_path, limit=10**6, threads=3)
    assert not stale.exists()
    cache.plan(names(2))
    cache.close()
    cache.close()
    assert set(threading.enumerate()) <= before
    with pytest.raises(ShardError, match="closed"):
        cache.get(shard(0), timeout=1)


def test_a_failing_download_thread_is_reported_not_waited_on(tmp_path: Path) -> None:
    store = Store({n: 100 for n in names(2)})
    with ShardCache(store.fetch, store.infos(), tmp_path, limit=10**6, threads=1) as cache:
        def broken(name: str) -> None:
            raise RuntimeError("callback bug")

        cache.on_evict(broken)
        cache.plan(names(1))
        cache.get(shard(0), timeout=10)
        cache.release(shard(0))
        cache.limit = 150  # room for one shard: fetching the next must evict, and the callback fails
        cache.plan([shard(1)])
        t0 = time.monotonic()
        with pytest.raises(ShardError, match="download thread failed: RuntimeError"):
            cache.get(shard(1), timeout=120)
        assert time.monotonic() - t0 < 60   # the failure at once, not the 120 s timeout
