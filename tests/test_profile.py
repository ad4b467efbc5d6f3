"""`stoker.profile`: data wait vs step time, and the verdict, on loops whose bottleneck is known.

The slow parts are sleeps with wide margins (a 10x ratio between the slow and the fast side), so a
loaded 2-core machine cannot flip a verdict: sleeping threads need no CPU.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import torch

import stoker
from stoker.errors import ConfigError
from stoker.profiling import COMPUTE_BOUND, INPUT_BOUND, INPUT_BOUND_WAIT, MIN_VERDICT_STEPS, UNDECIDED, ProfileReport
from stoker.tools.synth import make_tiny_jpegs


def slow_batches(n: int, delay_s: float, batch: int = 8):
    for _ in range(n):
        time.sleep(delay_s)
        yield torch.zeros(batch, 4, 4, 3, dtype=torch.uint8), torch.zeros(batch, dtype=torch.long)


def run(iterable, step_s: float, **kwargs) -> stoker.ProfileReport:
    prof = stoker.profile(iterable, verbose=False, **kwargs)
    for _images, _labels in prof:
        time.sleep(step_s)
    return prof.reports[-1]


def test_slow_loader_is_input_bound() -> None:
    r = run(slow_batches(12, 0.05), step_s=0.005)
    assert r.verdict == INPUT_BOUND and r.input_bound
    assert r.data_wait_fraction > 0.5 and r.steps == 11 and r.images == 88
    assert r.fixes and "stoker" in r.fixes[0]
    assert r.median_wait_ms >= 40 and r.first_batch_s >= 0.04


def test_slow_step_is_compute_bound() -> None:
    r = run(slow_batches(12, 0.0), step_s=0.05)
    assert r.verdict == COMPUTE_BOUND and not r.input_bound
    assert r.data_wait_fraction < INPUT_BOUND_WAIT
    assert r.median_step_ms >= 40
    assert 8 * 11 / r.wall_s == pytest.approx(r.images_per_s)


def test_busy_loop_step_is_compute_bound() -> None:
    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    prof = stoker.profile(slow_batches(12, 0.0), verbose=False)
    for _ in prof:
        busy(0.1)   # a wide margin over next() on a loaded machine (a few ms)
    assert prof.reports[-1].verdict == COMPUTE_BOUND


def test_report_every_n_steps_and_as_text_and_dict() -> None:
    out = io.StringIO()
    prof = stoker.profile(slow_batches(12, 0.02), every=4, file=out)
    for _ in prof:
        time.sleep(0.002)
    assert [r.steps for r in prof.reports] == [4, 8, 11]
    text = out.getvalue()
    assert text.count("stoker profile:") == 3 and "INPUT-BOUND" in text and "data wait" in text
    assert [r.verdict for r in prof.reports] == [UNDECIDED, UNDECIDED, INPUT_BOUND]   # none below 10 steps
    d = prof.reports[-1].as_dict()
    assert json.loads(json.dumps(d))["verdict"] == INPUT_BOUND
    assert {"data_wait_percent", "images_per_s", "cpu_percent", "fixes", "stages"} <= set(d)
    assert str(prof.reports[-1]) == prof.reports[-1].format()


def test_break_out_of_the_loop_reports_the_steps_done() -> None:
    prof = stoker.profile(slow_batches(50, 0.0), verbose=False)
    for k, _ in enumerate(prof):
        if k == 4:
            break
    assert prof.reports and prof.reports[-1].steps == 3   # steps 1..3 ended by asking for the next batch


def test_no_warmup_and_empty_iterables() -> None:
    prof = stoker.profile(slow_batches(4, 0.0), warmup=0, verbose=False)
    assert sum(1 for _ in prof) == 4 and prof.reports[-1].steps == 4
    prof = stoker.profile([], verbose=False)
    assert list(prof) == [] and prof.reports == []
    assert prof.report().verdict == UNDECIDED and prof.report().steps == 0
    assert "nan" not in prof.report().format().lower()
    with pytest.raises(ConfigError, match=r"profile\(every=\) must be a positive number"):
        stoker.profile([], every=0)
    with pytest.raises(ConfigError, match=r"profile\(warmup=\) must be a number of steps >= 0"):
        stoker.profile([], warmup=-1)


@pytest.fixture(scope="module")
def loose(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_jpegs(tmp_path_factory.mktemp("profile") / "data", 96, classes=3, size=(64, 80))


def test_stoker_loader_stages_and_loose_files_fix(loose: Path) -> None:
    slow = stoker.RandomResizedCrop(32)

    def sleepy(img):   # a user transform that makes the loader slow: 10 ms per image, 1 thread
        time.sleep(0.01)
        return img
    loader = stoker.Loader(loose, 8, transforms=[slow, sleepy], workers=1)
    r = run(loader, step_s=0.0)
    assert r.verdict == INPUT_BOUND and "loose files" in r.loader
    assert r.stages is not None and r.stages["augment_ms"] >= 9
    assert any("stoker pack" in f for f in r.fixes)
    assert any("more threads: `workers=" in f for f in r.fixes) or any("saturated" in f for f in r.fixes)


def test_stoker_loader_compute_bound(loose: Path) -> None:
    loader = stoker.Loader(loose, 8, transforms=[stoker.RandomResizedCrop(32)], workers=2)
    r = run(loader, step_s=0.2)   # 8 small photos take a few ms: a wide margin on a loaded 2-core machine
    assert r.verdict == COMPUTE_BOUND and r.stages is not None and r.stages["decode_ms"] > 0


def test_torch_dataloader_is_recognised() -> None:
    class Slow(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 96

        def __getitem__(self, i: int):
            time.sleep(0.01)
            return torch.zeros(3, 4, 4), i
    dl = torch.utils.data.DataLoader(Slow(), batch_size=8, num_workers=0)
    r = run(dl, step_s=0.0)
    assert r.verdict == INPUT_BOUND and "DataLoader" in r.loader and r.images == 88
    assert r.cpu_cores == 1 or any("num_workers" in f for f in r.fixes)


def test_report_type_is_exported() -> None:
    assert stoker.ProfileReport is ProfileReport


class _OnSecondGpu(torch.Tensor):
    """A host tensor that says it lives on cuda:1: what profile() reads of a batch to pick the GPU to wait for."""

    device = property(lambda self: torch.device("cuda", 1))
    is_cuda = property(lambda self: True)


def test_gpu_batches_synchronize_their_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # a training loop on cuda:1 whose thread left device 0 current: synchronizing the current device
    # would time the step without the GPU work it queued
    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    batches = [(torch.zeros(4, 2, 2, 3).as_subclass(_OnSecondGpu), torch.zeros(4)) for _ in range(12)]
    r = run(iter(batches), step_s=0.0)
    assert r.synchronized and r.device == "cuda:1"
    assert synced and all(d is not None and torch.device(d) == torch.device("cuda", 1) for d in synced), synced


class PackedDataset:   # what the verdict reads of a packed stoker dataset: its type name, no sizes
    heights = widths = None


class _PackedLoader:   # a stoker.Loader as the verdict sees it (stats, dataset, threads, prefetch)
    def __init__(self, threads: int) -> None:
        self.stats = type("Stats", (), {"read_s": 0.0, "decode_s": 0.0, "augment_s": 0.0, "consumer_wait_s": 0.0})()
        self.dataset, self.num_threads, self.prefetch = PackedDataset(), threads, 2


def _input_bound_report(cpu_percent: float, system_percent: float) -> ProfileReport:
    return ProfileReport(steps=10, images=80, wall_s=1.0, wait_s=0.5, compute_s=0.5, images_per_s=80.0,
                         steps_per_s=10.0, data_wait_fraction=0.5, median_wait_ms=50.0, median_step_ms=50.0,
                         first_batch_s=0.1, warmup_steps=1, synchronized=False, device="cpu", loader="x",
                         cpu_percent=cpu_percent, cpu_cores=2, system_cpu_percent=system_percent,
                         stages={"read_ms": 0.0, "decode_ms": 1.0, "augment_ms": 0.1, "worker_wait_s": 0.0,
                                 "consumer_wait_s": 0.5, "device_ms": 0.0, "samples": 80}, verdict="", reason="")


def test_input_bound_always_names_a_fix_and_a_busy_machine() -> None:
    """A packed Loader on all cores, no stage standing out: it used to say INPUT-BOUND with no fix line."""
    from stoker.profiling import diagnose

    quiet = diagnose(_input_bound_report(cpu_percent=120.0, system_percent=60.0), _PackedLoader(threads=2))
    assert quiet.verdict == INPUT_BOUND and len(quiet.fixes) == 1 and "no single stage stands out" in quiet.fixes[0]
    busy = diagnose(_input_bound_report(cpu_percent=60.0, system_percent=98.0), _PackedLoader(threads=2))
    assert busy.fixes == [busy.fixes[0]] and busy.fixes[0].startswith(
        "the machine is 98% busy while this process uses 60% of its 2 core(s)")
    assert "fix              the machine is 98% busy" in busy.format()
    low = _PackedLoader(threads=2)
    low.workers = stoker.Workers(nice=19)   # a pool below every other job: the fix names the option
    assert diagnose(_input_bound_report(cpu_percent=60.0, system_percent=98.0), low).fixes[0].endswith(
        "run at nice 19, below every other job: workers=stoker.Workers(nice=0) keeps their share")
    grown = _PackedLoader(threads=2)
    grown.workers, grown.stats.pool_threads_peak = stoker.Workers(), 8   # the pool already keeps its share
    assert diagnose(_input_bound_report(cpu_percent=60.0, system_percent=98.0), grown).fixes[0].endswith(
        "the loader's pool already ran up to 8 threads (num_threads=2) to keep its share beside them")
    fixed = _PackedLoader(threads=2)
    fixed.workers, fixed.stats.engine = stoker.Workers(num_threads=2, max_threads=2), True
    assert diagnose(_input_bound_report(cpu_percent=60.0, system_percent=98.0), fixed).fixes[0].endswith(
        "may not grow (max_threads=2): workers=stoker.Workers(max_threads=None) lets it start more threads to "
        "keep its share")
    mine = diagnose(_input_bound_report(cpu_percent=195.0, system_percent=98.0), _PackedLoader(threads=2))
    assert not any("machine is" in f for f in mine.fixes) and any("saturated" in f for f in mine.fixes)


class _Interfering:
    """A re-iterable loader that costs the step while it runs: each pass marks it busy until it ends (as
    loader threads taking the step's cores would), and its batches come at once (no data wait)."""

    def __init__(self, n: int) -> None:
        self.n, self.busy = n, 0

    def __iter__(self):
        self.busy += 1
        try:
            for _ in range(self.n):
                yield torch.zeros(8, 3, 4, 4), torch.zeros(8, dtype=torch.long)
        finally:
            self.busy -= 1


def test_the_interference_control_catches_a_loader_that_slows_a_step_that_never_waits() -> None:
    loader = _Interfering(12)
    seen: list[int] = []

    def step(images, labels) -> None:   # 5x slower while a pass of the loader is running
        seen.append(images.shape[0])
        time.sleep(0.025 if loader.busy else 0.005)
    out = io.StringIO()
    prof = stoker.profile(loader, step=step, file=out)
    for images, labels in prof:
        step(images, labels)
    r = prof.reports[-1]
    assert r.steps == 11 and loader.busy == 0   # the control's pass was stopped
    # data wait says the loader keeps up; what the step loses says otherwise
    assert r.data_wait_fraction < INPUT_BOUND_WAIT
    assert r.synthetic_images_per_s is not None and r.interference_images_per_s is not None
    assert r.fed_ratio is not None and r.fed_ratio < 0.5 and r.interference_ratio < 0.5
    assert r.verdict == INPUT_BOUND and "interference control" in r.fixes[0]
    text = out.getvalue()
    assert "fed / synthetic  0." in text and "nan" not in text.lower()
    d = json.loads(json.dumps(r.as_dict()))
    assert d["fed_ratio"] == pytest.approx(r.fed_ratio) and d["min_verdict_steps"] == MIN_VERDICT_STEPS
    # fed loop (12 batches), then synthetic, interference and synthetic windows of 11 (+1 warm-up step each)
    assert len(seen) == 12 + 1 + 11 + 1 + 11 + 11


def test_a_loader_that_keeps_up_without_interfering_is_compute_bound_by_fed_over_synthetic() -> None:
    def step(images, labels) -> None:
        time.sleep(0.05)   # long beside a loaded machine's oversleeping (a few ms)
    prof = stoker.profile(_Interfering(12), step=step, verbose=False)
    for batch in prof:
        step(*batch)
    r = prof.reports[-1]
    assert r.verdict == COMPUTE_BOUND and r.fed_ratio is not None and r.fed_ratio > 0.9
    assert r.interference_ratio is not None and r.interference_ratio > 0.9
    assert "judged by data wait alone" not in r.format()


def test_a_one_shot_iterator_gets_no_interference_control_and_says_why() -> None:
    prof = stoker.profile(slow_batches(12, 0.0), step=lambda images, labels: time.sleep(0.01), verbose=False)
    for batch in prof:
        time.sleep(0.01)
    r = prof.reports[-1]
    assert r.synthetic_images_per_s is not None and r.interference_images_per_s is None
    assert "one-shot iterator" in r.control_note and "interference     not measured: the iterable ran out" in r.format()
    assert "nan" not in r.format().lower()
    with pytest.raises(ConfigError, match=r"profile\(step=\) must be your training step"):
        stoker.profile([], step=3)


def test_the_guides_example_gives_no_verdict_from_one_step_and_no_nan(tmp_path: Path) -> None:
    """500 images in batches of 256 (the guide's example): one measured step. It printed `read nan ms`,
    `device stage nan ms` and a confident INPUT-BOUND."""
    data = make_tiny_jpegs(tmp_path / "imgs", 500, classes=4, size=(40, 48))
    stoker.pack(data, tmp_path / "packed", progress=False)
    out = io.StringIO()
    train = stoker.Loader(tmp_path / "packed", batch_size=256, seed=0, transforms=[stoker.RandomResizedCrop(32)])
    for images, labels in stoker.profile(train, file=out):
        pass
    text = out.getvalue()
    assert "nan" not in text.lower() and "INPUT-BOUND" not in text and "COMPUTE-BOUND" not in text
    assert "UNDECIDED: 1 step(s) measured after 1 warm-up; a verdict needs at least 10: 9 more" in text
    assert "(2,196 more images at 244 per batch)" in text   # the second batch holds the other 244 images
    assert "loader stages    not measured" in text or "loader stages    per image: read" in text


def test_a_report_of_unmeasured_figures_reads_not_measured() -> None:
    from stoker.profiling import diagnose

    nan = float("nan")
    r = diagnose(ProfileReport(steps=0, images=0, wall_s=0.0, wait_s=0.0, compute_s=0.0, images_per_s=nan,
                               steps_per_s=nan, data_wait_fraction=nan, median_wait_ms=nan, median_step_ms=nan,
                               first_batch_s=nan, warmup_steps=1, synchronized=False, device="cuda:0", loader="x",
                               cpu_percent=nan, cpu_cores=2, system_cpu_percent=nan,
                               stages={"read_ms": nan, "decode_ms": nan, "augment_ms": nan, "worker_wait_s": 0.0,
                                       "consumer_wait_s": 0.0, "device_ms": nan, "samples": 0},
                               verdict="", reason="", synthetic_images_per_s=nan))
    text = r.format()
    assert "nan" not in text.lower() and "not measured" in text and "device stage" not in text
    assert r.verdict == UNDECIDED and "10 more" in r.reason
    assert json.loads(json.dumps(r.as_dict()))["images_per_s"] is None
