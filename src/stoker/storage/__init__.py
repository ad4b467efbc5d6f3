"""Storage: the one seam through which packed datasets are read and written.

``open_storage(path_or_url)`` returns the backend for a dataset location: :class:`LocalStorage`
for a folder (or a ``file://`` URL). Any other URL scheme (``s3://``, ``gs://``, ``https://``, ...)
is refused with :class:`~stoker.errors.UnsupportedStorageError`: it is never turned into a local
folder of that name. A backend is one module implementing :class:`Storage` plus one line in
``_BACKENDS``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..errors import UnsupportedStorageError
from .base import ShardSink, Storage
from .local import LocalStorage, atomic_write_bytes, file_sha256

__all__ = ["LocalStorage", "ShardSink", "Storage", "as_storage", "atomic_write_bytes", "file_sha256",
           "open_storage", "url_scheme"]

# "scheme://" or "scheme:/" (what pathlib leaves of "s3://bucket" after a str -> Path round trip);
# two letters at least, so a Windows drive "C:/" is not a scheme.
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")

#: scheme -> backend constructor taking the location. Object storage (fsspec) comes next.
_BACKENDS: dict[str, Callable[[str], Storage]] = {}


def url_scheme(location: str | Path) -> str | None:
    """The URL scheme of ``location`` (lower case), or None for a plain path."""
    match = _SCHEME_RE.match(str(location))
    return match.group(1).lower() if match else None


def open_storage(location: str | Path) -> Storage:
    """The storage backend for a dataset folder or URL. Raises UnsupportedStorageError for a URL
    no backend serves (never falls back to a local folder named like the URL)."""
    scheme = url_scheme(location)
    if scheme is None:
        return LocalStorage(location)
    if scheme == "file":
        parsed = urlparse(str(location))
        if parsed.netloc not in ("", "localhost"):
            raise UnsupportedStorageError(f"{location}: file:// URLs must name a local path (file:///data/ds), "
                                          f"not host {parsed.netloc!r}", location=str(location))
        return LocalStorage(unquote(parsed.path))
    backend = _BACKENDS.get(scheme)
    if backend is None:
        raise UnsupportedStorageError(
            f"{location}: remote storage ({scheme}://) is not supported yet; copy the dataset to a local "
            "folder (or a mounted file system) and pass that path", location=str(location))
    return backend(str(location))


def as_storage(location: str | Path | Storage) -> Storage:
    """``location`` itself when it is already a Storage, else :func:`open_storage` of it."""
    return location if isinstance(location, Storage) else open_storage(location)
