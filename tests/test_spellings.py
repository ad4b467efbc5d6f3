"""Every message that names a fix names a spelling the API takes: each case below provokes a message,
finds the spelling it suggests (`name=stoker.Class(field=...)`, `name='value'`, `name=N`,
`stoker.open_loose(SRC, kind=...)`), fills in its placeholders and passes exactly that back,
which must then work. A message reworded to another spelling is checked the same way; one that
drops its spelling fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from torch.utils import data

import stoker
from conftest import make_image_folder
from stoker.errors import ArgumentNameError, StokerError
from stoker.loader import Loader
from stoker.transforms import Resize

SIZE = [Resize((16, 16))]
#: the values that stand for a placeholder (`field=...`, `N`) in a suggested spelling
VALUES = {"rank": 0, "world_size": 2, "prefetch": 2, "indices": [0, 2, 4, 6], "weights": [1.0] * 12,
          "num_threads": 2, "max_side": 32, "kind": "list", "N": 2, "transforms": [Resize((16, 16))]}
#: `name=stoker.Class(...)`, `name='text'`, `name=N`, `name=[...]`
SPELLING = re.compile(r"\b([a-z_]+)=(stoker\.[A-Za-z]+\([^()]*\)|'[^']*'|\[\.\.\.\]|N\b)")


def suggested(message: str) -> list[tuple[str, Any]]:
    """The (keyword, value) pairs `message` suggests, placeholders filled from VALUES."""
    out = []
    for name, text in SPELLING.findall(message):
        if text == "[...]":
            out.append((name, VALUES[name]))
            continue
        text = re.sub(r"\b(\w+)=\.\.\.", lambda m: f"{m.group(1)}={VALUES[m.group(1)]!r}", text)
        text = re.sub(r"\bN\b", repr(VALUES["N"]), text)
        out.append((name, eval(text, {"stoker": stoker})))  # noqa: S307 - our own message, checked here
    return out


def message_of(call: Any) -> str:
    with pytest.raises((StokerError, TypeError)) as info:
        call()
    return str(info.value)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 images, packed (the process mode one message suggests reads packed data only)."""
    root = tmp_path_factory.mktemp("spell")
    stoker.pack(make_image_folder(root / "train", n_per_class=4), root / "packed", progress=False)
    return root / "packed"


def one_batch(loader: Loader) -> tuple:
    with loader:
        return next(iter(loader))


# (what provokes the message, the keyword its fix passes)
LOADER_CASES = {
    "DistributedSampler(drop_last=True)": ({"sampler": data.distributed.DistributedSampler(
        range(12), num_replicas=2, rank=0, drop_last=True)}, "sampling"),
    "prefetch_factor": ({"prefetch_factor": 4}, "workers"),
    "batch_sampler": ({"batch_sampler": None}, "sampling"),
    "sampler with replacement": ({"sampler": data.RandomSampler(range(12), replacement=True)}, "sampling"),
    "multiprocessing_context": ({"multiprocessing_context": "spawn"}, "workers"),
    "num_threads (moved)": ({"num_threads": 2}, "workers"),
    "torchvision's transform=": ({"transform": SIZE}, "transforms"),
    "output='numpy'": ({"output": "numpy"}, "device"),
}


@pytest.mark.parametrize("case", LOADER_CASES)
def test_each_loader_message_suggests_a_spelling_the_loader_takes(folder: Path, case: str) -> None:
    provoke, keyword = LOADER_CASES[case]
    base = {} if "transform" in provoke else {"transforms": SIZE}
    spellings = [(k, v) for k, v in suggested(message_of(lambda: Loader(folder, 4, **base, **provoke)))
                 if k == keyword]
    assert spellings, f"{case}: the message names no {keyword}= spelling"
    for name, value in spellings:
        if isinstance(value, stoker.Workers) and value.processes:
            Loader(folder, 4, **base, **{name: value}).close()  # accepted; its child process is test_procs's
            continue
        images, labels = one_batch(Loader(folder, 4, **base, **{name: value}))[:2]
        assert len(images) == len(labels) > 0, (case, name, value)


def test_the_pad_message_suggests_targets_pad_and_it_batches_images_of_different_sizes(tmp_path: Path) -> None:
    folder = make_image_folder(tmp_path / "imgs", n_per_class=2)
    packed = tmp_path / "packed"
    stoker.pack(folder, packed, progress=False)
    msg = message_of(lambda: one_batch(Loader(packed, 4, transforms=[Resize(24)])))
    (name, value), = [s for s in suggested(msg) if s[0] == "targets"]
    images = one_batch(Loader(packed, 4, transforms=[Resize(24)], **{name: value}))[0]
    assert images.shape[0] == 4 and max(images.shape[-2:]) > 24   # padded to the largest resized image
    loose = message_of(lambda: one_batch(Loader(folder, 4, transforms=[Resize(24)])))
    assert "stoker.pack" in loose and "targets=stoker.Targets(pad=True)" in loose  # loose files: pack first


def test_a_source_of_unknown_kind_names_open_loose_with_kind_and_that_loads(tmp_path: Path) -> None:
    folder = make_image_folder(tmp_path / "imgs", n_per_class=2)
    listing = tmp_path / "train.idx"   # a `path label` list whose ending does not announce it
    listing.write_text("".join(f"{p.relative_to(tmp_path)} {i % 3}\n"
                               for i, p in enumerate(sorted(folder.rglob("*.jpg")))))
    msg = message_of(lambda: Loader(listing, 2, transforms=SIZE))
    assert "kind=" in msg and "Loader(" not in msg.replace("Loader's", "")
    call = re.search(r"stoker\.open_loose\(SRC, kind=\.\.\.\)", msg)
    assert call, msg
    source = eval(call.group(0).replace("SRC", repr(str(listing))).replace("kind=...", f"kind={VALUES['kind']!r}"),
                  {"stoker": stoker})  # noqa: S307
    images, labels = one_batch(Loader(source, 2, transforms=SIZE, order="sequential"))[:2]
    assert images.shape[0] == 2 and labels.tolist() == [0, 1]
    one = message_of(lambda: Loader(next(folder.rglob("*.jpg")), 2, transforms=SIZE))
    assert "one image" in one and "kind=" not in one  # no kind reads a lone file


def test_pack_options_given_to_pack_name_pack_options(tmp_path: Path) -> None:
    folder = make_image_folder(tmp_path / "imgs", n_per_class=1)
    msg = message_of(lambda: stoker.pack(folder, tmp_path / "out", max_side=32, progress=False))
    assert "open_source" not in msg   # no internal function's name
    (name, value), = suggested(msg)
    assert name == "options"
    summary = stoker.pack(folder, tmp_path / "out", progress=False, **{name: value})
    assert summary.packed == 3
    ds = stoker.open_dataset(tmp_path / "out")
    assert max(max(ds.sample(i).height, ds.sample(i).width) for i in range(len(ds))) <= 32


@pytest.mark.parametrize("typo, meant", [("maxside", "options=stoker.PackOptions(max_side=...)"),
                                         ("knd", "kind=")])
def test_a_misspelt_pack_keyword_names_the_closest(tmp_path: Path, typo: str, meant: str) -> None:
    with pytest.raises(ArgumentNameError, match=re.escape(f"did you mean {meant}?")):
        stoker.pack(tmp_path / "imgs", tmp_path / "out", **{typo: 1})


def test_typos_are_type_errors_that_name_the_argument(folder: Path) -> None:
    for typo, meant in (("num_worker", "num_workers="), ("seeds", "seed="), ("devices", "device=")):
        with pytest.raises(TypeError, match=re.escape(f"did you mean {meant}?")):
            Loader(folder, 4, transforms=SIZE, **{typo: 1})


def test_every_option_spelling_in_the_refusal_table_names_a_real_field() -> None:
    """The DataLoader keywords stoker refuses: every `stoker.Class(field=` they name is a field of Class."""
    from dataclasses import fields

    from stoker.loader import habits

    for name, text in habits._REFUSED.items():
        for cls, args in re.findall(r"stoker\.([A-Za-z]+)\(([^()]*)\)", text):
            named = re.findall(r"\b(\w+)=", args)
            assert set(named) <= {f.name for f in fields(getattr(stoker, cls))}, (name, cls, named)
