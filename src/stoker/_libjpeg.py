"""Find the region decoder: the optional compiled extension ``stoker._jpeg`` and a libjpeg-turbo
shared library for it to call.

The extension links no JPEG library at build time (it needs only a C compiler), so a wheel or a
source install works wherever Python does. At first use it opens, in this order:

1. the file named by the ``STOKER_LIBJPEG`` environment variable (``none`` turns region decode off);
2. the libjpeg-turbo that Pillow's wheels ship (``pillow.libs/`` on Linux, ``PIL/.dylibs/`` on macOS);
3. the system's ``libjpeg`` (``ctypes.util.find_library``).

A candidate is kept only if it has libjpeg-turbo's partial-decode functions (>= 1.5), speaks the
libjpeg 6.2 ABI, and decodes a test image to the same pixels as simplejpeg. When none does, or the
extension was not compiled (Windows, no compiler at install time), :func:`region_decoder` returns
None and stoker decodes whole images through simplejpeg, as it always could.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import threading
from types import ModuleType

import numpy as np

ENV = "STOKER_LIBJPEG"

_lock = threading.Lock()
_state: tuple[ModuleType | None, str] | None = None


def _candidates() -> list[str]:
    found = []
    try:
        import PIL

        pil = os.path.dirname(PIL.__file__)
        found += sorted(glob.glob(os.path.normpath(os.path.join(pil, os.pardir, "pillow.libs", "libjpeg*.so*"))))
        found += sorted(glob.glob(os.path.join(pil, ".dylibs", "libjpeg*.dylib")))
    except ImportError:
        pass
    system = ctypes.util.find_library("jpeg")
    if system:
        found.append(system)
    return found


def _self_test(mod: ModuleType) -> None:
    """Decode part of a small 4:2:0 JPEG, without and with restart markers (the seeking path);
    both must match simplejpeg's pixels."""
    import io

    import simplejpeg
    from PIL import Image

    y, x = np.mgrid[0:80, 0:64]
    rgb = np.stack([x * 4, y * 3, (x + y) * 2], axis=-1).astype(np.uint8)
    for options in ({}, {"restart_marker_rows": 1}):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, "JPEG", quality=90, subsampling=2, **options)
        data = buf.getvalue()
        want = simplejpeg.decode_jpeg(data, colorspace="RGB")
        got = np.empty((20, 30, 3), np.uint8)
        mod.decode(data, got, 8, 49, 69, 21, 51)
        if not np.array_equal(got, want[49:69, 21:51]):
            raise OSError(f"decodes different pixels from simplejpeg{' with restart markers' if options else ''}")


def _load() -> tuple[ModuleType | None, str]:
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() in ("none", "off", "0"):
        return None, f"turned off by {ENV}={choice}"
    try:
        from . import _jpeg
    except ImportError as exc:
        return None, f"the compiled extension stoker._jpeg is not installed ({exc})"
    reasons = []
    for path in [choice] if choice else _candidates():
        try:
            _jpeg.load(path)
        except OSError as exc:
            reasons.append(str(exc))
            continue
        try:
            _self_test(_jpeg)
        except (OSError, ValueError) as exc:
            _jpeg.unload()  # nothing decodes yet: the next candidate may be tried
            reasons.append(f"{path}: {exc}")
            continue
        return _jpeg, path
    return None, "no usable libjpeg-turbo: " + ("; ".join(reasons) or "none found")


def region_decoder() -> ModuleType | None:
    """The loaded ``stoker._jpeg`` module, or None when region decode is unavailable."""
    return _status()[0]


def describe() -> str:
    """Which libjpeg the region decoder uses, or why it is unavailable (for `stoker doctor`)."""
    mod, text = _status()
    return f"region decode: {text}" if mod is not None else f"region decode unavailable: {text}"


def _status() -> tuple[ModuleType | None, str]:
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    return _state
