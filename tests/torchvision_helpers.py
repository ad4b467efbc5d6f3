"""torchvision (and timm) for the tests that compare stoker's pixels with theirs; never used by stoker.

`pip install -e ".[test-torchvision]"` installs torchvision 0.28.0, which requires torch 2.13.0. The
PyPI wheel's compiled ops (nms, roi_align) are built for the CUDA torch; on a CPU-only torch its
library does not load, and `import torchvision` then fails while registering fake kernels for two of
those ops. The transforms are plain torch: declaring the two ops' schemas (what the library would
have done, `stoker.tools.tvimport`) lets torchvision import, with the detection ops unusable, which no
test here calls.

`v2()` returns `torchvision.transforms.v2`, `v1()` `torchvision.transforms`, `timm_data()` `timm.data`;
each skips the calling test, with the install command, only where the package is not installed at all.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

INSTALL = 'pip install -e ".[test-torchvision]"'


def _import_torchvision() -> Any:
    """torchvision, through the tools' own import (`stoker.tools.tvimport`: one built for another torch
    imports with its compiled ops missing); skips where it is not installed at all."""
    from stoker.tools.tvimport import import_torchvision, status

    torchvision = import_torchvision()
    if torchvision is None:
        if "not installed" in status():
            pytest.skip(f"torchvision is not installed ({INSTALL})")
        raise RuntimeError(status())
    return torchvision


def torchvision_importable() -> bool:
    """Make an installed torchvision importable (as `v2()` does) and say whether one is; never skips.
    For tests of libraries that import torchvision themselves (Lightning through torchmetrics, timm)."""
    try:
        _import_torchvision()
    except pytest.skip.Exception:
        return False
    return True


def v2() -> Any:
    """torchvision.transforms.v2 (the test is skipped where torchvision is not installed)."""
    _import_torchvision()
    import torchvision.transforms.v2 as transforms_v2
    return transforms_v2


def v1() -> Any:
    """torchvision.transforms, the classic API (skipped where torchvision is not installed)."""
    _import_torchvision()
    import torchvision.transforms as transforms_v1
    return transforms_v1


def v2_functional() -> Any:
    _import_torchvision()
    import torchvision.transforms.v2.functional as functional
    return functional


def timm_data() -> Any:
    """timm.data (timm imports torchvision; skipped where timm is not installed)."""
    _import_torchvision()
    try:
        import timm.data
    except ModuleNotFoundError as exc:
        if exc.name != "timm":
            raise
        pytest.skip(f"timm is not installed ({INSTALL})")
    return timm.data


def chw(img: np.ndarray) -> Any:
    """A uint8 HWC array as the CHW uint8 tensor torchvision's v2 kernels take."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).contiguous()


def hwc(t: Any) -> np.ndarray:
    """A CHW tensor (or a PIL image) back as a uint8 HWC array."""
    if hasattr(t, "convert") and hasattr(t, "size"):
        return np.asarray(t.convert("RGB"))
    return t.permute(1, 2, 0).contiguous().numpy()


def images_hwc(batch: Any) -> np.ndarray:
    """A Loader's uint8 image batch as numpy [B, H, W, 3], whichever layout it comes in
    ([B, H, W, 3], or [B, 3, H, W] as a channels_last view); a copy (the Loader reuses its slots)."""
    arr = batch.numpy() if hasattr(batch, "numpy") else np.asarray(batch)
    if arr.shape[-1] != 3:
        assert arr.shape[1] == 3, arr.shape
        arr = arr.transpose(0, 2, 3, 1)
    return np.array(arr, order="C")


def differing(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    """(max |a - b|, share of values differing by more than 1)."""
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return int(d.max(initial=0)), float((d > 1).mean())
