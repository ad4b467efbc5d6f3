"""Shared fixtures: small image trees written at test time (no downloads)."""

from __future__ import annotations

import importlib.util
import importlib
import io
import signal
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from PIL import Image

TESTS = Path(__file__).resolve().parent
#: the developers' measuring scripts (not part of the package)
BENCHMARKS = TESTS.parent / "benchmarks"
# Test modules that need no torch (pack, info, verify, the sources, the format). They carry the
# `notorch` mark; where torch is not installed (CI's clean venvs on Python 3.10 and 3.13) only
# these are collected.
TORCH_FREE = frozenset({
    "test_audit.py", "test_cli.py", "test_cli_install.py", "test_codecs.py", "test_gauntlet.py", "test_layering.py",
    "test_jax.py", "test_numpy_output.py",
    "test_order.py", "test_pack.py", "test_platform.py", "test_progress.py", "test_reader.py",
    "test_shards.py", "test_sources.py", "test_storage.py", "test_synth.py",
    "reliability/test_fuzz_decode.py", "reliability/test_pack_faults.py", "reliability/test_security.py",
})
HAVE_TORCH = importlib.util.find_spec("torch") is not None
# tests/cuda without a GPU: each test runs on the CPU up to its first CUDA call (tests/cuda_rehearsal.py)
pytest_plugins = ["cuda_rehearsal"] if HAVE_TORCH else []


def _torch_free(path: Path) -> bool:
    try:
        return path.resolve().relative_to(TESTS).as_posix() in TORCH_FREE
    except ValueError:
        return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if HAVE_TORCH or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if not _torch_free(collection_path) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _torch_free(item.path):
            item.add_marker(pytest.mark.notorch)


PILLOW_CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpora" / "pillow-test-images"
#: why a test that reads Pillow's test images skips on a clone without them beside it (README, Development)
CORPUS_MISSING = (f"Pillow's test images are not beside this clone ({PILLOW_CORPUS}); this project's CI provides "
                  f"them, every other test builds its own data")


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py imported as the module NAME, with benchmarks/ on sys.path as running the script puts
    it (its sibling scripts import each other by name)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


class BrokenImport:
    """A meta-path finder (for `sys.meta_path`) that makes importing any of `names` raise RuntimeError,
    as a library built for another torch, CUDA or Python does (torchvision: "operator torchvision::nms
    does not exist"): not an ImportError."""

    def __init__(self, *names: str, message: str = "operator torchvision::nms does not exist") -> None:
        self.names, self.message = names, message

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname in self.names:
            raise RuntimeError(self.message)
        return None


def smooth_rgb(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A smooth colour gradient plus mild noise: compresses like a photo, not like noise."""
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    base = rng.uniform(0, 255, size=(1, 1, 3)).astype(np.float32)
    slope = rng.uniform(-120, 120, size=(2, 1, 1, 3)).astype(np.float32)
    img = base + slope[0] * y + slope[1] * x + rng.normal(0, 6, size=(height, width, 3))
    return img.clip(0, 255).astype(np.uint8)


def jpeg_bytes(rgb: np.ndarray, quality: int = 90, **save_args) -> bytes:
    """Encode with Pillow (so EXIF and other save options are available)."""
    buf = io.BytesIO()
    mode = "L" if rgb.ndim == 2 else "RGB"
    Image.fromarray(rgb, mode).save(buf, "JPEG", quality=quality, **save_args)
    return buf.getvalue()


def write_image(path: Path, rgb: np.ndarray, fmt: str = "JPEG", **save_args) -> Path:
    """Write ``rgb`` to ``path`` in ``fmt`` (Pillow format name); creates parent folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "JPEG":
        path.write_bytes(jpeg_bytes(rgb, **save_args))
    else:
        Image.fromarray(rgb).save(path, fmt, **save_args)
    return path


def make_image_folder(root: Path, n_per_class: int = 4, classes: tuple[str, ...] = ("cat", "dog", "eel"),
                      seed: int = 0, sizes: tuple[tuple[int, int], ...] = ((40, 56), (72, 48), (96, 96), (33, 70))
                      ) -> Path:
    """An ImageFolder tree ``root/<class>/<nn>.jpg`` of small JPEGs with varied sizes."""
    rng = np.random.default_rng(seed)
    for c in classes:
        for i in range(n_per_class):
            h, w = sizes[(i + len(c)) % len(sizes)]
            write_image(root / c / f"{i:03d}.jpg", smooth_rgb(rng, h, w))
    return root


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """12 JPEGs (3 classes x 4, sizes 33..96 px) in an ImageFolder tree."""
    return make_image_folder(tmp_path / "imgs")


@pytest.fixture
def pillow_corpus() -> Path:
    """Pillow's own test images, when the shared corpora folder is present."""
    if not PILLOW_CORPUS.is_dir():
        pytest.skip(CORPUS_MISSING)
    return PILLOW_CORPUS


def pytest_configure(config: pytest.Config) -> None:
    """Python's own Ctrl-C handler, even where the suite was started with SIGINT ignored (a shell's
    `make test &` in the background): there `_thread.interrupt_main()`, which the Ctrl-C tests use, does
    nothing, and they would fail for the way the suite was started rather than for the code."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 generated JPEGs of 150 x 200 in 4 classes: the data of the bench tests (a module's own)."""
    from stoker.tools.synth import make_tiny_jpegs

    return make_tiny_jpegs(tmp_path_factory.mktemp("bench") / "data", 64, classes=4, size=(150, 200))
