"""How each batch's JPEGs are split between the GPU decoder and the CPU worker threads.

The GPU adds decode capacity beside the CPU threads; it does not replace them. A batch is complete
when both sides are done, so the split that finishes them together gives the GPU the share
`G / (G + C)` of the JPEG rows, G and C being the two sides' measured images/s. `SplitControl`
measures both as the Loader runs (the device thread reports each batch: the GPU side's busy time,
and the CPU seconds the workers spent rendering the CPU rows) and moves the share there.

Each side's rate (`Rate`) is its images over its seconds, both averaged over the batches since the
side's rate last changed: weights 1/n, so the first batches count fully and the noise shrinks as
1/sqrt(n), floored at 1/`memory` (an exponential average of about the last `memory` batches, whose
noise is that of a mean of 2 x `memory`). Images and seconds are averaged apart and divided, not per-batch
rates averaged: a batch's time on a loaded host is skewed, and the mean of images / seconds overrates
the noisier side (E[n / t] > n / E[t]). A two-sided CUSUM on each batch's log rate against the average,
in units of the batches' own scatter, detects a change (another process taking the cores, a slower
shard) in a few batches and restarts the average from the batches since the change began. No peer
does this automatically: DALI's `hw_decoder_load` is a fixed setting.

Whether the split helps at all is measured too: the two sides share the host (the device thread's
Python and the workers' take turns at the GIL; the GPU path's host work takes cores), so a side's
rate beside the other can be far below its rate alone. The capacities predict the split's gain,
1 / (1 - G / (G + C)); the probes catch what that model misses. Every `probe_every` batches (twice
as long after each probe that came at under half the pace, up to 8 times) a window of `probe_len`
batches runs the other way (the CPU alone while splitting, the split while the CPU is alone; only
batches run that way count, not those the workers planned before the window opened), measured afresh.
The predicted way (the split where the GPU adds at least `floor` of the capacity) is kept unless the
measurement contradicts it beyond the noise: the split's capacity, G + C with both rates timed beside
each other (the slowdown one causes the other is in them), against the CPU threads' rate alone, by
more than `margin` and twice the standard error of their ratio. A verdict inside the noise follows
the capacities, so a split that adds 11% is taken although 8 noisy batches cannot show it, and a
split slower beyond the noise is left. The whole batches' paces (each as long as its slower side)
end a probe far slower than the current way after 3 batches. `reason` says which and why. Pure
arithmetic on the numbers it is handed: tests drive it with a simulated clock.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque


class Rate:
    """One side's images/s: mean images over mean seconds since the last detected change (weights 1/n,
    at least 1/memory), and a two-sided CUSUM on each batch's log rate that restarts the mean.

    h, k: the CUSUM's threshold and allowance in standard deviations of a batch's log rate (h 7, k 0.5:
    under sigma-0.25 noise a false alarm about once in 3,500 batches per side, the CPU's capacity halved
    found in 4). clip: a batch counts at most this many deviations (one stalled batch alone is no change)."""

    PRIOR = 0.3   # a batch's log-rate scatter assumed before any is measured (a loaded host's is 0.2-0.8)
    LEAST = 0.02  # the scatter never taken below 2%: a noiseless clock must not alarm on rounding

    def __init__(self, memory: int = 32, h: float = 7.0, k: float = 0.5, clip: float = 3.0) -> None:
        self.memory, self.h, self.k, self.clip = memory, h, k, clip
        self.images = self.seconds = 0.0  # averages since the last change
        self.n = 0  # batches in them
        self.var = self.PRIOR ** 2  # of a batch's log rate
        self.seen = 0  # residuals behind `var`
        self.up = self.down = 0.0  # the CUSUM statistics
        self.run_up = self.run_down = 0  # the latest batches in a row beyond k on each side: the change's
        self.batches: deque[tuple[float, float]] = deque(maxlen=memory)  # the latest (images, seconds)
        self.changes = 0

    @property
    def value(self) -> float | None:
        return self.images / self.seconds if self.n else None

    def restart(self) -> None:
        """Measure afresh from the next batch (the scatter learned so far is kept)."""
        self.images = self.seconds = 0.0
        self.n = 0
        self.up = self.down = 0.0
        self.run_up = self.run_down = 0
        self.batches.clear()

    def error2(self) -> float:
        """The squared relative standard error of `value`, from the scatter of the batches behind it
        (their log rates' variance over their count; an average with weights 1/memory is worth
        2 x memory - 1 batches). 0 with fewer than 2 batches timed."""
        recent = [math.log(n / t) for n, t in list(self.batches)[-self.n:] if n > 0] if self.n else []
        if len(recent) < 2:
            return 0.0
        return statistics.variance(recent) / min(self.n, 2 * self.memory - 1)

    def add(self, images: float, seconds: float) -> bool:
        """Count a batch; True when it completed a detected change (the mean restarted)."""
        self.batches.append((images, seconds))
        changed = self.n > 0 and self._watch(images, seconds)
        if changed:
            run = max(self.run_up if self.up > self.h else self.run_down, 1)
            recent = list(self.batches)[-run:]
            self.images = statistics.fmean(b[0] for b in recent)
            self.seconds = statistics.fmean(b[1] for b in recent)
            self.n = len(recent)
            self.up = self.down = 0.0
            self.run_up = self.run_down = 0
            self.changes += 1
        else:
            w = max(1.0 / (self.n + 1), 1.0 / self.memory)
            self.images += w * (images - self.images)
            self.seconds += w * (seconds - self.seconds)
            self.n += 1
        return changed

    def _watch(self, images: float, seconds: float) -> bool:
        """The CUSUM step: this batch's log rate against the mean's, in units of the batches' scatter
        (the mean's own error, 1/n of it, added)."""
        est = self.images / self.seconds
        if images > 0 and est > 0:
            residual = math.log(images / seconds / est)
        else:  # a side that decoded nothing (or nothing before): as far off as one batch counts
            residual = 0.0 if images == est == 0 else math.copysign(math.inf, images - est)
        sd = max(math.sqrt(self.var), self.LEAST) * math.sqrt(1 + 1 / self.n)
        z = max(-self.clip, min(self.clip, residual / sd))
        self.seen += 1
        self.var += max(1.0 / (self.seen + 1), 0.5 / self.memory) * ((z * sd) ** 2 / (1 + 1 / self.n) - self.var)
        self.up = max(0.0, self.up + z - self.k)
        self.down = max(0.0, self.down - z - self.k)
        # where the change began: the trailing run of batches beyond the allowance on its side (the
        # statistic's last zero would also take in the chance excursions just before a change)
        self.run_up = self.run_up + 1 if z > self.k else 0
        self.run_down = self.run_down + 1 if z < -self.k else 0
        return self.up > self.h or self.down > self.h


class SplitControl:
    """The GPU's share of a batch's JPEG rows, from measured throughput (or fixed, with `share`).

    threads: the worker threads rendering the CPU rows (their summed seconds / threads is the CPU
        side's wall time). share: a fixed share in 0..1 (no measuring), or None: automatic, starting
        at `start`. memory: the batches each side's rate averages at most (fewer since a change).
        floor: the least share of the capacity a GPU must add to be predicted worth a split.
        margin: the least a probe's other way must be faster by (a fraction) to overrule the capacities.
        warmup: the batch of the first probe; the first warmup / 2 batches ran at `start` (the workers
        plan ahead) and time no pace."""

    def __init__(self, threads: int, share: float | None = None, *, start: float = 0.5, memory: int = 32,
                 floor: float = 0.02, probe_every: int = 40, probe_len: int = 8, warmup: int = 8,
                 margin: float = 0.05) -> None:
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"gpu_share must be between 0 and 1, got {share!r}")
        self.threads = max(1, int(threads))
        self.fixed = share
        self.balanced = float(start if share is None else share)  # G / (G + C) from the latest rates
        self.share = self.balanced  # what gpu_rows hands out now
        # gpu_rows's last (share, rows asked, answer): whoever plans a batch reads it first (`Filler.prepare`),
        # with no call when the question is the last one
        self.rows_for: tuple[float, int, int] = (-1.0, -1, 0)
        self.floor, self.margin = floor, margin
        self.probe_every, self.probe_len, self.warmup = probe_every, probe_len, warmup
        # images/s: the GPU side; the CPU threads over all batches (the balance: where the two ways do not
        # differ, the batches on the CPU alone keep refining it), beside the GPU only, and alone only
        self.rates = {k: Rate(memory) for k in ("gpu", "cpu", "beside", "alone")}
        self._cpu_pending: tuple[float, float] | None = None  # the CPU rows reported, until their batch is
        self.pace: dict[str, float | None] = {"split": None, "cpu": None}  # whole batches, images/s
        # seconds per image of the latest batches each way: the probes' paces and their noise
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

    @property
    def gpu_rate(self) -> float | None:
        """The GPU side's images/s (None before its first batch)."""
        return self.rates["gpu"].value

    @property
    def cpu_rate(self) -> float | None:
        """The CPU threads' images/s together (since their rate last changed, the CUSUM restarting it
        where their rate beside the GPU and alone differ)."""
        return self.rates["cpu"].value

    def gpu_rows(self, n_jpeg: int) -> int:
        """How many of a batch's `n_jpeg` JPEG rows go to the GPU (read by a worker thread when it
        plans a batch: one float, no lock needed). The last answer is kept with its question: most batches
        ask the same one, and then this makes no call."""
        share, last = self.share, self.rows_for
        if last[0] == share and last[1] == n_jpeg:
            return last[2]
        rows = int(round(share * n_jpeg))
        rows = max(rows, 1) if share > 0 and n_jpeg > 0 else rows  # a share above 0: at least one row
        self.rows_for = (share, n_jpeg, rows)   # one tuple: a thread reads all of it or none
        return rows

    @property
    def settled(self) -> float:
        """The share outside probe windows (what `reason` explains; LoaderStats.gpu_share)."""
        if self.fixed is not None:
            return self.fixed
        return 0.0 if self.mode == "cpu" else max(self.balanced, self.floor)

    def observe_gpu(self, images: int, seconds: float) -> None:
        """The GPU side took `seconds` (its busiest stage: the decode calls, or the resample, and the CPU
        decode of what it could not decode) for the `images` it decoded: 0 when it decoded none, which
        takes its rate to 0 (a decoder that fails every image gets no rows outside the probes')."""
        if images >= 0 and seconds > 0:
            with self.lock:
                self.rates["gpu"].add(images, seconds)
                self._update()

    def observe_cpu(self, images: int, thread_seconds: float) -> None:
        """The worker threads spent `thread_seconds` in all rendering `images` CPU rows. Counted once the
        batch's `observe_batch` says whether it was split: the CPU's rate beside the GPU and alone are
        kept apart (their difference is the interference the probes look for)."""
        if images > 0 and thread_seconds > 0:
            with self.lock:
                self._commit_cpu(None)
                self._cpu_pending = (images * self.threads, thread_seconds)

    def observe_batch(self, images: int, seconds: float, split: bool) -> None:
        """A whole batch of `images` took `seconds` on its slower side (the CPU rows' thread-seconds
        over the threads, or the GPU side's); `split`: some of its rows were decoded on the GPU."""
        with self.lock:
            self._commit_cpu(split)
            if images > 0 and seconds > 0 and self.batches >= self.warmup // 2:
                key = self._last = "split" if split else "cpu"
                self._recent[key].append(seconds / images)
                self.pace[key] = 1 / statistics.fmean(self._recent[key])

    def _commit_cpu(self, split: bool | None) -> None:
        """Count the CPU rows reported last under the rate of the way their batch ran (None: not
        reported; the way handed out now)."""
        if self._cpu_pending is None:
            return
        if split is None:
            split = (self.probe or self.mode) == "split"
        self.rates["cpu"].add(*self._cpu_pending)
        self.rates["beside" if split else "alone"].add(*self._cpu_pending)
        self._cpu_pending = None
        self._update()

    def batch_done(self) -> None:
        """The device thread finished a batch: the probe schedule moves on."""
        with self.lock:
            self._commit_cpu(None)
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
                self.rates["alone" if self.probe == "cpu" else "beside"].restart()
                self._recent[self.probe].clear()
            self._apply()

    def _decide(self) -> None:
        """The probe window is over. The capacities predict a way: the split where the GPU adds at
        least `floor` of the capacity. The measurement overrules it only beyond the noise: the split's
        capacity, G + C with both sides' rates measured beside each other (the slowdown one causes the
        other is in them), against the CPU threads' rate measured alone."""
        probe, far = self.probe, self._losing(at=1)
        self.probe = None
        split, alone, noise = self._capacities()
        if probe is None or split is None or alone is None:
            return
        if self.balanced >= self.floor:
            self.mode = "cpu" if alone > split * (1 + noise) else "split"
        else:
            self.mode = "split" if split > alone * (1 + noise) else "cpu"
        if far and self.mode != probe:
            self.gap = min(2 * self.gap, 8 * self.probe_every)   # each probe costs its batches: half as often
            self.next_probe = self.probe_start + self.gap
        else:
            self.gap = self.probe_every
        if self.mode == "cpu":
            g, c = self.gpu_rate or 0.0, split - (self.gpu_rate or 0.0)
            why = ("under the floor" if self.balanced < self.floor else f"slower beyond the noise ({noise:.0%})")
            self.reason = (f"CPU only: batches came at {alone:,.0f} img/s with the CPU threads alone, {split:,.0f} "
                           f"img/s split with the GPU (GPU {g:,.0f} + CPU threads {c:,.0f} beside it), {why} "
                           f"(re-measured in {self.next_probe - self.batches} batches)")
        else:
            self._update()

    @staticmethod
    def _other(way: str) -> str:
        return "cpu" if way == "split" else "split"

    def _capacities(self) -> tuple[float | None, float | None, float]:
        """The split's images/s (G + C beside each other), the CPU threads' alone, and how much faster
        one must be to overrule the capacities: `margin`, or twice the standard error of their ratio
        (each rate's batches' scatter over the batches behind it) where that is larger."""
        gpu, cpu, alone = self.rates["gpu"], self.rates["beside"], self.rates["alone"]
        if gpu.value is None or alone.value is None:
            return None, alone.value, self.margin
        beside = cpu if cpu.value is not None else alone
        g, c = gpu.value, beside.value
        split = g + c
        if split <= 0:
            return split, alone.value, self.margin
        err = (g * g * gpu.error2() + c * c * beside.error2()) / (split * split) + alone.error2()
        return split, alone.value, max(self.margin, 2 * math.sqrt(err))

    def _losing(self, at: int = 3) -> bool:
        """The probe's batches (at least `at`) came at under half the current way's pace. A probe window
        that does from its first 3 batches ends early: a way that much slower costs every batch it
        runs, and a few batches settle it; and the next probe comes twice as late."""
        if self.probe is None:
            return False
        mine, theirs = self._recent[self.probe], self._recent[self._other(self.probe)]
        if len(mine) < at or not theirs:
            return False
        return statistics.fmean(mine) > 2 * statistics.fmean(theirs)

    def _update(self) -> None:
        g, c = self.gpu_rate, self.cpu_rate
        if self.fixed is not None or g is None or c is None:
            return
        self.balanced = g / (g + c) if g + c > 0 else 0.0
        if self.mode == "split":
            if self.balanced < self.floor:
                self.mode = "cpu"  # the capacities predict no gain: the probes alone give the GPU rows
                self.reason = (f"CPU only: the GPU decoder measured {g:,.0f} img/s beside the CPU threads' "
                               f"{c:,.0f} img/s, under {self.floor:.0%} of the capacity (re-measured every "
                               f"{self.probe_every} batches)")
            else:
                self.reason = (f"split by measured throughput: GPU {g:,.0f} img/s, CPU threads {c:,.0f} img/s, so "
                               f"{self.balanced:.0%} of each batch's JPEGs on the GPU")
        self._apply()

    def _apply(self) -> None:
        """The share handed out now: the balance while splitting (at least the floor), none on the CPU
        alone; a probe window of the split gives the GPU at least the floor, so it is measured."""
        way = self.probe or self.mode
        self.share = 0.0 if way == "cpu" else max(self.balanced, self.floor)
