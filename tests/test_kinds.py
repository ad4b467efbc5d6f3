"""The sample-kind protocol (`stoker.loading.kinds`): the two built kinds answer what the glue asks, they
cross to a worker process intact, the batch ops see every frame of a row as an image, and a third kind
written against the protocol alone goes through the Filler, on_error="skip" and the hand-out unchanged."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from stoker.loading.clips import ClipKind, Clips
from stoker.loading.handout import host_batch, run_batch_ops
from stoker.loading.kinds import IMAGES, ImageKind, Renderer, SampleKind, fold_rows, unfold_rows
from stoker.loading.render import Filler, RenderSpec
from stoker.loading.route import decide
from stoker.loading.slots import BatchRing
from stoker.loading.stats import WorkerTimes
from stoker.transforms import CenterCrop, Normalize, Pipeline
from test_render import SIZES
from test_render import MemoryDataset as Memory   # labels: 10 x the index

@dataclass(frozen=True)
class Mirrored:
    """A third kind, built on the protocol alone: each row is the image and its mirror, [2, H, W, 3],
    with the dataset index and the epoch position each row holds as extras."""

    name: ClassVar[str] = "mirrored"
    frames: ClassVar[int] = 2
    per_item: ClassVar[int] = 1
    plans_batch: ClassVar[bool] = True
    per_row_python: ClassVar[str | None] = "mirrored pairs: the mirror is copied per row"
    cpu_only: ClassVar[str | None] = "CPU only: mirrored pairs"

    @property
    def options(self) -> None:
        return None

    def extras(self, indices: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        return {"source": indices.astype(np.int64), "position": positions.astype(np.int64)}

    def render_row(self, filler: Renderer, idx: int, position: int, key: int, u: np.ndarray, box: tuple | None,
                   dst: np.ndarray, scratch: dict, times: WorkerTimes) -> None:
        filler.render(idx, key, u, box, dst[0], scratch, times)
        dst[1] = dst[0, :, ::-1]

    def state(self) -> dict[str, str]:
        return {"mirrored": "yes"}


def _spec(kind: SampleKind, on_error: str = "raise") -> RenderSpec:
    return RenderSpec(4, (20, 20), Pipeline([CenterCrop(20)]), 7, on_error, (), Memory().labels,
                      np.array([h for h, _ in SIZES]), np.array([w for _, w in SIZES]), kind=kind)


def _render(filler: Filler, n: int) -> tuple:
    spec = filler.spec
    slot = BatchRing(1, spec.batch_size, *spec.output_size, label_dtype=np.dtype(np.int64), pin_memory=False,
                     frames=spec.frames).slots[0]
    slot.batch, slot.size = 0, n
    slot.plan = filler.prepare(0, slot)
    times = WorkerTimes()
    for row in range(n):
        filler.fill(slot.plan, row, slot, {}, times)
    return slot, times


def test_the_built_kinds_answer_what_the_glue_asks() -> None:
    assert (IMAGES.frames, IMAGES.per_item, IMAGES.plans_batch, IMAGES.options, IMAGES.state()) == (0, 1, True, None, {})
    assert IMAGES.per_row_python is None and IMAGES.cpu_only is None
    assert IMAGES.extras(np.arange(3), np.arange(3)) == {}
    one = ClipKind(Clips(frames=5))
    assert (one.frames, one.per_item, one.plans_batch, one.options) == (5, 1, False, Clips(frames=5))
    assert one.extras(np.arange(3), np.arange(3)) == {} and "PyAV" in str(one.cpu_only)
    assert one.state() == {"clips": repr(Clips(frames=5))} and one.per_row_python
    three = ClipKind(Clips(frames=5, clips_per_video=3))
    extras = three.extras(np.array([4, 4, 4, 9]), np.array([6, 7, 8, 9]))
    assert extras["video"].dtype == np.int64 and extras["video"].tolist() == [4, 4, 4, 9]
    assert extras["clip"].tolist() == [0, 1, 2, 0] and three.per_item == 3


def test_kinds_cross_to_a_worker_process_with_the_spec() -> None:
    for kind in (IMAGES, ClipKind(Clips(frames=3, fps=2.5, clips_per_video=2))):
        spec = pickle.loads(pickle.dumps(_spec(kind)))
        assert spec.kind == kind and spec.frames == kind.frames
    assert isinstance(pickle.loads(pickle.dumps(IMAGES)), ImageKind)


def test_rows_fold_into_images_and_back_as_views() -> None:
    images = torch.arange(2 * 4 * 5 * 3, dtype=torch.uint8).reshape(2, 4, 5, 3)
    flat, lead = fold_rows(images)
    assert flat is images and lead == (2,)
    out = images.permute(0, 3, 1, 2)
    assert unfold_rows(out, lead).stride() == out.stride()
    clips = torch.arange(2 * 3 * 4 * 5 * 3, dtype=torch.uint8).reshape(2, 3, 4, 5, 3)
    flat, lead = fold_rows(clips)
    assert flat.shape == (6, 4, 5, 3) and lead == (2, 3) and flat.data_ptr() == clips.data_ptr()
    back = unfold_rows(flat.permute(0, 3, 1, 2), lead)
    assert back.shape == (2, 3, 3, 4, 5) and torch.equal(back, clips.permute(0, 1, 4, 2, 3))


def test_batch_ops_see_every_frame_of_a_clip_as_an_image() -> None:
    spec = RenderSpec(2, (4, 5), Pipeline([Normalize([0.5, 0.4, 0.3], [0.2, 0.25, 0.3])]), 0, "raise", (),
                      np.zeros(2, np.int64), None, None, kind=ClipKind(Clips(frames=3)))
    clips = torch.randint(0, 256, (2, 3, 4, 5, 3), dtype=torch.uint8)
    got, _ = run_batch_ops(spec, clips, torch.zeros(2, dtype=torch.int64), 0, 0)
    frames, _ = run_batch_ops(spec, clips.flatten(0, 1), torch.zeros(6, dtype=torch.int64), 0, 0)
    assert got.shape == (2, 3, 3, 4, 5) and torch.equal(got, frames.unflatten(0, (2, 3)))


def test_a_third_kind_goes_through_the_filler_and_the_handout_unchanged() -> None:
    ds = Memory()
    filler = Filler(_spec(Mirrored()), ds, 0, np.arange(len(ds)), 0)
    route = decide(filler.spec, ds, decode="auto", gpu_share=None, processes=0, stage="none", decoder=lambda: None)
    assert route.cpu == "python" and route.gpu == "none"   # the kind says its rows need Python, and the CPU
    assert Mirrored.per_row_python in route.python and any(Mirrored.cpu_only in r for r in route.reasons)
    slot, _ = _render(filler, 4)
    plain, _ = _render(Filler(_spec(IMAGES), ds, 0, np.arange(len(ds)), 0), 4)
    rows = slot.images_np[:4]
    assert rows.shape == (4, 2, 20, 20, 3)
    assert np.array_equal(rows[:, 0], plain.images_np[:4]) and np.array_equal(rows[:, 1], rows[:, 0, :, ::-1])
    assert slot.extras["position"].tolist() == [0, 1, 2, 3] and slot.extras["source"].tolist() == [0, 1, 2, 3]
    assert "position" not in plain.extras
    images, labels, extras = host_batch(slot, filler.spec, 0, 0)
    assert images.shape == (4, 2, 3, 20, 20) and torch.equal(images[:, 1], images[:, 0].flip(-1))
    assert labels.tolist() == [0, 10, 20, 30] and extras["position"].tolist() == [0, 1, 2, 3]


def test_a_failed_row_of_a_kind_gets_the_stand_ins_extras() -> None:
    ds = Memory(broken=frozenset({1}))
    filler = Filler(_spec(Mirrored(), on_error="skip"), ds, 0, np.arange(len(ds)), 0)
    slot, times = _render(filler, 4)
    assert times.skipped == 1
    stand_in = int(slot.labels_np[1]) // 10   # labels are 10 x the dataset indices here
    assert stand_in != 1 and slot.extras["source"].tolist() == [0, stand_in, 2, 3]   # the stand-in's own
    assert slot.extras["position"].tolist() == [0, 1, 2, 3]
    again, _ = _render(Filler(_spec(IMAGES), Memory(), 0, np.array([stand_in] * len(ds)), 0), 1)
    assert np.array_equal(slot.images_np[1, 0], again.images_np[0])



def test_the_plan_resolves_the_kind_once_and_the_loader_asks_it(tmp_path: Path) -> None:
    pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")
    import stoker
    from stoker.device.stage import DeviceOptions
    from stoker.packing import pack
    from stoker.tools.synth_video import VideoStyle, make_kinetics_like
    from stoker.transforms import Resize

    make_kinetics_like(tmp_path / "src", 1, classes=2, style=VideoStyle(seconds=1, fps=8, size=(24, 32)))
    pack(tmp_path / "src", tmp_path / "ds", progress=False)
    clips = Clips(frames=2, clips_per_video=2)
    with stoker.Loader(tmp_path / "ds", 2, sampling=stoker.Sampling(clips=clips), transforms=[Resize((16, 16))],
                       device=DeviceOptions("cpu", decode="auto")) as ld:
        assert ld.plan.kind == ClipKind(clips) and ld.plan.epochs.per_item == 2 and ld.clips == clips
        assert ld.route.gpu == "none" and ClipKind.cpu_only in ld.stats.gpu_split   # the kind says why
        x, _, extras = next(iter(ld))
        assert x.shape == (2, 2, 3, 16, 16) and extras["clip"].tolist() == [0, 1]
        assert ClipKind.per_row_python in ld.stats.per_sample_python
        assert ld.state_dict()["clips"] == repr(clips)
