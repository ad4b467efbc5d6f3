"""Storage: the one seam through which packed datasets are read and written.

``open_storage(path_or_url)`` returns the backend for a dataset location: :class:`LocalStorage`
for a folder (or a ``file://`` URL), :class:`RemoteStorage` for any URL an installed fsspec backend
serves (``s3://`` with s3fs, ``gs://`` with gcsfs, ``https://``, ...; ``pip install 'stoker[remote]'``).
Any other URL is refused with :class:`~stoker.errors.UnsupportedStorageError`: it is never turned
into a local folder of that name.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from typing import Any

from ..errors import UnsupportedStorageError
from .base import ShardSink, StorageBackend
from .local import LocalStorage, atomic_write_bytes, file_sha256
from .remote import INSTALL_HINT, RemoteStorage, serves

__all__ = ["LocalStorage", "RemoteStorage", "ShardSink", "StorageBackend", "as_storage", "atomic_write_bytes",
           "file_sha256", "open_storage", "url_scheme"]

# "scheme://" or "scheme:/" (what pathlib leaves of "s3://bucket" after a str -> Path round trip);
# two letters at least, so a Windows drive "C:/" is not a scheme.
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")



def url_scheme(location: str | Path) -> str | None:
    """The URL scheme of ``location`` (lower case), or None for a plain path."""
    match = _SCHEME_RE.match(str(location))
    return match.group(1).lower() if match else None


def open_storage(location: str | Path, **remote_options: Any) -> StorageBackend:
    """The storage backend for a dataset folder or URL. Raises UnsupportedStorageError for a URL
    no backend serves (never falls back to a local folder named like the URL). `remote_options`
    (storage_options, cache_dir, cache_limit) go to RemoteStorage; a local folder needs none."""
    scheme = url_scheme(location)
    if scheme is None:
        return LocalStorage(location)
    if scheme == "file":
        parsed = urlparse(str(location))
        if parsed.netloc not in ("", "localhost"):
            raise UnsupportedStorageError(f"{location}: file:// URLs must name a local path (file:///data/ds), "
                                          f"not host {parsed.netloc!r}", location=str(location))
        return LocalStorage(unquote(parsed.path))
    if serves(scheme):
        return RemoteStorage(str(location), **remote_options)
    try:
        import fsspec  # noqa: F401
    except ImportError:
        raise UnsupportedStorageError(
            f"{location}: {scheme}:// URLs are read through fsspec, which is not installed: {INSTALL_HINT} "
            "(plus gcsfs for gs://, adlfs for az://)", location=str(location)) from None
    raise UnsupportedStorageError(
        f"{location}: no installed fsspec backend serves {scheme}:// URLs; install the one for your storage "
        "(s3fs, gcsfs, adlfs, ...), or copy the dataset to a local folder and pass that path",
        location=str(location))


def as_storage(location: str | Path | StorageBackend) -> StorageBackend:
    """``location`` itself when it is already a StorageBackend, else :func:`open_storage` of it."""
    return location if isinstance(location, StorageBackend) else open_storage(location)
