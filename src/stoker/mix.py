"""`stoker.Mix`: several packed datasets read as one, each epoch in set proportions.

    loader = stoker.Loader(stoker.Mix({"web": "packs/web", "curated": "packs/curated"},
                                      weights={"web": 3, "curated": 1}), 256, columns=["source"])

- The sources are opened as the Loader opens one (local, staged with `Storage(stage=)`, or a URL
  cached through `Storage(cache_dir=)`, each source in a folder of its own) and concatenated into a
  `MixedDataset`: the label space is the union of their class names (the same name, the same label;
  classes numbered in order of first appearance, source by source), the extra columns are those every
  source has, plus `source`, the name of the source each sample came from.
- An epoch is `epoch_size` draws (default: the sources' total) apportioned to the sources by weight
  (largest remainders: exact when the weights divide the epoch, within one sample otherwise). Without
  replacement a source's draws walk a fresh permutation of it (a source asked for more than it holds
  goes round again, each sample once per round); with replacement they are uniform picks. The draws
  of all sources are then shuffled together, so every part of the epoch, and every rank's slice of
  it, holds about the set proportions.
- All of it is a pure function of `(seed, epoch)` (`order.py`'s hash), so a mix is deterministic
  for any thread count, resumable mid-epoch (`state_dict`, elastic included) and split across ranks
  like any weighted pool: a Mix is a `Pool` whose draws come from `MixPlan.draw`.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import ConfigError
from .order import Pool, sample_keys, uniforms
from .dataset import JPEG_ROW, OTHER_ROW, Dataset, Opened, Sample

__all__ = ["Mix", "MixPlan", "MixedDataset", "SOURCE_COLUMN", "apportion"]

#: the extra column naming each sample's source (`columns=["source"]`)
SOURCE_COLUMN = "source"
_TAG_MIX = 0x4D4958   # the draws of a source (per round) and the shuffle of the whole epoch
_TAG_MIX_ORDER = 0x4D4959


@dataclass(frozen=True)
class Mix:
    """Several packed datasets as one Loader source, read in set proportions.

    sources: {name: packed dataset folder or URL}, in the order classes are first numbered.
    weights: {name: weight > 0} (the share of each epoch); None: in proportion to their sizes.
    replacement: False: each source's draws walk a permutation of it (repeats only once a source is
        asked for more than it holds); True: uniform draws with replacement.
    epoch_size: samples per epoch (None: the sources' total).
    """

    sources: Mapping[str, str | Path]
    weights: Mapping[str, float] | None = None
    replacement: bool = False
    epoch_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sources, Mapping) or not self.sources:
            raise ConfigError(f"Mix(sources=) takes {{name: packed dataset path or URL}}, got {self.sources!r:.100}")
        for name, where in self.sources.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigError(f"Mix: source names are non-empty text without '/', got {name!r}")
            if not isinstance(where, (str, Path)):
                raise ConfigError(f"Mix: source {name!r} must be a packed dataset path or URL, got {where!r:.80}")
        object.__setattr__(self, "sources", dict(self.sources))
        if self.weights is not None:
            if not isinstance(self.weights, Mapping) or set(self.weights) != set(self.sources):
                raise ConfigError(f"Mix(weights=) needs one weight per source {sorted(self.sources)}, got "
                                  f"{self.weights!r:.100}")
            for name, w in self.weights.items():   # NumPy numbers too (np.float32(1.0), np.int64(3))
                if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Real) or not np.isfinite(float(w)) \
                        or float(w) <= 0:
                    raise ConfigError(f"Mix: weight of {name!r} must be a positive finite number, got {w!r}")
            object.__setattr__(self, "weights", {name: float(self.weights[name]) for name in self.sources})
        if not isinstance(self.replacement, bool):
            raise ConfigError(f"Mix(replacement=) is True or False, got {self.replacement!r}")
        if self.epoch_size is not None and (isinstance(self.epoch_size, (bool, np.bool_))
                                            or not isinstance(self.epoch_size, numbers.Integral) or self.epoch_size < 1):
            raise ConfigError(f"Mix(epoch_size=) is a positive number of samples or None, got {self.epoch_size!r}")
        if self.epoch_size is not None:
            object.__setattr__(self, "epoch_size", int(self.epoch_size))


def apportion(total: int, weights: Sequence[float]) -> np.ndarray:
    """int64 counts summing to `total`, proportional to `weights` (largest remainders; ties to the first)."""
    w = np.asarray(weights, dtype=np.float64)
    if not np.isfinite(w.sum() * max(total, 1)):   # weights near the float limit: as shares of the largest
        w = w / w.max()
    quota = total * w / w.sum()
    counts = np.floor(quota + 1e-9).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        counts[np.argsort(-(quota - counts), kind="stable")[:short]] += 1
    return counts


@dataclass(frozen=True)
class MixPlan:
    """What an epoch of a mix draws: `counts[s]` samples of source `s` (rows `offsets[s]` ..
    `offsets[s] + sizes[s]` of the MixedDataset), with or without replacement, shuffled together."""

    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    replacement: bool
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(int(o) for o in np.cumsum([0, *self.sizes])[:-1]))

    def draw(self, seed: int, epoch: int) -> np.ndarray:
        """int64 [sum(counts)]: the dataset indices of epoch `epoch`, a pure function of (seed, epoch)."""
        parts = []
        for s, (n, count, offset) in enumerate(zip(self.sizes, self.counts, self.offsets)):
            if self.replacement:
                u = uniforms(sample_keys(seed, epoch, np.arange(count), tag=_tag(s, -1)), 1)[:, 0]
                picks = np.minimum((u * n).astype(np.int64), n - 1)
            else:   # round r walks its own permutation of the source
                rounds = [np.argsort(sample_keys(seed, epoch, np.arange(n), tag=_tag(s, r)), kind="stable")
                          for r in range(-(-count // n))]
                picks = np.concatenate(rounds)[:count] if rounds else np.zeros(0, np.int64)
            parts.append(picks.astype(np.int64) + offset)
        drawn = np.concatenate(parts)
        return drawn[np.argsort(sample_keys(seed, epoch, np.arange(len(drawn)), tag=_TAG_MIX_ORDER), kind="stable")]

    def pool(self, fingerprint: str) -> Pool:
        return Pool(int(sum(self.counts)), plan=self, fingerprint=fingerprint)


def _tag(source: int, round_: int) -> int:
    """The stream tag of a source's draws in one round (-1: draws with replacement)."""
    return (_TAG_MIX << 40) ^ (source << 20) ^ (round_ + 1)


class MixedDataset(Dataset):
    """The sources of a `Mix`, concatenated: rows `offsets[s] ..` are source `s`'s, labels in the union
    of class names, the extra column `source` naming each row's source. Reads go to the source's
    own dataset (zero-copy, its native spans)."""

    def __init__(self, mix: Mix, opened: list[Opened]) -> None:
        self.mix, self._opened = mix, opened
        self.names = list(mix.sources)
        self.parts = [o.dataset for o in opened]
        sizes = [len(d) for d in self.parts]
        self.offsets = np.cumsum([0, *sizes]).astype(np.int64)
        self.path = Path(f"Mix({', '.join(self.names)})")
        self.classes, self._labels = _union_labels(self.names, self.parts)
        columns = [c for c in self.parts[0].extra_columns if all(c in d.extra_columns for d in self.parts[1:])]
        if SOURCE_COLUMN in columns:
            raise ConfigError(f"{self.path}: the sources have a column named {SOURCE_COLUMN!r}, which a Mix adds "
                              "itself (each sample's source); rename that column when packing")
        self.extra_columns = [*columns, SOURCE_COLUMN]
        types = self.parts[0].column_types
        self._column_types = {c: types[c] for c in columns if c in types}
        weights = mix.weights or {name: float(n) for name, n in zip(self.names, sizes)}
        size = mix.epoch_size or int(sum(sizes))
        self.draws = MixPlan(tuple(sizes), tuple(int(c) for c in apportion(size, [weights[n] for n in self.names])),
                            mix.replacement)
        described = json.dumps([self.names, sizes, [weights[n] for n in self.names], mix.replacement, size])
        self.fingerprint = "mix-" + hashlib.sha256(described.encode()).hexdigest()[:16]

    def pool(self) -> Pool:
        """The epochs a Loader reads: the mix's draws (`MixPlan.draw`)."""
        return self.draws.pool(self.fingerprint)

    @property
    def process_path(self) -> str | None:
        """What `Workers(processes=1)` reopens in its worker process (`open_in_process`): the sources'
        local folders (as staged) and the mix; None when one is not a local packed dataset."""
        from .reader import PackedDataset

        if not all(isinstance(d, PackedDataset) for d in self.parts):   # the process mode's own rule
            return None
        mix = {"sources": {n: str(d.path) for n, d in zip(self.names, self.parts)}, "weights": self.mix.weights,
               "replacement": self.mix.replacement, "epoch_size": self.mix.epoch_size}
        return _PROCESS_PREFIX + json.dumps(mix)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def column_types(self) -> dict[str, str]:
        """The stored types of the extra columns every source has (the first source's)."""
        return dict(self._column_types)

    @property
    def plans_downloads(self) -> bool:
        """Whether a source is in object storage: its cache is then given each epoch's order (`plan`)."""
        return any(d.plans_downloads for d in self.parts)

    def plan(self, indices: np.ndarray, lookahead: int, order: str | None = None) -> None:
        """Each cached source's share of the order, in order (what its cache downloads ahead and evicts)."""
        idx = np.asarray(indices, dtype=np.int64)
        src = self.source_of(idx)
        for s, d in enumerate(self.parts):
            if d.plans_downloads:
                d.plan(idx[src == s] - self.offsets[s], lookahead=lookahead, order=order)

    def __repr__(self) -> str:
        return f"<stoker MixedDataset {', '.join(f'{n}: {len(d)}' for n, d in zip(self.names, self.parts))}>"

    def _where(self, i: int) -> tuple[int, int]:
        i = self._check_index(int(i))
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return s, i - int(self.offsets[s])

    def source_of(self, indices: Any) -> np.ndarray:
        """int64: the source number (into `names`) of each dataset index."""
        return np.searchsorted(self.offsets, np.asarray(indices), side="right").astype(np.int64) - 1

    def sample(self, i: int) -> Sample:
        s, j = self._where(i)
        got = self.parts[s].sample(j)
        return got._replace(index=int(i), label=self._labels[int(i)].item() if self._labels.dtype != object
                            else self._labels[int(i)], shard=f"{self.names[s]}/{got.shard}")

    def jpeg_spans(self, indices: np.ndarray) -> tuple[Sequence[Any], np.ndarray]:
        blocks, spans, kinds = self.pixel_spans(indices)
        spans[kinds != JPEG_ROW, 0] = -1
        return blocks, spans

    def pixel_spans(self, indices: np.ndarray) -> tuple[Sequence[Any], np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        src = self.source_of(idx)
        blocks: list[Any] = []
        spans = np.full((len(idx), 3), -1, np.int64)
        kinds = np.full(len(idx), OTHER_ROW, np.uint8)
        for s in np.unique(src).tolist():
            rows = np.flatnonzero(src == s)
            got, part, kind = self.parts[s].pixel_spans(idx[rows] - self.offsets[s])
            part = np.array(part, dtype=np.int64)
            part[part[:, 0] >= 0, 0] += len(blocks)
            blocks.extend(got)
            spans[rows], kinds[rows] = part, kind
        return blocks, spans, kinds

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    @property
    def heights(self) -> np.ndarray | None:
        return _joined([d.heights for d in self.parts])

    @property
    def widths(self) -> np.ndarray | None:
        return _joined([d.widths for d in self.parts])

    def extra(self, i: int, name: str) -> Any:
        s, j = self._where(i)
        return self.names[s] if name == SOURCE_COLUMN else self.parts[s].extra(j, name)

    def location(self, i: int) -> tuple[str, int]:
        s, j = self._where(i)
        shard, row = self.parts[s].location(j)
        return f"{self.names[s]}/{shard}", row

    def close(self) -> None:
        for o in self._opened:
            o.close()


_PROCESS_PREFIX = "stoker-mix:"


def open_in_process(path: str) -> Dataset:
    """The dataset a worker process reads: a packed folder, or a mix (`MixedDataset.process_path`)."""
    from .reader import open_dataset

    if not path.startswith(_PROCESS_PREFIX):
        return open_dataset(path)
    mix = Mix(**json.loads(path[len(_PROCESS_PREFIX):]))
    return MixedDataset(mix, [Opened(open_dataset(where), owned=True) for where in mix.sources.values()])


def _joined(arrays: list[np.ndarray | None]) -> np.ndarray | None:
    if any(a is None for a in arrays):
        return None
    return np.concatenate([np.asarray(a) for a in arrays])


def _union_labels(names: list[str], parts: list[Dataset]) -> tuple[list[str] | None, np.ndarray]:
    """The union of the sources' class names (first appearance, source by source) and every row's label
    in it; sources without class names must all be so, with labels of one kind, which are kept."""
    named = [d.classes is not None for d in parts]
    if all(named):
        classes: list[str] = []
        index: dict[str, int] = {}
        labels = []
        for d in parts:
            for c in d.classes:
                if c not in index:
                    index[c] = len(classes)
                    classes.append(c)
            lut = np.array([index[c] for c in d.classes], dtype=np.int64)
            own = np.asarray(d.labels)
            if own.dtype.kind not in "iu":
                raise ConfigError(f"Mix: {d.path} has class names but {own.dtype} labels; a mix maps class labels")
            bad = (own < 0) | (own >= len(lut))
            labels.append(np.where(bad, own, lut[np.clip(own, 0, max(len(lut) - 1, 0))]) if len(lut) else own)
        return classes, np.concatenate(labels).astype(np.int64)
    if any(named):
        which = [n for n, has in zip(names, named) if not has]
        raise ConfigError(f"Mix: sources {which} have no class names while the others do; a mix joins labels by "
                          "class name: pack them with class names (an ImageFolder tree, a label map)")
    own = [np.asarray(d.labels) for d in parts]
    kinds = {a.dtype.kind for a in own}
    if len(kinds) > 1:
        raise ConfigError(f"Mix: the sources' labels are of different kinds ({', '.join(str(a.dtype) for a in own)}); "
                          "mix datasets whose labels mean the same thing")
    return None, np.concatenate(own)
