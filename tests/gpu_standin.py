"""A stand-in GPU JPEG decoder of fixed latency and throughput, for testing and measuring the GPU decode
pipeline on machines without a GPU (tests/test_gpu_pipeline.py, benchmarks/bench_gpu_pipeline.py).

It follows the `gpu_decoder=` object API (`stoker.device.gpu_backends.GpuDecoder`): each call blocks the
calling thread for `latency_s + images / images_per_s` seconds, as a library that decodes while it
is called does (the hardware JPEG engines; TorchCodec host-synchronizes), with the GIL released
(`time.sleep`), then returns uint8 [3, H, W] tensors of the right size: the image's (read from the
JPEG header) or, with `regions=True`, the window's. Their pixels are a flat grey: what is measured
is the pipeline around the decoder, not the decode. `decode_columns`, the columns form the Loader calls,
serves the same call (a subclass that overrides `decode` changes both).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from stoker.codecs import probe
from stoker.device.gpu_backends import as_layout, spans_views


class FixedRateDecoder:
    """A decoder whose every call takes `latency_s + images / images_per_s` seconds (`sleep`, injectable)."""

    def __init__(self, latency_s: float = 0.0, images_per_s: float = float("inf"), *, regions: bool = False,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.latency_s, self.images_per_s = float(latency_s), float(images_per_s)
        self.regions = regions
        self.sleep = sleep
        self.name = f"fixed-rate stand-in ({latency_s * 1e3:g} ms + {images_per_s:g} img/s)"
        self.layout = "chw"
        self.calls: list[int] = []  # images per call
        self.busy_s = 0.0  # seconds spent inside decode
        self._lock = threading.Lock()

    def decode(self, datas: list[torch.Tensor], regions: Sequence[Any] | None = None) -> list[Any]:
        t0 = time.perf_counter()
        self.sleep(self.latency_s + len(datas) / self.images_per_s)
        out: list[Any] = []
        for k, data in enumerate(datas):
            if regions is not None and regions[k] is not None:
                y0, y1, x0, x1 = regions[k]
                h, w = y1 - y0, x1 - x0
            else:
                try:
                    info = probe(bytes(data.numpy()), "stand-in")
                    h, w = info.height, info.width
                except Exception as exc:  # noqa: BLE001 - a corrupt sample fails alone, like a real decoder
                    out.append(exc)
                    continue
            out.append(torch.full((3, h, w), 128, dtype=torch.uint8))
        with self._lock:
            self.calls.append(len(datas))
            self.busy_s += time.perf_counter() - t0
        return out

    def decode_columns(self, data: torch.Tensor, spans: np.ndarray, regions: np.ndarray | None = None) -> list[Any]:
        """`decode` of `data[spans[i, 0]:spans[i, 1]]` (`GpuDecoder.decode_columns`)."""
        wins = None if regions is None else [tuple(r) for r in regions.tolist()]
        return as_layout(self.decode(spans_views(data, spans), wins), self.layout)
