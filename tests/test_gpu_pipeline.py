"""The pipelined GPU decode path on the CPU: overlap structure, the split's convergence, pixels.

No timing here (benchmarks/bench_gpu_pipeline.py measures): the overlap is shown by a decoder that
blocks until the device thread has resampled the previous batch (a serial path would never get
there), the split by SplitControl driven with simulated throughputs, the pixels against the CPU
path where both decode at full size (nvImageCodec's CPU backend).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stoker import DeviceOptions, Loader, Workers, native
from stoker.errors import ConfigError
from stoker.device.gpu_decode import GpuBatchDecoder
from stoker.device.gpu_split import SplitControl
from gpu_standin import FixedRateDecoder
from stoker.transforms import ColorJitter, RandomHorizontalFlip, RandomResizedCrop
from test_gpu_decode import textured_pack

CROP = [RandomResizedCrop(64), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return textured_pack(tmp_path_factory.mktemp("gpupipe"), 3, 24, lambda i: (96 + 5 * i, 120 + 3 * i))


# ---- overlap: the decode of batch b+1 runs while batch b is resampled --------------------------------------

def test_the_next_batch_is_decoded_while_the_previous_is_resampled(packed: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode of batch k and the resample of batch k-1 are in progress at the same time: each
    waits until the other has started. A serial path (decode, resample, decode, ...) cannot get past
    the first such pair, and every gate would time out."""
    batches = 4
    decoding = [threading.Event() for _ in range(batches)]
    resampling = [threading.Event() for _ in range(batches)]
    timed_out: list[str] = []
    real_resample = GpuBatchDecoder.resample_chunk
    done = [0]

    def resample(self, placed, out):
        j = done[0]
        done[0] += 1
        resampling[j].set()
        if j + 1 < batches and not decoding[j + 1].wait(10):
            timed_out.append(f"resample {j}")
        return real_resample(self, placed, out)

    class Gated(FixedRateDecoder):
        def decode(self, datas, regions=None):
            k = len(self.calls)
            decoding[k].set()
            if k >= 1 and not resampling[k - 1].wait(10):
                timed_out.append(f"decode {k}")
            return super().decode(datas, regions)

    monkeypatch.setattr(GpuBatchDecoder, "resample_chunk", resample)
    dec = Gated()
    loader = Loader(packed, 12, transforms=CROP, seed=1, workers=Workers(num_threads=2),
                    device=DeviceOptions("cpu", decode="gpu", gpu_decoder=dec))
    assert sum(len(x) for x, _ in loader) == 48
    assert timed_out == [] and dec.calls == [12] * batches
    assert loader.stats.gpu_decoded == 48 and loader.stats.gpu_share == 1.0


def test_the_device_thread_submits_batch_b_before_it_finishes_batch_b_minus_1(
        packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device thread's order: submit 0, submit 1, finish 0, submit 2, finish 1, ..., finish last;
    each slot is guarded by its pending batch until that batch is finished."""
    from stoker.device import gpu_pipeline

    log: list[str] = []
    guards: list = []
    submit, finish = gpu_pipeline.PipelinedBuilder.submit, gpu_pipeline.PipelinedBuilder.finish

    def logged_submit(self, slot):
        log.append(f"submit {slot.batch}")
        pending = submit(self, slot)
        guards.append(pending)
        assert not pending.done()  # the slot stays guarded while its batch is decoded
        return pending

    def logged_finish(self, pending):
        log.append(f"finish {pending.slot.batch}")
        return finish(self, pending)

    monkeypatch.setattr(gpu_pipeline.PipelinedBuilder, "submit", logged_submit)
    monkeypatch.setattr(gpu_pipeline.PipelinedBuilder, "finish", logged_finish)
    loader = Loader(packed, 16, transforms=CROP, seed=2, device=DeviceOptions("cpu", decode="gpu",
                                                                             gpu_decoder=FixedRateDecoder()))
    assert len(list(loader)) == 3
    assert log == ["submit 0", "submit 1", "finish 0", "submit 2", "finish 1", "finish 2"]
    assert all(p.done() for p in guards)


def test_decoded_chunks_are_bounded_and_released_in_order(packed: Path) -> None:
    """Small budgets cut each batch into many chunks: never more than RING decoded chunks live at
    once, and the output matches the unpipelined run bit for bit."""
    from stoker.device import gpu_pipeline

    dec = FixedRateDecoder()
    loader = Loader(packed, 16, transforms=CROP, seed=4, device=DeviceOptions("cpu", decode="gpu", gpu_decoder=dec))
    whole = [x.clone() for x, _ in loader]
    loader._passes.decoders.get(loader.device).budget_bytes = 3 * 150 * 200 * 2  # about two images a chunk
    peak = []
    threads = []
    start, decode = gpu_pipeline.DecodeThread.start, GpuBatchDecoder.decode_chunk

    def started(self):
        threads.append(self)
        start(self)

    def decoding(self, *args):   # the chunks live while the next one is decoded
        peak.append(sum(c is not None for t in threads for c in t.live))
        return decode(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_pipeline.DecodeThread, "start", started)
        mp.setattr(GpuBatchDecoder, "decode_chunk", decoding)
        before = len(dec.calls)
        chunked = [x.clone() for x, _ in loader]
    assert len(threads) == 1 and len(peak) == len(dec.calls) - before > 3 * 3
    assert max(peak) == gpu_pipeline.RING - 1 and len(dec.calls) > 3 * 3 + 3
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_closing_mid_epoch_stops_the_decode_thread(packed: Path) -> None:
    loader = Loader(packed, 8, transforms=CROP, device=DeviceOptions("cpu", decode="gpu",
                                                                    gpu_decoder=FixedRateDecoder(0.01)))
    it = iter(loader)
    next(it)
    loader.close()
    for t in threading.enumerate():
        if t.name == "stoker-decode":
            t.join(5)
    assert not any(t.name in ("stoker-decode", "stoker-device") and t.is_alive() for t in threading.enumerate())


# ---- the split: converges to the capacities' ratio ------------------------------------------------------

def simulate(ctrl: SplitControl, gpu_rate: float, cpu_rate: float, batches: int, batch: int = 256,
             latency: float = 0.0, noise: float = 0.0, seed: int = 0, interference: float = 1.0,
             cpu_sigma: float = 0.0) -> list[float]:
    """Drive `ctrl` as the device thread does, with a simulated clock: each batch's GPU side takes
    latency + n_gpu / gpu_rate seconds, its CPU rows n_cpu * threads / cpu_rate thread-seconds (times
    `interference` when the batch is split: the two sides slowing each other down on the host), and
    the batch as long as the slower side. `noise` jitters both sides alike; `cpu_sigma` the CPU side
    alone, skewed as a loaded host skews it (log-normal, mean 1: mostly quick, now and then a thread
    descheduled for a while)."""
    rng = np.random.default_rng(seed)
    shares = []
    for _ in range(batches):
        n_gpu = ctrl.gpu_rows(batch)
        n_cpu = batch - n_gpu
        jitter = 1 + noise * rng.uniform(-1, 1)
        skew = float(np.exp(cpu_sigma * rng.standard_normal() - cpu_sigma ** 2 / 2))
        slow = interference if n_gpu else 1.0
        gpu_s = (latency + n_gpu / gpu_rate) * jitter if n_gpu else 0.0
        cpu_s = n_cpu * ctrl.threads / cpu_rate * jitter * slow * skew
        if n_gpu:
            ctrl.observe_gpu(n_gpu, gpu_s)
        if n_cpu:
            ctrl.observe_cpu(n_cpu, cpu_s)
        ctrl.observe_batch(batch, max(gpu_s, cpu_s / ctrl.threads), split=bool(n_gpu))
        ctrl.batch_done()
        shares.append(ctrl.share)
    return shares


@pytest.mark.parametrize("gpu_rate, cpu_rate", [(2000.0, 8000.0), (6000.0, 3000.0), (1000.0, 1000.0)])
def test_the_split_converges_to_the_capacities_ratio(gpu_rate: float, cpu_rate: float) -> None:
    want = gpu_rate / (gpu_rate + cpu_rate)
    ctrl = SplitControl(threads=8)
    shares = simulate(ctrl, gpu_rate, cpu_rate, 120, noise=0.2)
    split = [s for s in shares[5:] if s > 0]  # outside the windows that time the CPU alone
    assert len(split) > 90 and all(abs(s - want) <= 0.15 * want for s in split), (want, shares)  # +-20% noise
    assert abs(np.mean(split[-60:]) - want) <= 0.05 * want
    assert all(abs(s - want) <= 0.1 * want for s in simulate(SplitControl(threads=8), gpu_rate, cpu_rate, 60)[3:]
               if s > 0)  # without noise: within 10% from the third batch on
    assert ctrl.mode == "split" and "split by measured throughput" in ctrl.reason
    # the CPU alone was timed in probe windows, and lost (a window at under half the split's pace ends
    # after 3 batches, a closer one after 8)
    windows = sum(1 for a, b in zip([1.0] + shares, shares) if a > 0 and b == 0)
    assert windows >= 2 and shares.count(0.0) >= 3 * windows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_skewed_noise_on_the_cpu_side_does_not_pull_the_share_down(seed: int) -> None:
    """The CPU rows' time on a loaded host is skewed: most batches quick, some several times slower
    (log-normal, sigma 0.8: as measured on a loaded 2-core VM). Averaging per-batch rates overrates
    such a side (E[n / t] > n / E[t]) and settled the GPU's share 20-30% under G / (G + C); the
    images and seconds smoothed apart keep the mean within 10%. (No probe windows here: this is the
    balance alone.)"""
    want = 300.0 / (300.0 + 900.0)
    ctrl = SplitControl(threads=1, probe_every=10_000, warmup=10_000)
    shares = simulate(ctrl, 300.0, 900.0, 400, batch=16, cpu_sigma=0.8, seed=seed)[8:]
    assert min(shares) > 0 and abs(np.mean(shares) - want) <= 0.1 * want, (want, np.mean(shares))


def test_the_split_follows_a_change_of_load() -> None:
    ctrl = SplitControl(threads=4)
    simulate(ctrl, 3000.0, 3000.0, 20)
    assert abs(ctrl.share - 0.5) < 0.02
    shares = simulate(ctrl, 3000.0, 9000.0, 10)  # the CPU got three times faster (say, the model went idle)
    assert abs(shares[-1] - 0.25) < 0.025 and ctrl.mode == "split"


def test_a_split_that_slows_the_cpu_side_down_is_dropped_and_retried() -> None:
    """Each side alone is fast, but beside each other the CPU rows take eight times as long (the GIL,
    shared cores): the split's capacity, 2,000 + 2,500 / 8 img/s, is 7.5% under the CPU alone's 2,500
    (beyond the 5% margin of a noiseless clock), so the CPU alone is kept against the capacities'
    prediction, and the split is tried again every probe_every batches. (At five times, 2,000 + 500 is
    the CPU alone's pace: a tie, which the capacities decide for the split.)"""
    ctrl = SplitControl(threads=1, probe_every=20, probe_len=6, warmup=4)
    shares = simulate(ctrl, 2000.0, 2500.0, 40, batch=16, interference=8.0)
    assert ctrl.mode == "cpu" and ctrl.reason.startswith("CPU only: batches came at")
    assert 0 in shares and shares[-1] == 0.0
    shares = simulate(ctrl, 2000.0, 2500.0, 30, batch=16, interference=1.0)  # the interference is gone
    assert ctrl.mode == "split" and shares[-1] > 0.05


def test_a_gpu_that_adds_too_little_is_left_out_but_still_measured() -> None:
    ctrl = SplitControl(threads=16, floor=0.02, probe_every=10, probe_len=4, warmup=4)
    simulate(ctrl, 50.0, 10_000.0, 3)
    assert ctrl.share == 0.0 and ctrl.mode == "cpu" and ctrl.reason.startswith("CPU only: the GPU decoder measured")
    shares = simulate(ctrl, 20_000.0, 10_000.0, 40)  # the GPU became fast: a probe of the split takes it back
    assert ctrl.mode == "split" and abs(shares[-1] - 2 / 3) < 0.07


def test_a_fixed_share_is_never_moved() -> None:
    ctrl = SplitControl(threads=4, share=0.3)
    simulate(ctrl, 1000.0, 9000.0, 60)
    assert ctrl.share == 0.3 and ctrl.gpu_rows(100) == 30 and "gpu_share" in ctrl.reason
    with pytest.raises(ConfigError, match="gpu_share must be a number between 0 and 1"):
        DeviceOptions("cpu", decode="auto", gpu_share=1.5)


def test_the_rows_handed_out_follow_the_share_as_it_moves() -> None:
    """`gpu_rows` keeps its last answer for the next batch that asks the same: whatever the sequence of
    shares and batch sizes, each answer is the share's rounding (at least one row above 0)."""
    ctrl = SplitControl(threads=2, share=0.3)
    for share, n in [(0.3, 100), (0.3, 100), (0.3, 7), (0.5, 7), (0.5, 7), (0.0, 7), (0.004, 100), (0.004, 100),
                     (0.125, 4), (0.375, 4), (1.0, 0), (1.0, 256), (0.3, 100)]:
        ctrl.share = share
        assert ctrl.gpu_rows(n) == (max(round(share * n), 1) if share > 0 and n > 0 else round(share * n)), (share, n)


def test_auto_splits_each_batch_and_says_why(packed: Path) -> None:
    loader = Loader(packed, 16, transforms=CROP, seed=5, workers=Workers(num_threads=2),
                    device=DeviceOptions("cpu", decode="auto", gpu_decoder=FixedRateDecoder(0.002, 4000)))
    for _ in range(3):
        assert sum(len(x) for x, _ in loader) == 48
    stats = loader.stats
    assert 0 < stats.gpu_decoded < stats.samples  # both sides decoded (the first batches split half and half)
    # which way wins depends on this machine's timing; either way the share and the reason agree
    assert 0.0 < stats.gpu_share < 1.0 and stats.gpu_split.startswith("split by measured throughput") or \
        stats.gpu_share == 0.0 and stats.gpu_split.startswith("CPU only")
    assert set(stats.gpu_phases) == {"plan_s", "upload_s", "decode_s", "reads_wait_s", "decode_wait_s",
                                     "resample_s", "fallback_s", "convert_s"}
    assert stats.gpu_phases["decode_s"] > 0 and stats.gpu_phases["resample_s"] > 0


def test_the_workers_seconds_preparing_the_gpus_rows_reach_plan_s(packed: Path) -> None:
    """plan_s comes with each worker's own counters (flushed as a batch completes), not from the batch's plan:
    every pass adds to it, and it is part of the workers' read_s."""
    loader = Loader(packed, 16, transforms=CROP, seed=5, workers=Workers(num_threads=2),
                    device=DeviceOptions("cpu", decode="gpu", gpu_decoder=FixedRateDecoder()))
    seen = []
    for _ in range(2):
        assert sum(len(x) for x, _ in loader) == 48
        seen.append(loader.stats.gpu_phases["plan_s"])
    assert 0 < seen[0] < seen[1] <= loader.stats.read_s


def test_auto_decodes_on_the_cpu_where_the_gpu_cannot_help_and_says_why(packed: Path) -> None:
    no_cuda = Loader(packed, 16, transforms=CROP, device=DeviceOptions("cpu", decode="auto"))
    assert no_cuda.route.gpu == "none" and no_cuda.stats.gpu_split.startswith("CPU only: no GPU JPEG decoder")
    assert sum(len(x) for x, _ in no_cuda) == 48 and no_cuda.stats.gpu_decoded == 0
    tail = Loader(packed, 16, transforms=CROP + [ColorJitter(0.2)],
                  device=DeviceOptions("cpu", decode="auto", gpu_decoder=FixedRateDecoder()))
    assert tail.route.gpu == "none" and "ColorJitter" in tail.stats.gpu_split


# ---- pixels: within 1 level of the CPU path where both decode at full size ------------------------------

def test_region_decode_and_reused_outputs_match_the_cpu_path_within_one_level(packed: Path) -> None:
    nvimgcodec = pytest.importorskip("stoker.device.gpu_backends").NvImageCodecDecoder
    try:
        whole = nvimgcodec("cpu", regions=False)
        region = nvimgcodec("cpu", regions=True, reuse=3)
    except ConfigError as exc:
        pytest.skip(f"nvImageCodec's CPU backend is not usable here: {exc}")
    ops = [RandomResizedCrop(72), RandomHorizontalFlip()]
    cpu = Loader(packed, 16, transforms=ops, seed=6, workers=Workers(decode_quality="exact"), device="cpu")
    want = [x for x, _ in cpu]
    for dec in (whole, region):
        got = [x for x, _ in Loader(packed, 16, transforms=ops, seed=6,
                                    device=DeviceOptions("cpu", decode="gpu", gpu_decoder=dec))]
        for a, b in zip(want, got):
            assert int((a.int() - b.int()).abs().max()) <= 1
    assert region.regions and region.reuse == 3 and region._kept[0] is not None  # outputs were kept for reuse


def test_doctor_names_the_split_and_why() -> None:
    from stoker.loading.stats import LoaderStats
    from stoker.tools.doctor import _gpu_decode

    stats = LoaderStats(gpu_decoder="nvImageCodec 0.9.0 hardware JPEG first", gpu_share=0.25,
                        gpu_split="split by measured throughput: GPU 2,000 img/s, CPU threads 6,000 img/s, so 25% ...")
    line = _gpu_decode(stats)
    assert line.startswith("nvImageCodec 0.9.0") and "25% of each batch's JPEGs on the GPU" in line
    assert "CPU threads 6,000 img/s" in line
    assert _gpu_decode(LoaderStats(gpu_decoder="TorchCodec 0.17.0 nvJPEG")) == "TorchCodec 0.17.0 nvJPEG"


@pytest.mark.parametrize("decode, share", [("gpu", None), ("auto", 0.5)])
def test_submit_hands_the_decode_thread_the_columns_plan_columns_makes(packed: Path, decode: str, share: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`submit` takes a batch of one chunk of rows as its columns itself (`plan_columns`' first case, inlined):
    the same rows, crops, flips and bytes as `plan_columns` gives, whether every row is the GPU's or a split
    leaves it the batch's last rows."""
    from stoker.device import gpu_pipeline
    from stoker.loading.jobs import plan_columns

    pairs: list = []
    submit = gpu_pipeline.PipelinedBuilder.submit

    def spy(self, slot):
        want = plan_columns(slot.plan, slot.size)
        pending = submit(self, slot)
        pairs.append((want, pending.ticket.jobs))
        return pending

    monkeypatch.setattr(gpu_pipeline.PipelinedBuilder, "submit", spy)
    loader = Loader(packed, 16, transforms=CROP, seed=4, workers=Workers(num_threads=2),
                    device=DeviceOptions("cpu", decode=decode, gpu_share=share, gpu_decoder=FixedRateDecoder()))
    assert sum(len(x) for x, _ in loader) == 48
    assert len(pairs) == 3
    for want, got in pairs:
        assert len(got) == len(want) > 0
        assert np.array_equal(got.geo, want.geo) and np.array_equal(got.box, want.box)
        assert np.array_equal(got.spans, want.spans) and got.data is want.data
        assert [got.job(i).key for i in range(len(got))] == [want.job(i).key for i in range(len(want))]


def test_a_batchs_jpeg_bytes_share_one_staging_buffer(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a slot's second batch on, the workers copy its JPEGs into one buffer made by the device
    thread, each job's bytes a view at its own offset; a buffer too small for a batch is replaced by a
    larger one for the next, and the pixels never change."""
    from stoker.device import gpu_pipeline
    from stoker.loading.jobs import plan_columns

    seen: list[tuple[int, list]] = []
    submit = gpu_pipeline.PipelinedBuilder.submit

    def spy(self, slot):
        jobs = plan_columns(slot.plan, slot.size)   # the chunks the workers prepared (BatchPlan.gpu_rows)
        base = slot.staging.buffer if slot.staging is not None else None
        spans = []
        for j in jobs:
            inside = base is not None and j.data.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            spans.append((inside, j.data.storage_offset(), j.data.numel()))
        seen.append((id(slot), spans))
        return submit(self, slot)

    monkeypatch.setattr(gpu_pipeline.PipelinedBuilder, "submit", spy)
    loader = Loader(packed, 4, transforms=CROP, seed=7, device=DeviceOptions("cpu", decode="gpu",
                                                                            gpu_decoder=FixedRateDecoder()))
    first = [x.clone() for x, _ in loader]  # 12 batches: every slot of the ring is used more than once
    again = [x.clone() for x, _ in loader]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    staged = [spans for _, spans in seen if spans and all(inside for inside, _, _ in spans)]
    assert staged, "no batch had its JPEGs in a staging buffer"
    for spans in staged:  # back to back, no overlap
        ranges = sorted((off, off + n) for _, off, n in spans)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
    # a buffer too small: the chunk is refused (it gets a private buffer), counted
    from stoker.loading.jobs import JpegStaging
    st = JpegStaging(torch.zeros(8, dtype=torch.uint8))
    assert st.reserve(5) == 0 and st.reserve(5) is None and st.used == 5 and st.overflow == 5
    st.reset()
    assert st.used == 0 and st.overflow == 0


def test_auto_with_a_worker_process_decodes_on_the_cpu_and_says_why(packed: Path) -> None:
    loader = Loader(packed, 16, transforms=CROP, workers=Workers(num_threads=1, processes=1),
                    device=DeviceOptions("cpu", decode="auto", gpu_decoder=FixedRateDecoder()))
    try:
        assert loader.route.gpu == "none" and "processes=1" in loader.stats.gpu_split
        assert sum(len(x) for x, _ in loader) == 48 and loader.stats.gpu_decoded == 0
    finally:
        loader.close()


def test_a_persistent_loader_runs_the_pipeline_across_epochs(packed: Path) -> None:
    loader = Loader(packed, 16, transforms=CROP, seed=8, workers=Workers(num_threads=2, persistent=True),
                    device=DeviceOptions("cpu", decode="gpu", gpu_decoder=FixedRateDecoder(0.005)))
    try:
        epochs = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            epochs.append([x.clone() for x, _ in loader])
        assert [len(e) for e in epochs] == [3, 3, 3] and loader.stats.gpu_decoded == 144
        again = Loader(packed, 16, transforms=CROP, seed=8, device=DeviceOptions("cpu", decode="gpu",
                                                                                gpu_decoder=FixedRateDecoder()))
        again.set_epoch(2)
        assert all(torch.equal(a, b) for a, b in zip(epochs[2], (x for x, _ in again)))
    finally:
        loader.close()


def test_the_phase_timers_reach_the_log(packed: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="stoker.gpu")
    loader = Loader(packed, 16, transforms=CROP, device=DeviceOptions("cpu", decode="gpu",
                                                                     gpu_decoder=FixedRateDecoder()))
    assert sum(len(x) for x, _ in loader) == 48
    loader.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "stoker.gpu"]
    assert lines and lines[-1].startswith("GPU decode after 3 batches, seconds per phase: plan ")
    for phase in ("upload", "decode", "reads_wait", "decode_wait", "resample", "fallback", "convert", "GPU share 100%"):
        assert phase in lines[-1]


# ---- the CPU share of a split batch: the native batch engine, the CPU path's pixels ---------------------

@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JPEGs with PNG, raw and two damaged rows among them (what the engine refuses)."""
    from test_native_rows import build

    return build(tmp_path_factory.mktemp("split") / "ds", seed=1, bad=(3, 20))


def _batches(path: Path, device: Any, threads: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = Loader(path, 8, transforms=CROP, seed=9, device=device,
                    workers=Workers(num_threads=threads, on_error="skip"))
    try:
        return [(x.clone(), y.clone()) for x, y in loader]
    finally:
        loader.close()


@pytest.mark.skipif(not native.engine_available(), reason="the native extension or its libjpeg is missing")
def test_the_cpu_rows_of_a_split_batch_are_the_cpu_paths_whatever_the_share(mixed: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows a split leaves to the CPU go through the native batch engine (its pool renders them),
    bit for bit the rows decode="cpu" gives, labels and on_error replacements included, at any share
    and with the automatic one; rows the engine refuses (PNG, raw, damaged) take the per-sample path.
    decode="gpu" alone makes no pool: it leaves no JPEG row to the CPU."""
    from stoker.loading import engine, route
    from test_engine import Counting

    Counting.made = []
    monkeypatch.setattr(native, "engine", Counting)
    monkeypatch.setattr(route, "MIN_JPEG_SHARE", 0.0)   # the data mixes PNG and raw rows in
    want = _batches(mixed, "cpu")
    assert Counting.made and sum(c.rows for c in Counting.made) > 20
    grey = FixedRateDecoder()  # every GPU row comes out a flat 128: told apart from a decoded row
    for share in (0.0, 0.3, 0.7, None):
        for threads in (1, 2):
            Counting.made = []
            got = _batches(mixed, DeviceOptions("cpu", decode="auto", gpu_share=share, gpu_decoder=grey), threads)
            assert len(got) == len(want) and Counting.made, (share, threads)
            served = sum(c.rows for c in Counting.made)
            for (a, la), (b, lb) in zip(want, got):
                assert torch.equal(la, lb)
                n = len(a)
                cpu = n - int(round(share * n)) if share is not None else 0  # auto: any share
                assert torch.equal(a[:cpu], b[:cpu]), (share, threads)
                for r in range(cpu, n):  # the GPU's rows: the stand-in's grey, or the CPU's where it fell back
                    assert torch.equal(a[r], b[r]) or bool((b[r] == 128).all())
            if share == 0.7:
                assert 0 < served < 36 and any(not torch.equal(a, b) for (a, _), (b, _) in zip(want, got))
            if share == 0.0:
                assert served > 20
    Counting.made = []
    only_gpu = _batches(mixed, DeviceOptions("cpu", decode="gpu", gpu_decoder=grey))
    assert Counting.made == [] and len(only_gpu) == len(want)


def test_a_probe_of_a_far_slower_way_ends_early() -> None:
    """A probe window of the split whose batches come at under half the CPU alone's pace ends after
    three of them, not probe_len: each batch it runs costs the loader."""
    ctrl = SplitControl(threads=1, probe_every=20, probe_len=8, warmup=4)
    shares = simulate(ctrl, 2000.0, 2500.0, 16, batch=16, interference=8.0)   # the split: 8x slower CPU rows
    assert ctrl.mode == "cpu" and shares[-1] == 0.0
    start = len(shares)
    shares += simulate(ctrl, 2000.0, 2500.0, 24, batch=16, interference=8.0)   # a probe of the split at 24
    probed = [k for k in range(start, len(shares)) if shares[k] > 0]
    assert len(probed) == 3 and ctrl.mode == "cpu", shares


def test_probes_of_a_far_slower_way_come_less_often() -> None:
    """Each probe of a split far slower than the CPU alone doubles the gap to the next (up to 8 x
    probe_every); one that wins brings the split back at once."""
    ctrl = SplitControl(threads=1, probe_every=10, probe_len=4, warmup=4)
    shares = simulate(ctrl, 2000.0, 2500.0, 200, batch=16, interference=8.0)
    starts = [k for k in range(1, len(shares)) if shares[k] > 0 and shares[k - 1] == 0]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert ctrl.mode == "cpu" and gaps[:3] == [20, 40, 80] and max(gaps) <= 80, gaps
    shares = simulate(ctrl, 2000.0, 2500.0, 90, batch=16)   # the interference is gone: the next probe wins
    assert ctrl.mode == "split" and shares[-1] > 0.3


def test_loader_stats_say_the_split_runs_the_engine_and_nothing_stays_per_row(packed: Path) -> None:
    """The split's CPU rows go through the engine and its GPU rows are prepared a chunk at a time: the
    worker threads run no Python per sample, and LoaderStats says so; decode="gpu" alone likewise."""
    from stoker.tools.doctor import _per_sample

    for device in (DeviceOptions("cpu", decode="auto", gpu_share=0.5, gpu_decoder=FixedRateDecoder()),
                   DeviceOptions("cpu", decode="gpu", gpu_decoder=FixedRateDecoder())):
        loader = Loader(packed, 16, transforms=CROP, workers=Workers(num_threads=2), device=device)
        try:
            assert sum(len(x) for x, _ in loader) == 48
            assert loader.stats.engine == (native.engine_available() and device.decode == "auto")
            if native.ON and (loader.stats.engine or device.decode == "gpu"):
                assert loader.stats.per_sample_python == [], loader.stats.per_sample_python
                assert _per_sample([]).startswith("none") and loader.route.gpu == "columns"
        finally:
            loader.close()
    # unpacked files: no stored sizes to plan the GPU's crops per batch, so no GPU rows one at a time either
    with pytest.raises(ConfigError, match="pack the data first"):
        Loader(packed.parent / "src", 16, transforms=CROP, device=DeviceOptions("cpu", decode="gpu",
                                                                            gpu_decoder=FixedRateDecoder()))
    loose = Loader(packed.parent / "src", 16, transforms=CROP, workers=Workers(num_threads=2),
                   device=DeviceOptions("cpu", decode="auto", gpu_decoder=FixedRateDecoder()))
    try:
        assert sum(len(x) for x, _ in loose) == 48 and loose.stats.gpu_decoded == 0
        assert loose.route.gpu == "none" and "pack the data first" in loose.stats.gpu_split
    finally:
        loose.close()


def test_the_split_reads_gpu_time_from_events_only_once_they_are_done() -> None:
    """On a GPU the split is fed device time: the decode's and the resample's CUDA events, read only
    once `query()` says they completed (never a wait), the busier stream's span, oldest batch first."""
    from collections import deque
    from types import SimpleNamespace

    from stoker.device.gpu_pipeline import PipelinedBuilder

    class Event:
        def __init__(self, at_ms: float, done: bool = True) -> None:
            self.at_ms, self.done = at_ms, done

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end: "Event") -> float:
            assert self.done and end.done, "read before it completed"
            return end.at_ms - self.at_ms

    seen: list = []
    late = Event(30.0, done=False)
    fake = SimpleNamespace(timings=deque([(10, (Event(0), Event(8), Event(2), Event(5)), 0.5),
                                          (20, (Event(10), Event(12), Event(13), late), 0.0)]),
                           split=SimpleNamespace(observe_gpu=lambda n, s: seen.append((n, s))))
    PipelinedBuilder._gpu_times(fake)   # the second batch's resample has not run yet: left for later
    assert seen == [(10, pytest.approx(0.008 + 0.5))] and len(fake.timings) == 1
    late.done = True
    PipelinedBuilder._gpu_times(fake)
    assert seen[1] == (20, pytest.approx(0.017)) and not fake.timings


# ---- the decode thread's ring of chunks, alone --------------------------------------------------------------

class _StubChunk:
    rows = np.zeros(1, np.int64)

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail


class _StubGpu:
    """What `DecodeThread` calls of a `GpuBatchDecoder` and its decoder: a ticket's jobs are its chunks."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.decoder, self.entries = self, []

    def use_entry(self, k: int) -> None:
        self.entries.append(k)

    def chunks(self, jobs: list) -> list:
        return jobs

    def decode_chunk(self, jobs: _StubChunk, out_h: int, out_w: int) -> tuple:
        if jobs.fail:
            raise ValueError("this chunk cannot be decoded")
        return jobs, []


def _decode_thread(gpu: _StubGpu) -> Any:
    from types import SimpleNamespace

    from stoker.device.gpu_pipeline import DecodeThread

    phases = SimpleNamespace(stats=SimpleNamespace(gpu_phases={"decode_s": 0.0, "reads_wait_s": 0.0}))
    thread = DecodeThread(gpu, threading.Event(), 5.0, phases)
    thread.start()
    return thread


def test_a_chunk_whose_decode_raised_takes_no_ring_entry() -> None:
    """The decoder's output buffers of a ring entry are handed out again only once the chunk that held them
    is released: a chunk whose decode raised held none, so the next chunk takes the same entry (not the
    entry of a chunk still live, never released here)."""
    from stoker.device.gpu_pipeline import _Ticket

    gpu = _StubGpu()
    decoder = _decode_thread(gpu)
    try:
        tickets = [_Ticket.of([_StubChunk(), _StubChunk()], 8, 8),
                   _Ticket.of([_StubChunk(True), _StubChunk()], 8, 8), _Ticket.of([_StubChunk()], 8, 8)]
        for t in tickets:
            decoder.submit(t)
        assert [decoder.next_chunk(tickets[0]) is not None for _ in range(3)] == [True, True, False]
        with pytest.raises(ValueError, match="cannot be decoded"):
            decoder.next_chunk(tickets[1])
        chunk = decoder.next_chunk(tickets[2])
        assert chunk is not None and chunk.last and decoder.next_chunk(tickets[2]) is None
        assert gpu.entries == [0, 1, 2, 2] and decoder.count == 3
        assert [c is not None for c in decoder.live] == [True, True, True]
    finally:
        decoder.stop_event.set()
        decoder.join(5)
    assert not decoder.thread.is_alive()


def test_a_stop_seen_at_the_rings_release_ends_the_decode_thread_quietly() -> None:
    """`wake` puts its marker in the queue of released chunks too: the decode thread, finding it where it
    takes the oldest chunk's release, ends without an error for the batch (and decodes nothing more)."""
    from stoker.device.gpu_pipeline import RING, _END, _Ticket

    gpu = _StubGpu()
    decoder = _decode_thread(gpu)
    decoder.released.put(_END)
    ticket = _Ticket.of([_StubChunk() for _ in range(RING + 2)], 8, 8)
    decoder.submit(ticket)
    decoder.thread.join(5)
    assert not decoder.thread.is_alive() and decoder.count == RING
    assert [ticket.out.get_nowait().last for _ in range(RING)] == [False] * RING and ticket.out.empty()
    decoder.stop_event.set()


def test_the_decode_thread_waiting_for_a_batch_ends_as_soon_as_its_stop_flag_is_set() -> None:
    """Its wait for the next batch polls the flag only every `_IDLE_POLL_S` (long: an idle thread costs no
    calls); a flag set by anyone (the interpreter's exit sets it without calling `stop`) wakes it at once
    through `StopFlag.wakes`."""
    from types import SimpleNamespace

    from stoker.device.gpu_pipeline import _IDLE_POLL_S, DecodeThread
    from stoker.loading.bells import StopFlag

    assert _IDLE_POLL_S >= 5.0
    flag = StopFlag()
    phases = SimpleNamespace(stats=SimpleNamespace(gpu_phases={"decode_s": 0.0, "reads_wait_s": 0.0}))
    decoder = DecodeThread(_StubGpu(), flag, 5.0, phases)
    flag.wakes.append(decoder.wake)
    decoder.start()
    threading.Event().wait(0.05)   # waiting for a ticket now
    flag.set()
    decoder.thread.join(_IDLE_POLL_S / 2)   # well within the poll: only the wake ends it this soon
    assert not decoder.thread.is_alive()
