"""The loader wing: `Loader` (options in, batches out), its options, the passes that run an epoch,
and the habits it carries over from torch's DataLoader.

`from stoker.loader import Loader` works; the name is loaded on first use, so importing the options
(`stoker.loader.options`) does not load torch."""

from __future__ import annotations

from typing import Any

__all__ = ["Loader"]


def __getattr__(name: str) -> Any:
    if name == "Loader":
        from .loader import Loader
        return Loader
    raise AttributeError(f"module 'stoker.loader' has no attribute {name!r}")
