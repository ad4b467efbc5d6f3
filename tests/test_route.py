"""The route (`loading/route.py`): decided once when the Loader is made, from what the ops declare, the
data, the device options, the placement and a decoder probe; printed by repr(loader), LoaderStats and
the doctor; never rewritten after (a pass moved with iter_on gets its own, from the same fold)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_standin import FixedRateDecoder
from stoker import DeviceOptions, Loader, Workers
from stoker.errors import ConfigError
from stoker.loading import route as route_module
from stoker import native
from stoker.transforms import ColorJitter, RandomHorizontalFlip, RandomResizedCrop
from stoker.transforms.kinds import engine_program
from test_gpu_decode import textured_pack
from test_native_rows import build

CROP = [RandomResizedCrop(48), RandomHorizontalFlip()]
needs_engine = pytest.mark.skipif(not native.engine_available(), reason="the native extension or its libjpeg is missing")


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return textured_pack(tmp_path_factory.mktemp("route"), 4, 20, lambda i: (60 + 3 * i, 80 + 2 * i))


@needs_engine
def test_a_pack_of_jpegs_takes_the_native_path_and_says_so(jpegs: Path) -> None:
    with Loader(jpegs, 8, transforms=CROP, device="numpy") as ld:
        r = ld.route
        assert (r.cpu, r.gpu, r.processes, r.python) == ("native", "none", 0, ())
        assert r.program is not None and len(r.program) == 2
        assert "route: cpu native on threads; gpu none" in repr(ld)
        next(iter(ld))
        assert ld.stats.route is r and ld.stats.engine and ld.stats.as_dict()["route"] == str(r)


@pytest.mark.parametrize("why, make", [
    ("STOKER_ENGINE", lambda mp, p: (mp.setenv("STOKER_ENGINE", "off"), Loader(p, 8, transforms=CROP))[1]),
    ("ColorJitter", lambda mp, p: Loader(p, 8, transforms=CROP + [ColorJitter(0.2)])),
    ("bicubic", lambda mp, p: Loader(p, 8, transforms=[RandomResizedCrop(48, interpolation="bicubic")])),
], ids=["engine-off", "per-sample-op", "filter"])
def test_what_keeps_rows_in_python_is_named(jpegs: Path, monkeypatch: pytest.MonkeyPatch, why: str, make) -> None:
    with make(monkeypatch, jpegs) as ld:
        assert ld.route.cpu == "python" and ld.route.program is None
        assert any(why in line for line in ld.route.python), ld.route.lines()
        assert ld.stats.per_sample_python == list(ld.route.python)


def test_an_op_declares_its_engine_row_on_its_own_class() -> None:
    """A subclass that plans otherwise inherits no engine row: its batches take the Python path."""
    @dataclass(frozen=True)
    class Shifted(RandomResizedCrop):
        def plan(self, state, u):   # noqa: ANN001 - planned its own way
            super().plan(state, u)

    assert engine_program([RandomResizedCrop(8)], [0]) is not None
    assert engine_program([Shifted(8)], [0]) is None


@needs_engine
def test_a_pack_under_the_jpeg_share_takes_the_python_path(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    import stoker

    rng = np.random.default_rng(1)
    for i in range(20):   # half PNG: the engine would refuse half of every batch
        (tmp_path / "src" / "c").mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(rng.integers(0, 255, (80, 90, 3), dtype=np.uint8))   # over raw_below: PNG kept
        img.save(tmp_path / "src" / "c" / f"{i}.{'png' if i % 2 else 'jpg'}")
    stoker.pack(str(tmp_path / "src"), str(tmp_path / "ds"), progress=False)
    with Loader(tmp_path / "ds", 8, transforms=CROP) as ld:
        assert ld.route.cpu == "python" and "of a probe of its rows are JPEGs or raw pixels" in ld.route.python[0]


def test_the_gpu_columns_their_share_and_the_cpu_path(jpegs: Path) -> None:
    auto = Loader(jpegs, 8, transforms=CROP, device=DeviceOptions("cpu", decode="auto", gpu_decoder=FixedRateDecoder()))
    fixed = Loader(jpegs, 8, transforms=CROP, device=DeviceOptions("cpu", decode="auto", gpu_share=0.3,
                                                                  gpu_decoder=FixedRateDecoder()))
    every = Loader(jpegs, 8, transforms=CROP, device=DeviceOptions("cpu", decode="gpu", gpu_decoder=FixedRateDecoder()))
    try:
        assert (auto.route.gpu, auto.route.share, fixed.route.share, every.route.share) == ("columns", None, 0.3, 1.0)
        assert auto.route.cpu == fixed.route.cpu == ("native" if native.engine_available() else "python")
        assert every.route.cpu == "python" and every.route.python == ()   # every JPEG row is the GPU's
        assert "share measured" in str(auto.route) and "share 0.3" in str(fixed.route)
        assert sum(len(x) for x, _ in auto) == 40 and auto.stats.gpu_decoded > 0
    finally:
        for ld in (auto, fixed, every):
            ld.close()


def test_the_gpu_columns_carry_the_engines_program_for_their_rows_where_it_plans_them(
        jpegs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """decode="gpu" leaves the CPU path Python, yet the route carries the program: the GPU's rows are planned
    natively (`jobs.RowPlanner`). None without the native planner, or for an op that declares no engine row
    (the GPU's rows then come from the batch's NumPy plan)."""
    @dataclass(frozen=True)
    class Shifted(RandomResizedCrop):
        def plan(self, state, u):   # noqa: ANN001 - planned its own way
            super().plan(state, u)

    gpu = lambda ops: Loader(jpegs, 8, transforms=ops,  # noqa: E731
                             device=DeviceOptions("cpu", decode="gpu", gpu_decoder=FixedRateDecoder()))
    with gpu(CROP) as ld:
        assert ld.route.cpu == "python" and (ld.route.program is not None) == native.plans_rows()
        if native.plans_rows():
            assert len(ld.route.program) == 2
    with gpu([Shifted(48)]) as ld:
        assert ld.route.gpu == "columns" and ld.route.program is None
    monkeypatch.setattr(native, "plans_rows", lambda: False)
    with gpu(CROP) as ld:
        assert ld.route.program is None
        assert sum(len(x) for x, _ in ld) == 40 and ld.stats.gpu_decoded > 0   # planned from the NumPy plan


def test_where_the_gpu_cannot_take_rows_gpu_refuses_and_auto_says_why(jpegs: Path) -> None:
    loose = jpegs.parent / "src"
    with pytest.raises(ConfigError, match="pack the data first"):
        Loader(loose, 8, transforms=CROP, device=DeviceOptions("cpu", decode="gpu", gpu_decoder=FixedRateDecoder()))
    with Loader(loose, 8, transforms=CROP, device=DeviceOptions("cpu", decode="auto",
                                                               gpu_decoder=FixedRateDecoder())) as ld:
        assert ld.route.gpu == "none" and ld.route.cpu_only.startswith("CPU only: the GPU's crops are planned")
    with Loader(jpegs, 8, transforms=CROP, workers=Workers(num_threads=1, processes=1),
                device=DeviceOptions("cpu", decode="auto", gpu_decoder=FixedRateDecoder())) as ld:
        assert ld.route.gpu == "none" and ld.route.processes == 1 and ld.route.python == ()
        assert "processes=1" in ld.route.cpu_only


def test_a_pass_moved_to_a_device_gets_its_own_route_and_the_plan_keeps_its_own(jpegs: Path) -> None:
    with Loader(jpegs, 8, transforms=CROP) as ld:
        plan = ld.plan
        moved = ld.iter_on(DeviceOptions("cpu", decode="auto", gpu_share=0.5, gpu_decoder=FixedRateDecoder()))
        assert sum(len(x) for x, _ in moved) == 40
        assert ld.stats.route.gpu == "columns" and ld.route.gpu == "none" and ld.plan is plan
        assert sum(len(x) for x, _ in ld) == 40 and ld.stats.route is ld.route


def test_the_probe_reads_rows_spread_over_the_dataset(jpegs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.reader import open_dataset

    seen = []
    with open_dataset(jpegs) as ds:
        real = type(ds).pixel_spans
        monkeypatch.setattr(type(ds), "pixel_spans", lambda self, idx: (seen.append(idx), real(self, idx))[1])
        monkeypatch.setattr(route_module, "PROBE", 5)
        assert route_module.jpeg_share(ds) == 1.0
    assert seen[0].tolist() == [0, 9, 19, 29, 39]
