"""The user's own function at pack time: ``PackOptions(map=fn)``.

``fn`` is called once per source sample, on the pack's worker threads (or Ray workers), with a
:class:`PackSample`, and returns what the shards store in its place:

- a ``PackSample`` (the same one, or ``sample.replace(...)`` with a new key, label, extras, encoded
  ``data`` or decoded ``image``),
- a list (or tuple) of them: several samples from one (crops, frames, tiles), each its own row,
- ``None``: the sample is dropped (counted as dropped, not as a failure).

What it returns goes through the same normalization as any sample (decode check, ``max_side``,
``encoding``), in source order, so the output is the same for any worker count and engine. An
exception in ``fn``, or a result the shards cannot hold (a label outside the class list, an extra
column the source does not have), skips that sample with the reason in ``skipped.jsonl``, like a bad
file (``on_error="fail"``: raises ``MapFunctionError``).

A resumed pack must run the same function: the journal and the manifest record its fingerprint
(:func:`function_fingerprint`: a SHA-256 of its code, constants, defaults and closure values, and of the
code of the functions it calls by name from its own module), and ``resume=True`` refuses a pack made with
another. ``PackOptions(map_fingerprint="v2")`` names the version yourself instead, for a function
whose behaviour depends on something the fingerprint cannot see (a model's weights, a file it reads).
"""

from __future__ import annotations

import functools
import hashlib
import traceback
import types
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from . import codecs
from ._progress import log
from .errors import ImageError, MapFunctionError
from .shards import arrow_type

__all__ = ["PackSample", "function_fingerprint", "run_map"]

_UNSET: Any = object()


class PackSample:
    """One sample as the pack function sees it (and returns it).

    ``key`` (str), ``label`` (the source's label: a class index, a list, a float, text or None),
    ``extras`` (a read-only mapping of the source's extra columns), ``data`` (the encoded bytes as
    the source holds them; None once pixels were set) and ``image``: the pixels, upright RGB
    ``uint8 [H, W, 3]``, decoded on first access (a function that reads only the label costs no
    decode). ``sample["key"]`` and ``sample.get(name)`` read the same fields, extras included.
    """

    __slots__ = ("key", "label", "extras", "data", "_image", "_max_pixels")

    def __init__(self, key: str, data: bytes | None, label: Any = None, extras: Mapping[str, Any] | None = None,
                 *, image: np.ndarray | None = None, max_pixels: int = codecs.MAX_PIXELS) -> None:
        self.key, self.data, self.label = key, data, label
        self.extras = types.MappingProxyType(dict(extras or {}))
        self._image, self._max_pixels = image, max_pixels

    @property
    def image(self) -> np.ndarray:
        """The pixels, upright RGB uint8 [H, W, 3] (decoded from ``data`` on first access, then kept)."""
        if self._image is None:
            if self.data is None:
                raise ValueError(f"sample {self.key!r} has neither bytes nor pixels")
            self._image = codecs.decode_pillow_rgb(self.data, self.key, max_pixels=self._max_pixels)
        return self._image

    @property
    def decoded(self) -> bool:
        """Whether the pixels are in hand (set, or decoded by an access to ``image``)."""
        return self._image is not None

    def replace(self, *, key: str = _UNSET, label: Any = _UNSET, extras: Mapping[str, Any] = _UNSET,
                data: bytes = _UNSET, image: Any = _UNSET) -> "PackSample":
        """A new sample with the fields given changed. ``image``: a numpy array (``[H, W, 3]`` or
        ``[H, W]`` grey, uint8) or a PIL image; ``data``: new encoded bytes (JPEG, PNG, ...). Setting
        one drops the other. ``extras`` replaces the mapping; ``{**s.extras, "col": v}`` changes one."""
        new = PackSample(self.key if key is _UNSET else key, self.data,
                         self.label if label is _UNSET else label,
                         self.extras if extras is _UNSET else extras, image=self._image,
                         max_pixels=self._max_pixels)
        if data is not _UNSET:
            new.data, new._image = bytes(data), None
        if image is not _UNSET:
            new.data, new._image = None, _pixels(image, new.key)
        return new

    def __getitem__(self, name: str) -> Any:
        if name in ("key", "label", "data", "image"):
            return getattr(self, name)
        return self.extras[name]

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default

    def __repr__(self) -> str:
        what = f"{len(self.data)} bytes" if self.data is not None else f"pixels {self._image.shape}"
        return f"PackSample(key={self.key!r}, label={self.label!r}, extras={dict(self.extras)!r}, {what})"


def _pixels(image: Any, key: str) -> np.ndarray:
    """A returned image as upright RGB uint8 [H, W, 3]; raises ValueError saying what was wrong."""
    if hasattr(image, "convert") and hasattr(image, "mode"):   # a PIL image
        image = np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8 or 0 in arr.shape:
        raise ValueError(f"image= takes uint8 pixels [H, W, 3] (or [H, W] grey, or a PIL image); sample {key!r} "
                         f"got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr)


# ---------------------------------------------------------------- the fingerprint

def function_fingerprint(fn: Callable[..., Any]) -> str:
    """A hex SHA-256 naming what ``fn`` does, for ``--resume``: its code (and that of nested functions),
    constants, names, default arguments, closure values and the functions of its own module it calls by
    name. Stable across runs and processes of the same Python version; it cannot see into objects
    (a model's weights) or files the function reads: name those with ``map_fingerprint=``."""
    digest = hashlib.sha256()
    _feed(digest, fn, set())
    return digest.hexdigest()


def _feed(digest: Any, obj: Any, seen: set[int]) -> None:
    if isinstance(obj, np.ndarray):   # all of it: a repr elides the middle of a large array
        digest.update(f"ndarray {obj.dtype.str} {obj.shape}".encode())
        digest.update(np.ascontiguousarray(obj).tobytes())
        return
    code_like = isinstance(obj, (types.MethodType, types.FunctionType, functools.partial)) or (
        callable(obj) and not isinstance(obj, type) and isinstance(getattr(type(obj), "__call__", None),
                                                                    types.FunctionType))
    if not code_like:   # a value: fed each time it is met (two globals may hold the same small int)
        digest.update(_stable_repr(obj).encode())
        return
    if id(obj) in seen:   # code met before (recursion, or two names for one function)
        return
    seen.add(id(obj))
    if isinstance(obj, types.MethodType):
        _feed(digest, obj.__func__, seen)
        _feed(digest, obj.__self__, seen)
    elif isinstance(obj, types.FunctionType):
        digest.update(f"{obj.__module__}.{obj.__qualname__}".encode())
        _code(digest, obj.__code__, obj.__globals__, seen)
        for value in (obj.__defaults__ or ()) + tuple((obj.__kwdefaults__ or {}).values()):
            _feed(digest, value, seen)
        for cell in obj.__closure__ or ():
            try:
                _feed(digest, cell.cell_contents, seen)
            except ValueError:   # an empty cell
                digest.update(b"<empty>")
    elif isinstance(obj, functools.partial):
        _feed(digest, obj.func, seen)
        for value in obj.args + tuple(obj.keywords.values()):
            _feed(digest, value, seen)
    else:   # a callable object
        digest.update(f"{type(obj).__module__}.{type(obj).__qualname__}".encode())
        _feed(digest, type(obj).__call__, seen)
        for name, value in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else ():
            digest.update(name.encode())
            _feed(digest, value, seen)


def _stable_repr(obj: Any) -> str:
    """`repr`, the same in every process: a set's members sorted (their order follows string hashing,
    which differs per process), containers taken apart, and an object whose repr is only an address
    named by its type (logged: the fingerprint cannot follow it)."""
    if isinstance(obj, (set, frozenset)):
        return f"{type(obj).__name__}({sorted(_stable_repr(x) for x in obj)})"
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__}({', '.join(_stable_repr(x) for x in obj)})"
    if isinstance(obj, dict):
        return f"dict({', '.join(f'{_stable_repr(k)}: {_stable_repr(v)}' for k, v in obj.items())})"
    text = repr(obj)
    if " at 0x" in text:   # an address changes every run: the type's name is all that is stable
        _opaque(obj)
        return type(obj).__qualname__
    return text


_WARNED: set[str] = set()


def _opaque(obj: Any) -> None:
    """Say (once per type) that the fingerprint cannot follow `obj` (a model, an open file): a resume
    cannot notice it change."""
    name = type(obj).__qualname__
    if name in _WARNED:
        return
    _WARNED.add(name)
    log.warning("the pack function's fingerprint cannot see inside its %s value (its repr names only an address): "
                "a --resume would not notice it change; name its version with map_fingerprint= (--map-fingerprint)",
                name)


def _code(digest: Any, code: types.CodeType, module: dict[str, Any], seen: set[int]) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code(digest, const, module, seen)
        else:   # `x in {"a", "b"}` compiles to a frozenset constant
            digest.update(_stable_repr(const).encode())
    for name in code.co_names:   # the module's globals it reads: constants (SIZE = 32) and its own functions
        if name not in module:
            continue
        value = module[name]
        if isinstance(value, types.FunctionType):
            if value.__module__ == module.get("__name__"):
                _feed(digest, value, seen)
        elif not isinstance(value, (types.ModuleType, type, types.BuiltinFunctionType)):
            digest.update(f"global {name}=".encode())
            _feed(digest, value, seen)


# ---------------------------------------------------------------- running it in a worker

def run_map(fn: Callable[[PackSample], Any], sample: PackSample, label_type: str, num_classes: int,
            extra_columns: Mapping[str, str]) -> list[PackSample]:
    """``fn(sample)`` as a list of samples the shards can hold (empty: dropped). Raises
    MapFunctionError naming the sample, the function and what was wrong, or the ImageError of a
    sample whose bytes do not decode when the function reads its pixels."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    try:
        out = fn(sample)
    except ImageError:   # the sample's own bytes would not decode (sample.image): a bad file, said as such
        raise
    except Exception as exc:
        raise MapFunctionError(sample.key, f"map function {name} raised {type(exc).__name__}: {exc}"
                                           f"{_where_raised(exc)}") from exc
    if out is None:
        return []
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    for k, made in enumerate(outs):
        what = f"map function {name} returned" + (f", as sample {k} of {len(outs)}," if len(outs) > 1 else "")
        if not isinstance(made, PackSample):
            raise MapFunctionError(sample.key, f"{what} a {type(made).__name__}; expected the PackSample it was "
                                               "given (or sample.replace(...)), a list of them, or None to drop it")
        problem = _unfit(made, label_type, num_classes, extra_columns)
        if problem:
            raise MapFunctionError(sample.key, f"{what} {problem}")
    return outs


def _unfit(sample: PackSample, label_type: str, num_classes: int, extra_columns: Mapping[str, str]) -> str:
    """What about a returned sample the shards cannot hold ('' when nothing)."""
    if not isinstance(sample.key, str) or not sample.key:
        return f"key {sample.key!r}; a key is non-empty text"
    if set(sample.extras) != set(extra_columns):
        return (f"extras with columns {sorted(sample.extras)}; the source's columns are {sorted(extra_columns)} "
                "(the shards' schema is fixed before the first sample: keep every column, change their values)")
    checks = [("label", sample.label, label_type)] if label_type != "none" else []
    checks += [(f"extra {col!r}", sample.extras[col], kind) for col, kind in extra_columns.items()]
    for what, value, kind in checks:
        try:
            pa.array([value], type=arrow_type(kind))
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return f"{what} {value!r:.80}, which a {kind} column cannot hold"
    if label_type == "int64" and num_classes and sample.label is not None \
            and not 0 <= int(sample.label) < num_classes:
        return f"label {sample.label!r}, outside the {num_classes} classes (0..{num_classes - 1})"
    return ""


def _where_raised(exc: BaseException) -> str:
    """' (at file:line in function)' of the innermost frame of the traceback: where the user's code broke."""
    frames = traceback.extract_tb(exc.__traceback__)
    if len(frames) < 2:
        return ""
    last = frames[-1]
    return f" (at {last.filename}:{last.lineno} in {last.name})"
