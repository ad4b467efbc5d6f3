"""torchvision for the tools (the bench's baseline, `stoker doctor --model resnet50`), where installed.

A torchvision wheel built for another torch (PyPI's CUDA build beside a CPU torch, the usual pairing
after `pip install torchvision`) fails to import with RuntimeError("operator torchvision::nms does
not exist"): its compiled library (nms, roi_align, its image decoders) does not load, and the import
stops while registering fake kernels for two of those ops. Its transforms and models are plain torch.
`import_torchvision()` then declares those two ops' schemas (what the library would have done) and
imports it again, so transforms and models work and only the compiled ops are missing; `status()`
says which of the three cases holds, for the tools to print beside what they measured.
"""

from __future__ import annotations

import sys
from typing import Any

#: the ops torchvision registers fake kernels for at import, as its compiled library would declare them
_OPS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_STATE: dict[str, Any] = {}   # "module", "status": decided once per process


def import_torchvision() -> Any | None:
    """The torchvision module (its compiled ops possibly missing, see `status()`), or None where it is
    not installed or does not import even so."""
    if "status" not in _STATE:
        _STATE["module"], _STATE["status"] = _import()
    return _STATE["module"]


def status() -> str:
    """One line: "torchvision 0.28.0", "torchvision 0.28.0 without its compiled ops (...)",
    "torchvision not installed (pip install torchvision)" or "torchvision does not import (...)"."""
    import_torchvision()
    return _STATE["status"]


def _import() -> tuple[Any | None, str]:
    try:
        import torchvision
        return torchvision, f"torchvision {torchvision.__version__}{_ops_note(torchvision)}"
    except ModuleNotFoundError as exc:
        if exc.name != "torchvision":
            return None, f"torchvision does not import ({exc})"
        return None, "torchvision not installed (pip install torchvision, the build matching your torch)"
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            return None, f"torchvision does not import ({exc})"
        first = str(exc)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, never a traceback
        return None, f"torchvision does not import ({type(exc).__name__}: {exc})"
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]   # the half-imported package, before importing it again
    try:
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _OPS:
            lib.define(schema)
        _STATE["library"] = lib   # the schemas live as long as the library object
        import torchvision
    except Exception as exc:  # noqa: BLE001
        return None, f"torchvision does not import ({first}; then {type(exc).__name__}: {exc})"
    return torchvision, (f"torchvision {torchvision.__version__} without its compiled ops ({first}: a build for "
                         f"another torch than {torch.__version__}; its transforms and models work)")


def _ops_note(torchvision: Any) -> str:
    """"" where its compiled ops loaded (or it cannot say), else a note that they did not."""
    try:
        loaded = torchvision.extension._has_ops()
    except Exception:  # noqa: BLE001 - a torchvision without that private check: assume they did
        return ""
    return "" if loaded else " without its compiled ops (its transforms and models work)"
