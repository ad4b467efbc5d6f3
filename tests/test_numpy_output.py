"""`Loader(device="numpy")`: NumPy batches with the torch output's layout, determinism, resume and
lifetime contract, with or without torch installed (this module is torch-free: CI also runs it in
clean venvs without torch)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import make_image_folder
import stoker
from stoker import Loader, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize, pack
from stoker.errors import ConfigError
from stoker.packing import PackOptions

TRAIN = [RandomResizedCrop(24), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 JPEGs of 3 classes, packed."""
    root = tmp_path_factory.mktemp("numpy-output")
    make_image_folder(root / "imgs")
    pack(root / "imgs", root / "packed", options=PackOptions(workers=1), progress=False)
    return root / "packed"


def _numpy_loader(packed: Path, **kw) -> Loader:
    workers = stoker.Workers(num_threads=2, prefetch=kw.pop("prefetch", 2), pin_memory=kw.pop("pin_memory", None))
    return Loader(packed, 4, transforms=kw.pop("transforms", TRAIN), seed=kw.pop("seed", 3), workers=workers,
                  device=kw.pop("device", "numpy"), **kw)


def test_batches_are_numpy_nchw_views_with_fresh_labels(packed: Path) -> None:
    with _numpy_loader(packed, order="sequential") as loader:
        batches = [(x.copy(), y) for x, y in loader]
    assert len(batches) == 3
    for x, y in batches:
        assert type(x) is np.ndarray and x.dtype == np.uint8 and x.shape == (4, 3, 24, 24)
        assert type(y) is np.ndarray and y.dtype == np.int64 and y.shape == (4,)
    assert np.concatenate([y for _, y in batches]).tolist() == [0] * 4 + [1] * 4 + [2] * 4
    with _numpy_loader(packed) as loader:
        x, y = next(iter(loader))
        # channels_last strides over the slot's [B, H, W, 3] rows, as the torch output: a view, no copy
        assert x.strides == (24 * 24 * 3, 1, 24 * 3, 3) and x.base is not None and not x.flags.owndata
        assert y.flags.owndata   # labels are the caller's own


def test_same_seed_same_batches_and_state_dict_resumes(packed: Path) -> None:
    def epoch(loader: Loader) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(x.copy(), y) for x, y in loader]

    with _numpy_loader(packed) as a, _numpy_loader(packed) as b:
        first, again = epoch(a), epoch(b)
        assert all(np.array_equal(x1, x2) and np.array_equal(y1, y2) for (x1, y1), (x2, y2) in zip(first, again))
        assert not all(np.array_equal(x1, x2) for (x1, _), (x2, _) in zip(first, epoch(a)))   # epoch 1 differs
    with _numpy_loader(packed) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    with _numpy_loader(packed) as resumed:
        resumed.load_state_dict(state)
        rest = epoch(resumed)
    assert len(rest) == 2
    assert all(np.array_equal(x1, x2) and np.array_equal(y1, y2) for (x1, y1), (x2, y2) in zip(first[1:], rest))


def test_a_held_view_is_never_overwritten_and_a_dropped_one_is_reused(packed: Path) -> None:
    with _numpy_loader(packed, prefetch=1) as loader:   # a ring of 3 slots
        ring = 1 + 2
        for _ in range(3):   # the common loop: every slot is reused, none allocated past the ring
            for x, y in loader:
                pass
        del x, y
        assert loader.stats.slots_allocated == ring
        # a slice of a batch and a memoryview of another keep their slots from the workers
        it = iter(loader)
        kept = next(it)[0][1:2]
        seen = kept.copy()
        view = memoryview(next(it)[0])
        seen_view = np.asarray(view).copy()
        for _ in it:
            pass
        for _ in loader:   # another whole epoch: new pixels everywhere else
            pass
        assert np.array_equal(kept, seen) and np.array_equal(np.asarray(view), seen_view)
        assert loader.stats.slots_allocated == ring + 2   # each kept batch was replaced by a fresh slot
        del kept, view
        gc.collect()
        assert loader._passes._ring.live_kept() == []   # dropping them releases them


def test_pad_sizes_and_extras_are_numpy(packed: Path) -> None:
    with _numpy_loader(packed, transforms=[Resize(20)], targets=stoker.Targets(pad=True), order="sequential") as loader:
        x, y, extras = next(iter(loader))
    sizes = extras["sizes"]
    assert type(sizes) is np.ndarray and sizes.dtype == np.int64 and sizes.shape == (4, 2)
    assert x.shape[0] == 4 and (sizes.min(axis=1) == 20).all()
    for row, (h, w) in zip(x, sizes):
        assert not row[:, h:, :].any() and not row[:, :, w:].any()   # zero padding past each image


def test_wrong_combinations_are_loud(packed: Path) -> None:
    with pytest.raises(ConfigError, match="pin_memory=True"):
        _numpy_loader(packed, pin_memory=True)
    with pytest.raises(ConfigError, match="the batch ops Normalize run on torch tensors"):
        _numpy_loader(packed, transforms=[*TRAIN, Normalize()])
    with _numpy_loader(packed) as loader, pytest.raises(ConfigError, match="without device='numpy' for them"):
        loader.iter_on("cpu")


def test_numpy_batches_need_no_torch(packed: Path) -> None:
    # an interpreter where `import torch` fails, as in an install without it
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None
        sys.path.insert(0, {src!r})
        import stoker
        with stoker.Loader({str(packed)!r}, 4, transforms=[stoker.RandomResizedCrop(16)], device="numpy",
                           workers=2) as loader:
            shapes = [(type(x).__name__, x.shape, y.dtype.name) for x, y in loader]
        print(shapes, "torch loaded:", sys.modules.get("torch") is not None)
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{[('ndarray', (4, 3, 16, 16), 'int64')] * 3} torch loaded: False"


def test_numpy_batches_equal_torch_batches(packed: Path) -> None:
    torch = pytest.importorskip("torch")   # present wherever the full test suite runs
    with _numpy_loader(packed) as a, Loader(packed, 4, transforms=TRAIN, seed=3, workers=2) as b:
        for (x, y), (tx, ty) in zip(a, b, strict=True):
            assert torch.equal(torch.from_numpy(x), tx) and torch.equal(torch.from_numpy(y), ty)


def test_label_rows_and_label_maps_encode_as_numpy() -> None:
    from stoker.loading.labels import MultiLabel
    from stoker.transforms.targets import stack_label_map_arrays

    rows = [[0, 2], [3], []]
    hot = MultiLabel("multi-hot", 4).arrays(rows)
    assert hot.dtype == np.float32 and hot.tolist() == [[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
    idx = MultiLabel("indices", 4).arrays(rows)
    assert idx.dtype == np.int64 and idx.tolist() == [[0, 2], [3, -1], [-1, -1]]
    soft = MultiLabel("soft", 2).arrays([[0.25, 0.75], [1.0, 0.0]])
    assert soft.dtype == np.float32 and soft.shape == (2, 2)
    maps = [np.full((2, 3), 7, np.uint8), np.full((2, 3), 300, np.int32)]
    stacked = stack_label_map_arrays(maps)
    assert type(stacked) is np.ndarray and stacked.dtype == np.int32 and stacked[:, 0, 0].tolist() == [7, 300]
    assert isinstance(stack_label_map_arrays([maps[0], np.zeros((4, 4), np.uint8)]), list)   # sizes differ
