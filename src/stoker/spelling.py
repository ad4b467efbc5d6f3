"""Keyword arguments a function does not take, refused naming the spelling it does.

The likeliest slips are another library's spelling (torchvision's `transform=`, `output="numpy"`)
or an option that lives in an option value (`pack(src, out, max_side=256)` is
`options=stoker.PackOptions(max_side=256)`). Each is an ArgumentNameError (a TypeError, as
Python's own would be) that names what to pass; any other name gets the closest accepted one.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Iterable

from .errors import ArgumentNameError, SourceError

#: other libraries' spellings of the Loader's arguments: name -> (value -> what to pass instead)
LOADER_HINTS = {
    "transform": lambda v: "transforms=[...] (one transform, a list, or a torchvision Compose)",
    "output": lambda v: f"device={v!r}" if isinstance(v, str) else "device= ('numpy', 'cpu' or 'cuda')",
    "out": lambda v: f"device={v!r}" if isinstance(v, str) else "device= ('numpy', 'cpu' or 'cuda')",
    "batchsize": lambda v: f"batch_size={v!r} (the second positional argument)",
    "size": lambda v: "transforms=[stoker.Resize(size)] or [stoker.RandomResizedCrop(size)]",
    "image_size": lambda v: "transforms=[stoker.Resize(size)] or [stoker.RandomResizedCrop(size)]",
    "epoch": lambda v: "loader.set_epoch(epoch) before each epoch",
}


def unknown_keyword(function: str, name: str, value: Any, accepted: Iterable[str],
                    hints: dict[str, Any] | None = None, spell: Any = None, listed: Any = None
                    ) -> ArgumentNameError:
    """The error for ``function(name=value)`` where `function` takes only `accepted` keywords: a hint
    from `hints` when there is one for `name`, else the closest accepted name (written by `spell`,
    default ``name=``), else the list (each written by `listed`, default `spell`)."""
    accepted = sorted(set(accepted))
    spell = spell or (lambda a: f"{a}=")
    hint = (hints or {}).get(name)
    if hint is not None:
        fix = f"pass {hint(value)}"
    else:
        close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
        fix = f"did you mean {spell(close[0])}?" if close else f"it takes {', '.join(sorted(set(map(listed or spell, accepted))))}"
    return ArgumentNameError(f"{function}() got an unexpected keyword argument {name!r}; {fix}")


def pack_keywords(source_options: dict[str, Any], open_source: Any, pack_options: type) -> None:
    """Refuse the keywords of ``stoker.pack(src, out, **source_options)`` that `open_source` does not take:
    a field of the `pack_options` dataclass (PackOptions) is `options=stoker.PackOptions(field=...)`;
    anything else names the closest."""
    source_keywords = set(inspect.signature(open_source).parameters) - {"src"}
    pack_fields = {f.name for f in dataclasses.fields(pack_options)}
    for name, value in source_options.items():
        if name in source_keywords:
            continue
        if name in pack_fields:
            raise ArgumentNameError(f"pack({name}=...) is a packing option: pass "
                                    f"options=stoker.PackOptions({name}={value!r}) (several fields go in the one "
                                    f"PackOptions)")
        raise unknown_keyword("pack", name, value, source_keywords | pack_fields | {"options", "resume", "progress",
                                                                                   "overwrite"},
                              spell=lambda a: f"options=stoker.PackOptions({a}=...)" if a in pack_fields else f"{a}=",
                              listed=lambda a: "options=stoker.PackOptions(...)" if a in pack_fields else f"{a}=")


def loader_source_error(exc: SourceError, source: Any) -> SourceError:
    """`exc` (from listing the Loader's unpacked `source`) in the Loader's terms: where it names
    ``kind=``, which the Loader does not take, it names ``stoker.open_loose(SRC, kind=...)`` as the
    Loader's source; for a single image file it says the Loader reads a dataset (a folder of images)."""
    from pathlib import Path

    from .sources import IMAGE_EXTENSIONS

    if exc.spelling is None or "kind" not in exc.spelling[1]:
        return exc
    path = Path(str(source))
    if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS:
        return SourceError(f"{path} is one image; Loader(source) reads a dataset: a folder of images (put it in a "
                           f"folder, class folders for labels), a packed dataset (stoker.pack), or any source "
                           f"stoker.pack reads", path=path)
    template, spellings = exc.spelling
    return SourceError.spelled(template, {**spellings, "kind": ("stoker.open_loose(SRC, kind=...) as the Loader's "
                                                                "source", spellings["kind"][1])}, path=exc.path)
