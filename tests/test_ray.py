"""`pack --engine ray` on a local Ray instance (2 CPUs): the same dataset as a local pack, bad
records logged the same way, resumable."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'stoker[ray]'")

from stoker import packing  # noqa: E402
from stoker.cli import main  # noqa: E402
from stoker.errors import ConfigError  # noqa: E402
from stoker.packing import PackOptions, pack  # noqa: E402
from stoker.reader import open_dataset  # noqa: E402

from conftest import make_image_folder  # noqa: E402
from formats_helpers import CORRUPT_JPEG, photos  # noqa: E402

SHARD_SIZE = 12_000


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def messy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_image_folder(tmp_path_factory.mktemp("ray") / "imgs", n_per_class=12)
    (root / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (root / "dog" / "empty.jpg").write_bytes(b"")
    return root


def _contents(path: Path) -> tuple:
    with open_dataset(path, verify=True) as ds:
        m = ds.manifest
        rows = [(s.key, s.label, bytes(s.data), s.shard, s.row) for s in (ds.sample(i) for i in range(len(ds)))]
        return m.to_json() | {"created_by": None}, rows, (path / "skipped.jsonl").read_text()


def test_ray_pack_equals_local_pack(local_ray: None, messy: Path, tmp_path: Path) -> None:
    pack(messy, tmp_path / "local", options=PackOptions(workers=2, shard_size=SHARD_SIZE), progress=False)
    assert main(["pack", str(messy), str(tmp_path / "ray"), "--engine", "ray", "--shard-size", str(SHARD_SIZE),
                 "--no-progress"]) == 0
    local, remote = _contents(tmp_path / "local"), _contents(tmp_path / "ray")
    assert local == remote  # manifest (checksums), every sample's bytes, and the skipped records
    assert "broken.jpg" in local[2] and "empty.jpg" in local[2]


def test_ray_pack_resumes(local_ray: None, messy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pack(messy, tmp_path / "local", options=PackOptions(workers=1, shard_size=SHARD_SIZE), progress=False)
    real = packing._Packer.close_shard
    calls = []

    def crash_after_three(self: packing._Packer, consumed: int) -> None:
        if len(calls) == 3:
            raise KeyboardInterrupt  # interrupted after three finished shards
        calls.append(consumed)
        real(self, consumed)

    monkeypatch.setattr(packing._Packer, "close_shard", crash_after_three)
    options = PackOptions(shard_size=SHARD_SIZE, engine="ray")
    with pytest.raises(KeyboardInterrupt):
        pack(messy, tmp_path / "ray", options=options, progress=False)
    assert ray.is_initialized()  # the engine leaves an instance it did not start running
    monkeypatch.setattr(packing._Packer, "close_shard", real)
    pack(messy, tmp_path / "ray", options=options, resume=True, progress=False)
    assert _contents(tmp_path / "ray") == _contents(tmp_path / "local")


def _lmdb_source(root: Path) -> Path:
    lmdb = pytest.importorskip("lmdb", reason="pip install 'stoker[lmdb]'")
    imgs = photos(8)
    env = lmdb.open(str(root / "train.lmdb"), map_size=64 << 20)
    with env.begin(write=True) as txn:
        for i, blob in enumerate(imgs[:4] + [CORRUPT_JPEG] + imgs[4:]):
            txn.put(f"{i:03d}".encode(), blob)
    env.close()
    (root / "train.lmdb" / "labels.txt").write_text("".join(f"{i:03d} {i % 3}\n" for i in range(9)))
    return root / "train.lmdb"


def _hdf5_source(root: Path) -> Path:
    h5py = pytest.importorskip("h5py", reason="pip install 'stoker[hdf5]'")
    imgs = photos(9)
    imgs[6] = CORRUPT_JPEG
    with h5py.File(root / "train.h5", "w") as f:
        ds = f.create_dataset("images", (9,), dtype=h5py.vlen_dtype(np.uint8))
        for i, blob in enumerate(imgs):
            ds[i] = np.frombuffer(blob, np.uint8)
        f.create_dataset("labels", data=np.arange(9) % 2)
    return root / "train.h5"


@pytest.mark.parametrize("make", [_lmdb_source, _hdf5_source], ids=["lmdb", "hdf5"])
def test_ray_packs_sources_read_through_open_stores(local_ray: None, make: Any, tmp_path: Path) -> None:
    """An LMDB environment or an HDF5 file cannot be sent to a worker: the driver reads those
    records and sends the bytes; the dataset is the local pack's, the bad record skipped alike."""
    src = make(tmp_path)
    pack(src, tmp_path / "local", options=PackOptions(workers=1, shard_size=SHARD_SIZE), progress=False)
    pack(src, tmp_path / "ray", options=PackOptions(shard_size=SHARD_SIZE, engine="ray"), progress=False)
    local = _contents(tmp_path / "local")
    assert _contents(tmp_path / "ray") == local
    assert len(local[1]) == 8 and local[2].count("\n") == 1   # 8 packed, the corrupt one logged


def test_engine_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="engine"):
        PackOptions(engine="spark")
    with pytest.raises(ConfigError, match="address"):
        PackOptions(address="ray://head:10001")


def split_and_relabel(sample: Any) -> Any:
    """The pack function of the Ray test: class 0 dropped, class 1 halved into two samples."""
    if sample.label == 0:
        return None
    if sample.label == 1:
        w = sample.image.shape[1] // 2
        return [sample.replace(key=f"{sample.key}#a", image=sample.image[:, :w]),
                sample.replace(key=f"{sample.key}#b", image=sample.image[:, w:])]
    if sample.key.endswith("003.jpg"):
        raise ValueError("a failure of the function, on a Ray worker")
    return sample


def test_ray_runs_the_pack_function_like_a_local_pack(local_ray: None, messy: Path, tmp_path: Path) -> None:
    options = PackOptions(workers=2, shard_size=SHARD_SIZE, map=split_and_relabel)
    local = pack(messy, tmp_path / "local", options=options, progress=False)
    remote = pack(messy, tmp_path / "ray", options=replace(options, engine="ray"), progress=False)
    assert (remote.packed, remote.dropped, remote.skipped) == (local.packed, local.dropped, local.skipped)
    # cat (and its broken.jpg, never decoded) dropped; dog halved (its empty.jpg a bad file); eel/003 raised
    assert (local.dropped, local.packed, local.skipped) == (12 + 1, 2 * 12 + 12 - 1, 2)
    assert _contents(tmp_path / "local") == _contents(tmp_path / "ray")
    skipped = _contents(tmp_path / "ray")[2]
    assert "map function split_and_relabel raised ValueError: a failure of the function, on a Ray worker" in skipped
    assert '"key": "dog/empty.jpg"' in skipped and "map function" not in skipped.splitlines()[0]
