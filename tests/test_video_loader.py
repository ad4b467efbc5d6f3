"""The Loader on a video pack: clips as samples (`clips=stoker.Clips(...)`), batches uint8
[B, T, 3, H, W]. Every clip is checked against `stoker.loading.clips.read_clip` (itself checked against PyAV's
full decode in test_video.py), so these tests are about the Loader's guarantees: one plan per clip,
determinism for any thread count, resume, ranks, skipping damaged videos, storage paths, device stage."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")

import stoker  # noqa: E402
from stoker.loading.clips import Clips, read_clip  # noqa: E402
from stoker.errors import ConfigError, SampleError  # noqa: E402
from stoker.packing import pack  # noqa: E402
from stoker.tools.synth_video import VideoStyle, make_kinetics_like  # noqa: E402
from stoker.transforms import ColorJitter, Pipeline, RandomHorizontalFlip, RandomResizedCrop, Resize  # noqa: E402

STYLE = VideoStyle(seconds=2, fps=10, size=(40, 48), keyframe_seconds=1)
CROP = [RandomResizedCrop(24, scale=(0.3, 1.0)), RandomHorizontalFlip(), ColorJitter(0.4, 0.4, 0.4, 0.1)]


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 videos of 3 classes, 20 frames each, packed."""
    root = tmp_path_factory.mktemp("v")
    make_kinetics_like(root / "src", 2, classes=3, style=STYLE)
    pack(root / "src", root / "ds", progress=False)
    return root / "ds"


def _clips(loader: stoker.Loader) -> list[tuple]:
    """Every batch of one pass as (images copy, labels, extras or None)."""
    return [(b[0].clone(), b[1].clone(), b[2] if len(b) > 2 else None) for b in loader]


def test_batches_are_clips_matching_read_clip(videos: Path) -> None:
    spec = Clips(frames=4, stride=2, sampling="random")
    with stoker.Loader(videos, 4, sampling=stoker.Sampling(clips=spec),
                       transforms=CROP, seed=3, workers=stoker.Workers(num_threads=2)) as ld:
        assert len(ld) == 2
        batches = _clips(ld)
        order = ld.epoch_indices(0)
    images = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    assert images.shape == (6, 4, 3, 24, 24) and images.dtype == torch.uint8
    assert batches[0][0].shape == (4, 4, 3, 24, 24) and batches[0][2] is None   # one clip per video: no extras
    with stoker.open_dataset(videos) as ds:
        assert labels.tolist() == [int(ds.labels[i]) for i in order]
        for row, i in enumerate(order.tolist()):
            want, _ = read_clip(ds, i, spec, Pipeline(CROP), seed=3, epoch=0)
            np.testing.assert_array_equal(images[row].permute(0, 2, 3, 1).numpy(), want)


def test_each_frame_is_channels_last_view_of_the_slot(videos: Path) -> None:
    with stoker.Loader(videos, 3, sampling=stoker.Sampling(clips=Clips(frames=2)), transforms=[Resize((16, 20))]) as ld:
        images, _ = next(iter(ld))
        assert images.shape == (3, 2, 3, 16, 20)
        assert images[0].is_contiguous(memory_format=torch.channels_last)   # a clip: T channels_last frames
        assert images.stride()[2] == 1   # channels innermost: a view of [B, T, H, W, 3] rows


def test_one_plan_per_clip_and_clips_differ(videos: Path) -> None:
    """A still video shows it: every frame of a clip gets the same crop, flip and colour, so frames of
    one clip equal each other exactly where the source frames do; two clips of it differ."""
    still = videos.parent / "still"
    frame = np.random.default_rng(0).integers(0, 255, (40, 48, 3), np.uint8)
    buf = __import__("io").BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        s = out.add_stream("libx264", rate=10, options={"crf": "0", "preset": "ultrafast"})
        s.width, s.height, s.pix_fmt = 48, 40, "yuv444p"
        for _ in range(12):
            out.mux(s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(s.encode())
    (still / "src" / "a").mkdir(parents=True, exist_ok=True)
    (still / "src" / "a" / "v.mp4").write_bytes(buf.getvalue())
    pack(still / "src", still / "ds", progress=False)
    with stoker.Loader(still / "ds", 4, sampling=stoker.Sampling(clips=Clips(frames=5, stride=2, clips_per_video=4)),
                       transforms=CROP,
                       seed=1) as ld:
        images, labels, extras = next(iter(ld))
    assert extras["video"].tolist() == [0, 0, 0, 0] and extras["clip"].tolist() == [0, 1, 2, 3]
    for clip in images:
        for t in range(1, 5):
            assert torch.equal(clip[t], clip[0])
    assert len({bytes(c[0].numpy()) for c in images}) == 4


def test_same_batches_for_one_and_two_threads(videos: Path) -> None:
    def run(threads: int) -> list[tuple]:
        with stoker.Loader(videos, 4, sampling=stoker.Sampling(clips=Clips(frames=3, clips_per_video=2)),
                           transforms=CROP, seed=7,
                           workers=stoker.Workers(num_threads=threads)) as ld:
            return _clips(ld)
    one, two = run(1), run(2)
    assert len(one) == 3   # 6 videos x 2 clips
    for a, b in zip(one, two):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert a[2]["video"].tolist() == b[2]["video"].tolist() and a[2]["clip"].tolist() == b[2]["clip"].tolist()
    videos_seen = torch.cat([b[2]["video"] for b in one]).tolist()
    clips_seen = torch.cat([b[2]["clip"] for b in one]).tolist()
    assert sorted(zip(videos_seen, clips_seen)) == [(v, c) for v in range(6) for c in range(2)]


def test_resume_mid_epoch_gives_the_rest_identically(videos: Path) -> None:
    spec = Clips(frames=3, clips_per_video=2, sampling="uniform")
    with stoker.Loader(videos, 3, sampling=stoker.Sampling(clips=spec), transforms=CROP, seed=5) as ld:
        ld.set_epoch(1)
        full = _clips(ld)
        ld.set_epoch(1)
        it = iter(ld)
        next(it)
        next(it)
        state = ld.state_dict()
        it.close()
    assert state["sample"] == 6
    with stoker.Loader(videos, 3, sampling=stoker.Sampling(clips=spec), transforms=CROP, seed=5) as again:
        again.load_state_dict(state)
        rest = _clips(again)
    assert len(rest) == len(full) - 2
    for a, b in zip(full[2:], rest):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2]["clip"], b[2]["clip"])
    with stoker.Loader(videos, 3, sampling=stoker.Sampling(clips=Clips(frames=3, clips_per_video=3)),
                       transforms=CROP, seed=5) as other:
        with pytest.raises(ConfigError, match="clips"):
            other.load_state_dict(state)


def test_ranks_split_videos_without_overlap(videos: Path) -> None:
    seen = []
    for rank in range(2):
        with stoker.Loader(videos, 2, transforms=[Resize((16, 16))],
                           sampling=stoker.Sampling(clips=Clips(frames=2, clips_per_video=2), rank=rank,
                                                    world_size=2)) as ld:
            batches = _clips(ld)
            assert len(ld) == len(batches) == 3
            seen.append(torch.cat([b[2]["video"] for b in batches]).tolist())
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(list(range(6)) * 2)


def test_a_damaged_video_is_replaced_under_skip(videos: Path, tmp_path: Path) -> None:
    """A video whose stored bytes went bad after packing (its MP4 index overwritten) fails with its key,
    or is replaced by another video's clip under on_error="skip"."""
    shutil.copytree(videos, tmp_path / "ds")
    with stoker.open_dataset(tmp_path / "ds") as ds:
        broken = 4
        key, data = ds.sample(broken).key, bytes(ds.sample(broken).data)
        shard = ds.location(broken)[0]
    path = tmp_path / "ds" / shard
    raw = bytearray(path.read_bytes())
    at = raw.find(data)
    assert at > 0
    end = at + len(data)
    raw[end - len(data) // 3:end] = bytes(len(data) // 3)   # the moov atom at the end of a plain MP4
    path.write_bytes(bytes(raw))
    spec = Clips(frames=4, stride=4)
    with stoker.Loader(tmp_path / "ds", 6, sampling=stoker.Sampling(clips=spec), transforms=[Resize((16, 16))]) as ld:
        with pytest.raises(SampleError, match=key):
            _clips(ld)
    with stoker.Loader(tmp_path / "ds", 6, sampling=stoker.Sampling(clips=spec), transforms=[Resize((16, 16))],
                       workers=stoker.Workers(on_error="skip")) as ld:
        (images, labels), = [b[:2] for b in _clips(ld)]
        order = ld.epoch_indices(0).tolist()
        assert ld.stats.skipped == 1
    with stoker.Loader(videos, 6, sampling=stoker.Sampling(clips=spec), transforms=[Resize((16, 16))]) as good:
        (want, want_labels), = [b[:2] for b in _clips(good)]
    row = order.index(broken)
    keep = [r for r in range(6) if r != row]
    assert torch.equal(images[keep], want[keep])   # the other clips as from the intact pack
    assert not torch.equal(images[row], want[row]) and images[row].shape == (4, 3, 16, 16)


def test_clips_option_is_checked(videos: Path, tmp_path: Path) -> None:
    from stoker.tools.synth import make_tiny_jpegs

    images = make_tiny_jpegs(tmp_path / "img", 4)
    with pytest.raises(ConfigError, match=r"holds images, not videos; Sampling\(clips=\) applies to a video pack"):
        stoker.Loader(images, 2, sampling=stoker.Sampling(clips=Clips()), transforms=[Resize((16, 16))])
    with pytest.raises(ConfigError, match="clips= takes a stoker.Clips"):
        stoker.Loader(videos, 2, sampling=stoker.Sampling(clips={"frames": 4}))
    with pytest.raises(ConfigError, match=r"spelled sampling=stoker.Sampling\(clips=...\)"):
        stoker.Loader(videos, 2, clips=Clips())   # the Loader keeps its 12 parameters: clips are sampling
    with pytest.raises(ConfigError, match="pad=True cannot apply to clips"):
        stoker.Loader(videos, 2, transforms=[Resize(16)], targets=stoker.Targets(pad=True))
    with pytest.raises(ConfigError, match="RandomErasing .batch ops. cannot apply to clips"):
        stoker.Loader(videos, 2, transforms=[Resize((16, 16)), stoker.Normalize(), stoker.RandomErasing()])
    with stoker.Loader(videos, 2, transforms=[Resize((16, 16))]) as ld:   # no clips=: Clips()'s defaults
        assert ld.clips == Clips() and next(iter(ld))[0].shape == (2, 16, 3, 16, 16)


def test_normalize_gives_float_clips(videos: Path) -> None:
    spec = Clips(frames=3)
    with stoker.Loader(videos, 2, sampling=stoker.Sampling(clips=spec), transforms=[Resize((16, 16))], seed=2) as plain:
        x, _ = next(iter(plain))
        x = x.clone()
    want = (x.float() / 255 - torch.tensor(stoker.device.stage.IMAGENET_MEAN).view(3, 1, 1)) \
        / torch.tensor(stoker.device.stage.IMAGENET_STD).view(3, 1, 1)
    with stoker.Loader(videos, 2, sampling=stoker.Sampling(clips=spec),
                       transforms=[Resize((16, 16)), stoker.Normalize()], seed=2) as ld:
        y, _ = next(iter(ld))
    assert y.shape == (2, 3, 3, 16, 16) and y.dtype == torch.float32
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    with stoker.Loader(videos, 2, sampling=stoker.Sampling(clips=spec), transforms=[Resize((16, 16))], seed=2,
                       device=stoker.DeviceOptions("cpu", normalize="imagenet")) as ld:
        z, _ = next(iter(ld))
    assert z.shape == (2, 3, 3, 16, 16)
    torch.testing.assert_close(z, want, atol=1e-5, rtol=1e-5)


def test_numpy_output_gives_numpy_clips(videos: Path) -> None:
    with stoker.Loader(videos, 2, sampling=stoker.Sampling(clips=Clips(frames=3)),
                       transforms=[Resize((16, 16))], seed=2) as ld:
        x, _ = next(iter(ld))
        x = x.clone()
    with stoker.Loader(videos, 2, sampling=stoker.Sampling(clips=Clips(frames=3)),
                       transforms=[Resize((16, 16))], seed=2,
                       device="numpy") as ld:
        y, labels = next(iter(ld))
    assert isinstance(y, np.ndarray) and y.shape == (2, 3, 3, 16, 16)
    np.testing.assert_array_equal(y, x.numpy())


def test_video_pack_from_s3_and_staged_equals_local(videos: Path, tmp_path: Path) -> None:
    """The Storage paths load a video pack like an image pack: from a bucket through moto's S3 server
    (shards through the local cache) and staged to a memory-backed copy; the clips equal the local ones."""
    pytest.importorskip("s3fs", reason="needs the remote extra: pip install 'stoker[remote]'")
    pytest.importorskip("moto", reason="needs moto[server]: pip install -e '.[test-remote]'")
    from s3_helpers import S3Server, upload_pack

    pack(videos.parent / "src", tmp_path / "ds", progress=False, options=stoker.PackOptions(shard_size=20_000))
    assert len(list((tmp_path / "ds").glob("shard-*.arrow"))) > 1

    def load(path: str | Path, storage: stoker.Storage | None = None) -> list[tuple]:
        with stoker.Loader(path, 4, sampling=stoker.Sampling(clips=Clips(frames=3, clips_per_video=2)),
                           transforms=CROP, seed=9,
                           storage=storage, workers=2) as ld:
            return _clips(ld)

    local = load(tmp_path / "ds")
    staged = load(tmp_path / "ds", stoker.Storage(stage=tmp_path / "shm"))
    server = S3Server()
    try:
        url = upload_pack(server, tmp_path / "ds", "videos")
        remote = load(url, stoker.Storage(cache_dir=tmp_path / "cache", storage_options=server.storage_options()))
        assert server.log.gets(".arrow")
    finally:
        server.stop()
    for other in (staged, remote):
        assert len(other) == len(local) == 3
        for a, b in zip(local, other):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2]["video"], b[2]["video"])


def test_persistent_threads_and_drop_last_give_the_same_epochs(videos: Path) -> None:
    """A persistent Loader runs on into the next epoch with that epoch's clips; drop_last counts clips."""
    def epochs(**kw: object) -> list[list[tuple]]:
        with stoker.Loader(videos, 4, sampling=stoker.Sampling(clips=Clips(frames=2, clips_per_video=3)),
                           transforms=CROP, seed=2,
                           drop_last=True, **kw) as ld:
            assert len(ld) == 4   # 6 videos x 3 clips = 18 samples: 4 whole batches
            return [_clips(ld) for _ in range(2)]
    plain, persistent = epochs(), epochs(workers=stoker.Workers(persistent=True))
    assert [len(e) for e in plain] == [4, 4]
    assert not torch.equal(plain[0][0][0], plain[1][0][0])   # a new epoch draws new clips
    for a_epoch, b_epoch in zip(plain, persistent):
        for a, b in zip(a_epoch, b_epoch):
            assert torch.equal(a[0], b[0]) and torch.equal(a[2]["clip"], b[2]["clip"])


def test_weighted_draws_of_one_video_get_different_clips(videos: Path) -> None:
    weights = np.array([1.0, 0, 0, 0, 0, 0])   # every draw is video 0
    with stoker.Loader(videos, 6, transforms=CROP, seed=1,
                       sampling=stoker.Sampling(clips=Clips(frames=3), weights=weights)) as ld:
        (images, labels), = [b[:2] for b in _clips(ld)]
        assert ld.epoch_indices(0).tolist() == [0] * 6
    assert len({bytes(c.numpy()) for c in images}) == 6
