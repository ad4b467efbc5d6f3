"""The public surface: exactly the curated names, each importable."""

from __future__ import annotations

import subprocess
import sys

import stoker

EXPECTED = {
    "AspectBuckets", "CenterCrop", "Clips", "Dataset", "TokenBudget", "DeviceOptions", "Loader", "LoaderStats", "Mix", "PackOptions", "PackSample", "PackSummary", "Pipeline",
    "RandomHorizontalFlip", "RandomResizedCrop", "Resize", "Sample", "Sampling", "Storage", "StokerError", "Targets", "Workers", "__version__",
    "describe", "errors", "open_dataset", "open_loose", "pack", "prefetch", "profile", "ProfileReport", "verify",
    "AutoAugment", "ColorJitter", "CutMix", "GaussianBlur", "MixUp", "Mixup", "Normalize", "RandAugment", "RandomErasing",
    "RandomGrayscale", "TrivialAugmentWide", "adapt",
}


def test_exported_names_are_curated_and_resolve():
    assert set(stoker.__all__) == EXPECTED and stoker.__all__ == sorted(stoker.__all__)
    for name in stoker.__all__:
        assert getattr(stoker, name) is not None


def test_pack_is_the_function_whatever_is_imported_first():
    code = ("from stoker.packing import PackOptions; import stoker, sys; "
            "assert callable(stoker.pack) and stoker.pack is sys.modules['stoker.packing'].pack")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_profile_is_the_function_whatever_is_imported_first():
    code = ("from stoker.profiling import ProfileReport; import stoker, sys; "
            "assert callable(stoker.profile) and stoker.profile is sys.modules['stoker.profiling'].profile")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_import_does_not_load_torch():
    code = "import sys, stoker, stoker.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_errors_subclass_the_natural_builtins():
    from stoker import errors
    assert issubclass(errors.CorruptImageError, ValueError)
    assert issubclass(errors.ShardError, OSError)
    assert issubclass(errors.LoaderTimeoutError, TimeoutError)
    assert str(errors.ShardError("shard-00001.arrow: missing", path="x")) == "shard-00001.arrow: missing"
