"""The Loader's option values: frozen, self-validating, printable, each usable alone; the Loader
takes at most 12 parameters, and its 0.1 keywords name their new spelling."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import stoker
from stoker.errors import ConfigError
from stoker.loader import Loader
from stoker.loader.options import Sampling, Storage, Targets, Workers


def test_the_loader_takes_at_most_12_parameters() -> None:
    params = [p for p in inspect.signature(Loader.__init__).parameters if p != "self"]
    assert len(params) <= 12, params


@pytest.mark.parametrize("value, shown", [
    (Sampling(order="sequential", indices=range(1000), drop_last=True),
     "Sampling(order='sequential', indices=<1000 int64>, drop_last=True)"),
    (Storage(stage="/dev/shm"), "Storage(stage='/dev/shm')"),
    (Targets(boxes="boxes", pad=True), "Targets(boxes=('boxes',), pad=True)"),
    (Workers(num_threads=4, prefetch=3), "Workers(num_threads=4, prefetch=3)"),
    (Workers(), "Workers()"),
])
def test_options_print_what_they_hold_and_are_frozen(value: object, shown: str) -> None:
    assert repr(value) == shown
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.seed = 1  # type: ignore[attr-defined]


def test_indices_are_a_private_read_only_copy() -> None:
    ids = np.array([3, 1, 2])
    s = Sampling(indices=ids)
    ids[0] = 99
    assert s.indices.tolist() == [3, 1, 2] and not s.indices.flags.writeable


@pytest.mark.parametrize("make, match", [
    (lambda: Sampling(order="shuffled"), "order must be one of"),
    (lambda: Sampling(seed=1.5), "seed must be an int"),
    (lambda: Sampling(indices=[1.5]), "indices must be ints"),
    (lambda: Sampling(rank=-1), "rank must be an int >= 0"),
    (lambda: Storage(storage_options="anon"), "storage_options must be a dict"),
    (lambda: Targets(ignore_index=-1), "ignore_index must be an int in 0..2"),
    (lambda: Targets(multi_label="hot"), "multi_label='hot'"),
    (lambda: Targets(classes="cat"), "distinct class names"),
    (lambda: Workers(prefetch=0), "prefetch must be an int >= 1"),
    (lambda: Workers(on_error="ignore"), "on_error must be 'raise' or 'skip'"),
    (lambda: Workers(timeout=0), "timeout must be positive seconds"),
    (lambda: Workers(decode_quality="best"), "decode_quality must be one of"),
])
def test_a_bad_value_fails_where_it_is_made(make, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


@pytest.mark.parametrize("old, new", [
    ("num_threads", "workers=stoker.Workers(num_threads=...) (or workers=N)"),
    ("prefetch", "workers=stoker.Workers(prefetch=...)"),
    ("rank", "sampling=stoker.Sampling(rank=...)"),
    ("indices", "sampling=stoker.Sampling(indices=...)"),
    ("cache_dir", "storage=stoker.Storage(cache_dir=...)"),
    ("stage", "storage=stoker.Storage(stage=...)"),
    ("boxes", "targets=stoker.Targets(boxes=...)"),
    ("classes", "targets=stoker.Targets(classes=...)"),
])
def test_the_01_keywords_name_their_new_spelling(tmp_path, old: str, new: str) -> None:
    with pytest.raises(ConfigError) as info:
        Loader(tmp_path, 4, **{old: 1})
    assert new in str(info.value)


def test_the_options_are_exported_and_a_field_set_twice_is_refused(tmp_path) -> None:
    assert stoker.Sampling is Sampling and stoker.Workers is Workers
    assert stoker.Storage is Storage and stoker.Targets is Targets
    with pytest.raises(ConfigError, match="drop_last is set twice"):
        Loader(tmp_path, 4, sampling=Sampling(drop_last=True), drop_last=False)
    with pytest.raises(ConfigError, match="workers must be a stoker.Workers or an int"):
        Loader(tmp_path, 4, workers="many")
    with pytest.raises(ConfigError, match="sampling= takes a stoker.Sampling"):
        Loader(tmp_path, 4, sampling=Workers())
