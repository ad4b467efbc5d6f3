"""How each batch's JPEGs are split between the GPU decoder and the CPU worker threads.

The GPU adds decode capacity beside the CPU threads; it does not replace them. A batch is complete
when both sides are done, so the split that finishes them together gives the GPU the share
`G / (G + C)` of the JPEG rows, G and C being the two sides' measured images/s. `SplitControl`
measures both as the Loader runs (the device thread reports each batch: the GPU side's busy time,
and the CPU seconds the workers spent rendering the CPU rows) and moves the share there, smoothed,
so it follows a machine whose load changes. No peer does this automatically: DALI's
`hw_decoder_load` is a fixed setting.

Where the GPU would add less than `floor` of the capacity it is left out (decode="auto": "CPU only,
the GPU adds too little"), and given one row every `probe_every` batches to keep measuring it.
Pure arithmetic on the numbers it is handed: tests drive it with a simulated clock.
"""

from __future__ import annotations

import threading

#: Where each batch's JPEGs are decoded (DeviceOptions.decode).
SPLIT_MODES = ("gpu", "auto")


class SplitControl:
    """The GPU's share of a batch's JPEG rows, from measured throughput (or fixed, with `share`).

    threads: the worker threads rendering the CPU rows (their summed seconds / threads is the CPU
        side's wall time). share: a fixed share in 0..1 (no measuring), or None: automatic, starting
        at `start`. alpha: weight of the newest batch in the smoothed rates (0..1]."""

    def __init__(self, threads: int, share: float | None = None, *, start: float = 0.5, alpha: float = 0.5,
                 floor: float = 0.02, probe_every: int = 50) -> None:
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"gpu_share must be between 0 and 1, got {share!r}")
        self.threads = max(1, int(threads))
        self.fixed = share
        self.share = float(start if share is None else share)
        self.alpha, self.floor, self.probe_every = alpha, floor, probe_every
        self.gpu_rate: float | None = None  # images/s, smoothed
        self.cpu_rate: float | None = None
        self.batches = 0
        self.lock = threading.Lock()
        self.reason = (f"fixed: {share:.0%} of each batch's JPEGs on the GPU (gpu_share=)" if share is not None
                       else "measuring: the first batches split half and half")

    def gpu_rows(self, n_jpeg: int) -> int:
        """How many of a batch's `n_jpeg` JPEG rows go to the GPU (read by a worker thread when it
        plans a batch: one float, no lock needed)."""
        share = self.share
        n = int(round(share * n_jpeg))
        if share == 0.0 and self.fixed is None and n_jpeg and self.batches % self.probe_every == 0:
            n = 1  # the GPU left out: one row now and then keeps its rate measured
        return n

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else self.alpha * new + (1 - self.alpha) * old

    def observe_gpu(self, images: int, seconds: float) -> None:
        """The GPU side took `seconds` (its busiest stage: the decode calls, or the resample) for `images`."""
        if images > 0 and seconds > 0:
            with self.lock:
                self.gpu_rate = self._smooth(self.gpu_rate, images / seconds)
                self._update()

    def observe_cpu(self, images: int, thread_seconds: float) -> None:
        """The worker threads spent `thread_seconds` in all rendering `images` CPU rows."""
        if images > 0 and thread_seconds > 0:
            with self.lock:
                self.cpu_rate = self._smooth(self.cpu_rate, images * self.threads / thread_seconds)
                self._update()

    def batch_done(self) -> None:
        with self.lock:
            self.batches += 1

    def _update(self) -> None:
        if self.fixed is not None or self.gpu_rate is None or self.cpu_rate is None:
            return
        g, c = self.gpu_rate, self.cpu_rate
        balanced = g / (g + c)
        if balanced < self.floor:
            self.share = 0.0
            self.reason = (f"CPU only: the GPU decoder measured {g:,.0f} img/s beside the CPU threads' {c:,.0f} "
                           f"img/s, under {self.floor:.0%} of the capacity (re-measured every "
                           f"{self.probe_every} batches)")
        else:
            self.share = balanced
            self.reason = (f"split by measured throughput: GPU {g:,.0f} img/s, CPU threads {c:,.0f} img/s, so "
                           f"{balanced:.0%} of each batch's JPEGs on the GPU")


def auto_blocker(tail_ops: str, resampling: tuple, pad: bool, clips: bool) -> str | None:
    """Why decode="auto" decodes on the CPU alone for a Loader's transforms (None: the GPU may help):
    the same combinations decode="gpu" refuses."""
    if tail_ops:
        return f"CPU only: {tail_ops} run on numpy arrays, after the decode"
    if tuple(resampling) != ("bilinear", True):
        return f"CPU only: the transforms resize with {resampling[0]!r} (antialias={resampling[1]}); the GPU " \
               f"path resizes with antialiased bilinear only"
    if pad:
        return "CPU only: pad=True"
    if clips:
        return "CPU only: video clips are decoded by PyAV"
    return None
