"""Multi-label targets: list<int64> label columns delivered as multi-hot rows or padded indices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from formats_helpers import photos

from stoker import Loader
from stoker.errors import ConfigError
from stoker.loading.labels import MultiLabel, multi_label_spec
from stoker.packing import PackOptions, pack
from stoker.transforms import Resize
from stoker.loader.options import Targets, Workers


def test_encodings() -> None:
    rows = [[1, 3], [], [0, 1, 2, 3]]
    hot = MultiLabel("multi-hot", 5)(rows)
    assert hot.dtype == torch.float32 and hot.tolist() == [[0, 1, 0, 1, 0], [0] * 5, [1, 1, 1, 1, 0]]
    idx = MultiLabel("indices", 5)(rows)
    assert idx.dtype == torch.int64 and idx.tolist() == [[1, 3, -1, -1], [-1, -1, -1, -1], [0, 1, 2, 3]]
    assert MultiLabel("indices", 5)([[], []]).tolist() == [[-1], [-1]]
    assert MultiLabel("list", 5)(rows) == rows


def test_spec_checks_classes_once() -> None:
    labels = np.array([[0, 4], [2]] + [None], dtype=object)[:-1]
    assert multi_label_spec(labels, None, "multi-hot", None) == MultiLabel("multi-hot", 5)
    assert multi_label_spec(labels, ["a"] * 7, "indices", None) == MultiLabel("indices", 7)
    assert multi_label_spec(np.arange(3), None, "multi-hot", None) is None   # single-label: untouched
    with pytest.raises(ConfigError, match="num_classes=3 does not cover the largest stored class index 4"):
        multi_label_spec(labels, None, "multi-hot", 3)
    with pytest.raises(ConfigError, match="multi_label='onehot'"):
        multi_label_spec(labels, None, "onehot", None)


def test_loader_delivers_multi_hot_from_a_packed_multi_label_list(tmp_path: Path) -> None:
    imgs = photos(6)
    lines = []
    for i, blob in enumerate(imgs):
        (tmp_path / f"{i}.jpg").write_bytes(blob)
        lines.append(f"{i}.jpg {' '.join(str(c) for c in range(i % 4))}".strip() if i % 4 else f"{i}.jpg 5")
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    expected = {i: ([5] if i % 4 == 0 else list(range(i % 4))) for i in range(6)}
    pack(tmp_path / "train.txt", tmp_path / "out", options=PackOptions(workers=1), progress=False)
    with Loader(tmp_path / "out", 3, transforms=[Resize((16, 16))], order="sequential", workers=1) as loader:
        batches = [labels for _, labels in loader]
    hot = torch.cat(batches)
    assert hot.shape == (6, 6) and hot.dtype == torch.float32
    assert [torch.nonzero(row).flatten().tolist() for row in hot] == [expected[i] for i in range(6)]
    with Loader(tmp_path / "out", 6, transforms=[Resize((16, 16))], order="sequential", 
                workers=1, targets=Targets(multi_label="indices", num_classes=10)) as loader:
        (_, idx), = list(loader)
    assert [[v for v in row if v >= 0] for row in idx.tolist()] == [expected[i] for i in range(6)]
    with Loader(tmp_path / "out", 6, transforms=[Resize((16, 16))], order="sequential", 
                device="cpu", workers=1) as loader:   # the device stage's path
        (_, hot_dev), = list(loader)
    assert torch.equal(hot_dev, hot)
    with Loader(tmp_path / "out", 3, transforms=[Resize((16, 16))], order="sequential", 
                device="cpu", workers=Workers(num_threads=1, persistent=True)) as loader:   # epochs in a row from one pipeline
        for _ in range(2):
            assert torch.equal(torch.cat([labels for _, labels in loader]), hot)


def test_soft_targets_arrive_as_float_rows_and_mix(tmp_path: Path) -> None:
    from stoker import Mixup

    imgs = photos(6)
    rows = [[round(0.1 * (i + 1), 1), round(1 - 0.1 * (i + 1), 1), 0.0] for i in range(6)]
    lines = []
    for i, blob in enumerate(imgs):
        (tmp_path / f"{i}.jpg").write_bytes(blob)
        lines.append(f"{i}.jpg " + " ".join(f"{v:.1f}" for v in rows[i]))
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    pack(tmp_path / "train.txt", tmp_path / "out", options=PackOptions(workers=1), progress=False)
    with Loader(tmp_path / "out", 3, transforms=[Resize((16, 16))], order="sequential", workers=1) as loader:
        soft = torch.cat([labels for _, labels in loader])
    assert soft.dtype == torch.float32 and torch.allclose(soft, torch.tensor(rows))
    mix = Mixup(mixup_alpha=1.0, label_smoothing=0.1, num_classes=3)
    for device in (None, "cpu"):   # the CPU batch and the device stage's path
        with Loader(tmp_path / "out", 6, transforms=[Resize((16, 16)), mix], order="sequential", 
                    device=device, workers=1) as loader:
            (_, mixed), = list(loader)
        assert mixed.shape == (6, 3) and torch.allclose(mixed.sum(1), torch.ones(6), atol=1e-5)
        smooth = soft * 0.9 + 0.1 / 3   # timm: the smoothed rows, mixed with the batch's mirror by one lam
        lam = (mixed[0, 0] - smooth[5, 0]) / (smooth[0, 0] - smooth[5, 0])
        assert 0 <= lam <= 1 and torch.allclose(mixed, lam * smooth + (1 - lam) * smooth.flip(0), atol=1e-5)
    with pytest.raises(ConfigError, match="num_classes=4, but the soft targets have 3"):
        Loader(tmp_path / "out", 3, transforms=[Resize((16, 16))], targets=Targets(num_classes=4))


def test_soft_rows_must_agree_in_length() -> None:
    labels = np.array([[0.5, 0.5], [0.2, 0.3, 0.5]] + [None], dtype=object)[:-1]
    with pytest.raises(ConfigError, match="sample 1 has 3"):
        multi_label_spec(labels, None, "multi-hot", None)
    good = np.array([[0.5, 0.5], [1.0, 0.0]] + [None], dtype=object)[:-1]
    assert multi_label_spec(good, None, "multi-hot", None) == MultiLabel("soft", 2)
    assert MultiLabel("soft", 2)([[0.5, 0.5], [1.0, 0.0]]).tolist() == [[0.5, 0.5], [1.0, 0.0]]
