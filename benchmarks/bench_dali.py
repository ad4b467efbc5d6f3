"""NVIDIA DALI beside stoker in `stoker bench`: the one check whether DALI imports here (the CPU bench's
``dali`` pipelines and the device bench's ``dali`` feed) and the DALI pipeline that feeds ``cuda-dali``
and ``train-<model>-dali``.

DALI is an optional extra (``stoker[dali]`` = ``nvidia-dali-cuda130``, about 200 MB); its wheel also runs
CPU-only, without a GPU, which is how the tests drive this feed (``--device cpu``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import StokerError

if TYPE_CHECKING:
    import torch

__all__ = ["INSTALL", "dali_batches", "why_unavailable"]

INSTALL = "pip install nvidia-dali-cuda130 (the stoker[dali] extra; it runs CPU-only without a GPU)"
_READER = "Reader"


def why_unavailable() -> str | None:
    """Why NVIDIA DALI cannot be used here (with the pip command), or None when it imports."""
    try:
        import nvidia.dali  # noqa: F401
    except Exception as exc:   # not installed, or a build that fails to load here (not only ImportError)
        return f"NVIDIA DALI does not import ({type(exc).__name__}: {exc}); {INSTALL}"
    return None


def _pipeline(root: str, batch_size: int, workers: int, device: "torch.device", size: int, layout: str) -> Any:
    """The DALI training pipeline over an ImageFolder tree: shuffled, RandomResizedCrop(size) + flip, float32
    normalized with ImageNet mean/std in `layout` ("CHW" or "HWC"), on `device` with its labels."""
    from nvidia.dali import fn, pipeline_def, types

    from .._tensors import IMAGENET_MEAN, IMAGENET_STD

    gpu = device.type == "cuda"

    @pipeline_def(batch_size=batch_size, num_threads=workers, device_id=device.index if gpu else None, seed=0)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name=_READER)
        # A whole-image decode, then the crop: not decoders.image_random_crop, whose fused region decode
        # on the GPU goes through nvImageCodec 0.9.0's ROI decode (open upstream bug NVIDIA/nvImageCodec#55:
        # INTERNAL_ERROR on A100, SIGSEGV on H100) and cannot use the hardware JPEG decoder.
        images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
        images = fn.random_resized_crop(images, size=(size, size))
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout=layout,
                                          mean=[m * 255 for m in IMAGENET_MEAN], std=[s * 255 for s in IMAGENET_STD],
                                          mirror=fn.random.coin_flip())
        return images, labels.gpu() if gpu else labels
    return pipe()


def dali_batches(root: str, batch_size: int, workers: int, device: "torch.device", *, size: int, drop_last: bool,
                 channels_last: bool) -> tuple[Callable[[], Iterator[tuple[Any, Any]]], Callable[[], None], str]:
    """DALI's batches as `(epoch, close, version)`: each `epoch()` yields one epoch (as many samples as the
    tree has images, drawn through DALI's shuffle buffer) as `(images, labels)` torch tensors on `device`
    (float32 NCHW, channels_last with `channels_last`; int64 labels, 1-D), the last partial batch dropped
    with `drop_last`. The pipeline runs on from epoch to epoch (the iterator resets itself), so no epoch
    after the first pays its start-up. Raises what DALI raises (RuntimeError when its backend cannot start;
    the first batch is made here)."""
    import nvidia.dali
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    # channels_last: DALI writes NHWC and the NCHW view of it is channels_last, with no copy on the device
    pipe = _pipeline(root, batch_size, workers, device, size, "HWC" if channels_last else "CHW")
    last = LastBatchPolicy.DROP if drop_last else LastBatchPolicy.PARTIAL
    iterator: Any = DALIGenericIterator(pipe, ["images", "labels"], reader_name=_READER, auto_reset=True,
                                        last_batch_policy=last)

    def epoch() -> Iterator[tuple[Any, Any]]:
        if iterator is None:
            raise StokerError("the DALI feed was closed; open a new one (bench_gpu.open_feed)")
        for [batch] in iterator:   # one dict per pipeline; StopIteration at the end of a pass
            images = batch["images"].permute(0, 3, 1, 2) if channels_last else batch["images"]
            yield images, batch["labels"].reshape(-1).long()

    def close() -> None:
        nonlocal iterator, pipe
        iterator = pipe = None   # DALI frees the pipeline's threads and buffers with its last reference
    decode = "mixed" if device.type == "cuda" else "cpu"
    return epoch, close, f"nvidia.dali {nvidia.dali.__version__}, decoders.image {decode}"
