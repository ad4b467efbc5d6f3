"""How multi-label and soft targets reach the training loop: one batch of label lists -> one tensor.

Shards store a multi-label dataset's labels as a ``list<int64>`` column (one list of class
indices per sample, maybe empty). The Loader hands each batch over as

- ``"multi-hot"`` (the default): ``float32 [B, num_classes]``, 1.0 where a class is present, what
  ``BCEWithLogitsLoss`` and ``MultiLabelSoftMarginLoss`` take;
- ``"indices"``: ``int64 [B, K]``, each row's indices then ``-1`` padding, K the longest row in the
  batch (at least 1), for embedding bags or your own encoding;
- ``"list"``: the Python lists as stored.

``num_classes`` comes from the manifest's class names, else the largest index in the dataset + 1;
a ``num_classes=`` given to the Loader must cover every stored index.

Soft (float) targets are a ``list<float64>`` column: one row of C numbers per sample (a list line
``img.jpg 0.7 0.2 0.1``, a CSV cell ``[0.7, 0.2, 0.1]``; write a decimal point, since ``1 0 0`` reads as
class indices). They arrive as ``float32 [B, C]`` (``"list"``: the Python lists), ready for a
cross-entropy on probabilities or a Mixup; every row must have the same length, checked once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._torch import torch
from ..errors import ConfigError

__all__ = ["MULTI_LABEL_FORMATS", "MultiLabel", "multi_label_spec"]

MULTI_LABEL_FORMATS = ("multi-hot", "indices", "list")


@dataclass(frozen=True)
class MultiLabel:
    """Turns a batch of label lists into the chosen tensor (see the module docstring)."""

    format: str   # one of MULTI_LABEL_FORMATS, or "soft" for float rows
    num_classes: int

    def __call__(self, rows: Sequence[Sequence[Any]]) -> Any:
        out = self.arrays(rows)
        return torch.from_numpy(out) if isinstance(out, np.ndarray) else out

    def arrays(self, rows: Sequence[Sequence[Any]]) -> np.ndarray | list[list[Any]]:
        """The same as numpy arrays (`Loader(device="numpy")`); "list" stays lists."""
        if self.format == "list":
            return [list(r) for r in rows]
        if self.format == "soft":
            return np.array(rows, dtype=np.float32).reshape(len(rows), self.num_classes)
        lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
        flat = np.fromiter((v for r in rows for v in r), np.int64, int(lengths.sum()))
        row_of = np.repeat(np.arange(len(rows)), lengths)
        if self.format == "multi-hot":
            out = np.zeros((len(rows), self.num_classes), dtype=np.float32)
            out[row_of, flat] = 1.0
            return out
        width = max(1, int(lengths.max(initial=0)))
        out = np.full((len(rows), width), -1, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        out[row_of, np.arange(len(flat)) - np.repeat(starts, lengths)] = flat
        return out


def multi_label_spec(labels: np.ndarray, classes: list[str] | None, format: str,
                     num_classes: int | None) -> MultiLabel | None:
    """The encoder for a dataset's labels, or None when they are not lists of class indices.
    ``labels`` are all of the dataset's labels (checked once here, so batches need no checks)."""
    if format not in MULTI_LABEL_FORMATS:
        raise ConfigError(f"multi_label={format!r}: expected one of {', '.join(MULTI_LABEL_FORMATS)}")
    soft = _soft_spec(labels, format, num_classes)
    if soft is not None:
        return soft
    if labels.dtype != object or not len(labels) or not all(
            isinstance(row, (list, tuple)) and all(isinstance(v, (int, np.integer)) for v in row) for row in labels):
        return None
    largest = max((v for row in labels if row is not None for v in row), default=-1)
    smallest = min((v for row in labels if row is not None for v in row), default=0)
    if smallest < 0:
        raise ConfigError(f"a multi-label dataset holds the class index {smallest}; indices must be >= 0")
    known = len(classes) if classes else largest + 1
    if num_classes is None:
        num_classes = max(known, 1)
    elif not isinstance(num_classes, int) or num_classes <= largest:
        raise ConfigError(f"num_classes={num_classes!r} does not cover the largest stored class index "
                          f"{largest}; pass num_classes={largest + 1} or more, or leave it to the dataset")
    return MultiLabel(format, num_classes)


def _soft_spec(labels: np.ndarray, format: str, num_classes: int | None) -> MultiLabel | None:
    """The encoder for soft targets (rows of floats), or None when the labels are something else."""
    if labels.dtype != object or not len(labels) or not all(isinstance(row, (list, tuple)) for row in labels):
        return None
    if not any(isinstance(v, (float, np.floating)) for row in labels for v in row):
        return None
    width = len(labels[0])
    odd = next((i for i, row in enumerate(labels) if len(row) != width), None)
    if odd is not None:
        raise ConfigError(f"soft targets need the same number of values in every row: sample 0 has {width}, "
                          f"sample {odd} has {len(labels[odd])}; re-pack with one value per class in every row")
    if num_classes is not None and num_classes != width:
        raise ConfigError(f"num_classes={num_classes!r}, but the soft targets have {width} values a row; pass "
                          f"num_classes={width} or leave it to the dataset")
    return MultiLabel("list" if format == "list" else "soft", width)
