"""How each batch's JPEGs are split between the GPU decoder and the CPU worker threads.

The GPU adds decode capacity beside the CPU threads; it does not replace them. A batch is complete
when both sides are done, so the split that finishes them together gives the GPU the share
`G / (G + C)` of the JPEG rows, G and C being the two sides' measured images/s. `SplitControl`
measures both as the Loader runs (the device thread reports each batch: the GPU side's busy time,
and the CPU seconds the workers spent rendering the CPU rows) and moves the share there, smoothed
(images over seconds, each smoothed: a batch's time on a loaded host is skewed, and averaged per-batch
rates would overrate the noisier side), so it follows a machine whose load changes. No peer does this automatically: DALI's
`hw_decoder_load` is a fixed setting.

Whether the split helps at all is measured too: the two sides share the host (the device thread's
Python and the workers' take turns at the GIL; the GPU path's host work takes cores), so a side's
rate beside the other can be far below its rate alone. Every `probe_every` batches (twice as long
after each probe that came at under half the pace, up to 8 times) a window of
`probe_len` batches runs the other way (the CPU alone while splitting, the split while the CPU is
alone; only batches run that way count, not those the workers planned before the window opened),
and the mean pace of whole batches (images/s, each batch as long as its slower side, both sides
timed where they ran, so the slowdown one causes the other is in it) decides which to keep, where
the difference is larger than `margin` and the batches' scatter;
`reason` says which and why. Until both ways have been timed, a GPU that would add less than
`floor` of the capacity is left out too. Pure arithmetic on the numbers it is handed: tests drive it
with a simulated clock.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque


class SplitControl:
    """The GPU's share of a batch's JPEG rows, from measured throughput (or fixed, with `share`).

    threads: the worker threads rendering the CPU rows (their summed seconds / threads is the CPU
        side's wall time). share: a fixed share in 0..1 (no measuring), or None: automatic, starting
        at `start`. alpha: weight of the newest batch in the smoothed rates (0..1]. margin: how much
        faster (a fraction) the other way must be in a probe before it is taken."""

    def __init__(self, threads: int, share: float | None = None, *, start: float = 0.5, alpha: float = 0.5,
                 floor: float = 0.02, probe_every: int = 40, probe_len: int = 8, warmup: int = 8,
                 margin: float = 0.05) -> None:
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"gpu_share must be between 0 and 1, got {share!r}")
        self.threads = max(1, int(threads))
        self.fixed = share
        self.balanced = float(start if share is None else share)  # G / (G + C) from the latest rates
        self.share = self.balanced  # what gpu_rows hands out now
        self.alpha, self.floor, self.margin = alpha, floor, margin
        self.probe_every, self.probe_len, self.warmup = probe_every, probe_len, warmup
        self.gpu_rate: float | None = None  # images/s, smoothed
        self.cpu_rate: float | None = None
        self.pace: dict[str, float | None] = {"split": None, "cpu": None}  # whole batches, images/s
        self._sums: dict[str, tuple[float, float]] = {}  # smoothed (images, seconds) behind each rate
        # seconds per image of the latest batches each way: how noisy a probe's verdict is
        self._recent: dict[str, deque[float]] = {k: deque(maxlen=2 * probe_len) for k in ("split", "cpu")}
        self.mode = "split"  # or "cpu": the CPU threads alone (the split did not help)
        self.probe: str | None = None  # the other way, while a probe window runs
        self.probe_left = 0  # batches of the probe's way still to time in its window
        self.probe_spent = 0  # batches done since the window opened (it closes after 3 x probe_len at most)
        self._last: str | None = None  # the way the last observed batch ran ("split" or "cpu")
        self.batches = 0
        self.gap = probe_every  # batches from one probe window's start to the next
        self.next_probe = warmup
        self.probe_start = 0  # the batch the last probe window opened at
        self.lock = threading.Lock()
        self.reason = (f"fixed: {share:.0%} of each batch's JPEGs on the GPU (gpu_share=)" if share is not None
                       else "measuring: the first batches split half and half")

    def gpu_rows(self, n_jpeg: int) -> int:
        """How many of a batch's `n_jpeg` JPEG rows go to the GPU (read by a worker thread when it
        plans a batch: one float, no lock needed)."""
        rows = int(round(self.share * n_jpeg))
        return max(rows, 1) if self.share > 0 and n_jpeg > 0 else rows  # a share above 0: at least one row

    @property
    def settled(self) -> float:
        """The share outside probe windows (what `reason` explains; LoaderStats.gpu_share)."""
        if self.fixed is not None:
            return self.fixed
        return 0.0 if self.mode == "cpu" else max(self.balanced, self.floor)

    def _smooth(self, key: str, images: float, seconds: float) -> float:
        """The smoothed images/s of `key`: the images and the seconds are smoothed apart and divided
        (a ratio of weighted sums), not the per-batch rates averaged. A batch's time is noisy and
        skewed (a thread descheduled for a while); the mean of images / seconds over such batches
        overrates the noisier side (Jensen: E[n / t] > n / E[t]), and a CPU side overrated so pulled
        the share the GPU gets below the capacities' ratio."""
        old = self._sums.get(key)
        a = self.alpha
        n, t = (images, seconds) if old is None else (a * images + (1 - a) * old[0], a * seconds + (1 - a) * old[1])
        self._sums[key] = (n, t)
        return n / t

    def observe_gpu(self, images: int, seconds: float) -> None:
        """The GPU side took `seconds` (its busiest stage: the decode calls, or the resample, and the CPU
        decode of what it could not decode) for the `images` it decoded: 0 when it decoded none, which
        moves its rate down (a decoder that fails every image gets no more rows than the probes')."""
        if images >= 0 and seconds > 0:
            with self.lock:
                self.gpu_rate = self._smooth("gpu", images, seconds)
                self._update()

    def observe_cpu(self, images: int, thread_seconds: float) -> None:
        """The worker threads spent `thread_seconds` in all rendering `images` CPU rows."""
        if images > 0 and thread_seconds > 0:
            with self.lock:
                self.cpu_rate = self._smooth("cpu", images * self.threads, thread_seconds)
                self._update()

    def observe_batch(self, images: int, seconds: float, split: bool) -> None:
        """A whole batch of `images` took `seconds` on its slower side (the CPU rows' thread-seconds
        over the threads, or the GPU side's); `split`: some of its rows were decoded on the GPU."""
        if images > 0 and seconds > 0:
            with self.lock:
                key = self._last = "split" if split else "cpu"
                self.pace[key] = self._smooth("pace_" + key, images, seconds)
                self._recent[key].append(seconds / images)

    def batch_done(self) -> None:
        """The device thread finished a batch: the probe schedule moves on."""
        with self.lock:
            self.batches += 1
            if self.fixed is not None:
                return
            if self.probe is not None:
                # only batches run the probe's way count: those planned before the window opened (the
                # workers plan ahead by the prefetch depth) still run the old way and time nothing new
                self.probe_left -= 1 if self._last == self.probe else 0
                self.probe_spent += 1
                if self.probe_left <= 0 or self.probe_spent >= 3 * self.probe_len or self._losing():
                    self._decide()
            elif self.batches >= self.next_probe:
                self.probe_start = self.batches
                self.next_probe = self.batches + self.gap
                self.probe = "cpu" if self.mode == "split" else "split"
                self.probe_left, self.probe_spent = self.probe_len, 0
                self.pace[self.probe] = None  # measured afresh in this window
                self._sums.pop("pace_" + self.probe, None)
                self._recent[self.probe].clear()
            self._apply()

    def _decide(self) -> None:
        """The probe window is over: take its way if its batches came faster than the latest ones of
        the current way (each the mean over its batches, not a smoothed rate that the last few
        batches decide) by more than the noise."""
        probe = self.probe
        self.probe = None
        if probe is None or len(self._recent[probe]) == 0 or len(self._recent[self.mode]) == 0:
            return
        other = 1 / statistics.fmean(self._recent[probe])
        current = 1 / statistics.fmean(self._recent[self.mode])
        if other > current * (1 + self._noise_margin()):
            self.mode = probe
            self.gap = self.probe_every
        elif other < current / 2:   # far slower: each probe costs its batches, so probe half as often
            self.gap = min(2 * self.gap, 8 * self.probe_every)
            self.next_probe = self.probe_start + self.gap
        else:
            self.gap = self.probe_every
        split, cpu = (other, current) if probe == "split" else (current, other)
        if self.mode == "cpu":
            self.reason = (f"CPU only: batches came at {cpu:,.0f} img/s with the CPU threads alone, {split:,.0f} "
                           f"img/s split with the GPU (re-measured in {self.next_probe - self.batches} batches)")

    def _losing(self) -> bool:
        """A probe window whose first batches came at under half the current way's pace ends early:
        a way that much slower costs every batch it runs, and a few batches settle it."""
        probe, current = self._recent[self.probe or "cpu"], self._recent[self.mode]
        if len(probe) < 3 or not current:
            return False
        return statistics.fmean(probe) > 2 * statistics.fmean(current)

    def _noise_margin(self) -> float:
        """How much faster the other way must have been to be taken: `margin`, or the relative
        standard error of the two paces where the batches' times scatter more (a few noisy batches
        on a loaded host must not flip the mode)."""
        err = 0.0
        for times in self._recent.values():
            if len(times) >= 2:
                err += (statistics.stdev(times) / statistics.fmean(times)) ** 2 / len(times)
        return max(self.margin, math.sqrt(err))

    def _update(self) -> None:
        if self.fixed is not None or self.gpu_rate is None or self.cpu_rate is None:
            return
        g, c = self.gpu_rate, self.cpu_rate
        self.balanced = g / (g + c) if g + c > 0 else 0.0
        if self.mode == "split":
            if self.balanced < self.floor and (self.pace["split"] is None or self.pace["cpu"] is None):
                self.mode = "cpu"  # no pace measured both ways yet: the capacities decide
                self.reason = (f"CPU only: the GPU decoder measured {g:,.0f} img/s beside the CPU threads' "
                               f"{c:,.0f} img/s, under {self.floor:.0%} of the capacity (re-measured every "
                               f"{self.probe_every} batches)")
            else:
                self.reason = (f"split by measured throughput: GPU {g:,.0f} img/s, CPU threads {c:,.0f} img/s, so "
                               f"{self.balanced:.0%} of each batch's JPEGs on the GPU")
        self._apply()

    def _apply(self) -> None:
        """The share handed out now: the balance while splitting (0 under the floor), none on the CPU
        alone; a probe window of the split gives the GPU at least the floor, so it is measured."""
        way = self.probe or self.mode
        self.share = 0.0 if way == "cpu" else max(self.balanced, self.floor)
