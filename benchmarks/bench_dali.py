"""NVIDIA DALI beside stoker: `stoker bench` with DALI's pipelines added (a `stoker.tools.bench.Peer`).

    python benchmarks/bench_dali.py [stoker bench's options]          # CPU: baselines, stoker, ceiling, dali, dali-val
    python benchmarks/bench_dali.py --device cuda [--models resnet50]  # every device pipeline, cuda-dali and
                                                                       # train-<model>-dali among them

The same options, pipelines and outputs as `stoker bench` (`stoker bench --help`), plus these:

- ``dali`` / ``dali-val`` (CPU bench): DALI's CPU pipelines, fused decode + random crop, resize 224, flip
  (ratio to ``baseline``); decode, resize shorter side 256, centre crop 224 (ratio to ``baseline-val``);
- ``cuda-dali`` and ``train-<model>-dali`` (``--device cuda``): the feed `dali_batches` makes, file reader,
  decode (``device="mixed"`` on CUDA), random resized crop, crop_mirror_normalize, into device memory.

DALI is an optional extra (``pip install -e '.[dali]'`` = ``nvidia-dali-cuda130``, about 200 MB); its wheel also
runs CPU-only, without a GPU, which is how the tests drive these pipelines (``--device cpu``). Where it does
not import, its pipelines are reported as skipped, with the pip command.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from stoker.cli import add_bench_arguments, run_command
from stoker.errors import StokerError
from stoker.tools.bench import Peer, peer_added
from stoker.tools.bench_gpu import OUTPUT_SIZE, Feed, FeedUnavailable, PeerFeed

if TYPE_CHECKING:
    import torch

__all__ = ["CPU_PIPELINES", "INSTALL", "PEER", "dali_batches", "main", "why_unavailable"]

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

    from stoker._tensors import IMAGENET_MEAN, IMAGENET_STD

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
            raise StokerError("the DALI feed was closed; open a new one (stoker.tools.bench_gpu.open_feed)")
        for [batch] in iterator:   # one dict per pipeline; StopIteration at the end of a pass
            images = batch["images"].permute(0, 3, 1, 2) if channels_last else batch["images"]
            yield images, batch["labels"].reshape(-1).long()

    def close() -> None:
        nonlocal iterator, pipe
        iterator = pipe = None   # DALI frees the pipeline's threads and buffers with its last reference
    decode = "mixed" if device.type == "cuda" else "cpu"
    return epoch, close, f"nvidia.dali {nvidia.dali.__version__}, decoders.image {decode}"


def version() -> str:
    import nvidia.dali

    return f"nvidia.dali {nvidia.dali.__version__}"


def _cpu_pipeline(spec: Any) -> tuple[Callable[[], Iterator[int]], Callable[[], None]]:
    """The CPU bench's ``dali`` (train) or ``dali-val`` pipeline over the ImageFolder ``spec.root``, as
    ``(epoch, close)``: each epoch yields its batch sizes."""
    from nvidia.dali import fn, pipeline_def, types

    train = spec.pipeline in ("dali", "dali-float")
    floats = spec.pipeline == "dali-float"

    @pipeline_def(batch_size=spec.batch_size, num_threads=spec.workers, device_id=None, seed=0)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=spec.root, random_shuffle=train, name=_READER)
        if floats:   # DALI's fused crop + mirror + normalize to float32 NCHW (stoker-train-float's output)
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
            images = fn.resize(images, resize_x=224, resize_y=224)
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                              mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                              std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
                                              mirror=fn.random.coin_flip())
        elif train:
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
            images = fn.resize(images, resize_x=224, resize_y=224)
            images = fn.flip(images, horizontal=fn.random.coin_flip())
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            images = fn.resize(images, resize_shorter=256)
            images = fn.crop(images, crop=(224, 224))   # centred by default
        return images, labels

    pipeline = pipe()
    pipeline.build()
    size = int(pipeline.epoch_size(_READER))

    def epoch() -> Iterator[int]:
        for _ in range(-(-size // spec.batch_size)):   # the last batch wraps into the next epoch
            _, labels = pipeline.run()
            yield len(labels)
    return epoch, lambda: None


def _feed(root: str, batch_size: int, workers: int, device: "torch.device", *, drop_last: bool,
          channels_last: bool, dtype: "torch.dtype") -> Feed:
    """The device bench's ``dali`` feed: `dali_batches`, its float32 cast to `dtype` on the device."""
    why = why_unavailable()
    if why is not None:
        raise FeedUnavailable(why)
    try:
        epoch, close, version = dali_batches(root, batch_size, workers, device, size=OUTPUT_SIZE, drop_last=drop_last,
                                             channels_last=channels_last)
    except RuntimeError as exc:   # DALI's backend failed to start (its first batch is made here)
        raise FeedUnavailable(f"NVIDIA DALI could not start on {device} ({type(exc).__name__}: {exc}); on a GPU "
                              "host check that the driver supports the CUDA of the DALI wheel (nvidia-smi; "
                              "nvidia-dali-cuda130 needs CUDA 13) or install the wheel for its CUDA") from exc

    def cast() -> Iterator[tuple[Any, Any]]:   # DALI's float32 in the asked dtype, on the device, layout kept
        for images, labels in epoch():
            yield images.to(dtype), labels
    return Feed(cast, close, version)


def _import_plugin() -> None:
    import nvidia.dali.plugin.pytorch  # noqa: F401


#: the CPU bench's pipelines when none are named: the references DALI's are measured against, and DALI's
CPU_PIPELINES = ("baseline", "baseline-val", "stoker-train", "stoker-val", "ceiling", "dali", "dali-val")
#: float32 output compared: stoker's fused float output beside DALI's fused crop-mirror-normalize
FLOAT_PIPELINES = ("stoker-train", "stoker-train-float", "dali", "dali-float")

PEER = Peer(
    script=__file__, unavailable=why_unavailable, version=version, open=_cpu_pipeline, modules=("nvidia.dali",),
    pipelines={"dali": ("NVIDIA DALI CPU: image_random_crop decode, resize 224, flip", "baseline"),
               "dali-float": ("NVIDIA DALI CPU: image_random_crop decode, resize 224, crop_mirror_normalize to "
                              "float32 NCHW (stoker-train-float's output)", "baseline"),
               "dali-val": ("NVIDIA DALI CPU: decode, resize shorter side 256, centre crop 224", "baseline-val")},
    feeds={"dali": PeerFeed(
        training="NVIDIA DALI: readers.file + decoders.image (device='mixed' on CUDA) + random_resized_crop + "
                 "crop_mirror_normalize, DALIGenericIterator",
        loader="NVIDIA DALI: readers.file (shuffled), decoders.image (device='mixed' on CUDA), "
               "random_resized_crop(224), crop_mirror_normalize (flip, ImageNet mean/std, float32 CHW); "
               "DALIGenericIterator, then bfloat16 on the device",
        open=_feed, unavailable=why_unavailable, prepare=_import_plugin)},
    note="DALI reads the ImageFolder; it decodes (decoders.image, device='mixed' on CUDA), crops and normalizes in "
         "its own pipeline (channels_last for training), which runs on while its iterator resets itself at each "
         "epoch's end.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_dali.py", description=__doc__.split("\n\n")[0])
    add_bench_arguments(p)
    args = p.parse_args(argv)
    if args.pipelines is None and args.device == "cpu" and args.recipe == "basic" and args.models is None:
        args.pipelines = ",".join(CPU_PIPELINES)
    with peer_added(PEER):
        return run_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
