"""stoker keeps the GPU fed: pack images once into Arrow shards, then decode, augment and
batch them on threads straight into pinned memory.

The public surface is listed in ``__all__``; names are imported on first use so that
``import stoker`` (and CLI commands such as ``stoker info``) stay fast and do not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    "AutoAugment": "transforms",
    "ColorJitter": "transforms",
    "GaussianBlur": "transforms",
    "Mixup": "transforms",
    "MixUp": "transforms",
    "CutMix": "transforms",
    "Normalize": "transforms",
    "RandAugment": "transforms",
    "RandomErasing": "transforms",
    "RandomGrayscale": "transforms",
    "TrivialAugmentWide": "transforms",
    "adapt": "transforms",
    "CenterCrop": "transforms",
    "AspectBuckets": "buckets",
    "TokenBudget": "loading.tokens",
    "Clips": "loading.clips",
    "Dataset": "dataset",
    "DeviceOptions": "device.stage",
    "Loader": "loader.loader",
    "LoaderStats": "loading.stats",
    "Mix": "mix",
    "PackOptions": "pack_options",
    "PackSample": "packing",
    "PackSummary": "packing",
    "Pipeline": "transforms",
    "RandomHorizontalFlip": "transforms",
    "RandomResizedCrop": "transforms",
    "Resize": "transforms",
    "Sample": "dataset",
    "Sampling": "loader.options",
    "Storage": "loader.options",
    "Targets": "loader.options",
    "Workers": "loader.options",
    "describe": "audit",
    "StokerError": "errors",
    "errors": None,
    "open_dataset": "reader",
    "open_loose": "loose",
    "pack": "packing",
    "prefetch": "device.prefetcher",
    "profile": "profiling",
    "ProfileReport": "profiling",
    "verify": "audit",
}

__all__ = sorted(["__version__", *_EXPORTS])


#: namespaces reached as `stoker.<name>` (loaded on first use), beside the names above
_NAMESPACES = ("batch",)


def __getattr__(name: str) -> Any:
    if name in _NAMESPACES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stoker' has no attribute {name!r}")
    module_name = _EXPORTS[name]
    if module_name is None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
