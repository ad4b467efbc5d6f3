"""One exception tree for stoker. Every error says what was expected, what was found,
and which file, shard, row or sample it concerns.

    StokerError
    ├── ConfigError (ValueError)          a bad argument or option combination
    │   ├── UnsupportedStorageError       a URL no installed storage backend serves (the message names the package)
    │   └── ArgumentNameError (TypeError) a keyword argument the function does not take (the message names the one it does)
    ├── MissingDependencyError (ImportError) an optional package (torch, ...) is not installed
    ├── SourceError (ValueError)          input that cannot be listed: missing path, bad list line
    ├── ImageError (ValueError)           one image that cannot be used
    │   ├── CorruptImageError             truncated, not an image, decoder failure
    │   │   └── CorruptVideoError         a video: empty, unreadable container, truncated, decoder failure
    │   ├── UnsupportedImageError         a format or mode stoker cannot turn into RGB
    │   │   └── UnsupportedVideoError     a video without a video stream (audio-only), or over the limits
    │   ├── DecompressionBombError        too many pixels, refused before decoding
    │   └── MapFunctionError              the pack's own function (PackOptions(map=)) failed on one sample
    ├── DatasetError (OSError)            a packed dataset on disk is wrong
    │   ├── ManifestError                 stoker.json missing, not JSON, or inconsistent
    │   ├── ShardError                    a shard missing, truncated, not Arrow, or bad checksum
    │   └── IncompletePackError           a pack that has not finished (no manifest yet)
    ├── OutputError (OSError)             the output directory cannot be written (disk full, ...)
    ├── DatasetClosedError (ValueError)   a dataset used after close()
    ├── SampleError (RuntimeError)        loading one sample failed inside the Loader
    │   └── UserTransformError            the user's own transform raised: a bug in that code, not bad data
    ├── LoaderClosedError (RuntimeError)  the loader was closed while a batch was awaited
    ├── WorkerError (RuntimeError)        a loader thread died outside any one sample
    └── LoaderTimeoutError (TimeoutError) a wait for data exceeded its timeout
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

_E = TypeVar("_E", bound="StokerError")


class StokerError(Exception):
    """Base of every error stoker raises on purpose.

    A message that names a fix speaks to its reader: Python arguments (``resume=True``) in
    ``str(exc)`` for library users, command-line flags (``--resume``) in ``cli_message`` for the CLI,
    which prints that one. Build such an error with :meth:`spelled`.
    """

    #: the message with command-line flags instead of Python arguments (None: same as str())
    cli_message: str | None = None
    #: (template, spellings) of an error made by `spelled`, so a caller can name its own spelling
    spelling: tuple[str, dict[str, tuple[str, str]]] | None = None

    @classmethod
    def spelled(cls: type[_E], template: str, spellings: dict[str, tuple[str, str]], **kwargs: Any) -> _E:
        """An error whose message names each fix in its reader's terms: every ``{name}`` in `template`
        becomes ``spellings[name][0]`` (the Python argument) in ``str(exc)`` and ``spellings[name][1]``
        (the CLI flag) in ``exc.cli_message``. Other braces in `template` are left alone."""
        python, cli = template, template
        for name, (argument, flag) in spellings.items():
            python = python.replace("{" + name + "}", argument)
            cli = cli.replace("{" + name + "}", flag)
        exc = cls(python, **kwargs)
        exc.cli_message = cli
        exc.spelling = (template, spellings)
        return exc

    def for_cli(self) -> str:
        """The message a command-line user should read."""
        return self.cli_message if self.cli_message is not None else str(self)


#: the fixes messages most often name, as (Python argument, CLI flag)
RESUME = ("resume=True", "--resume")
OVERWRITE = ("overwrite=True", "--overwrite")


class ConfigError(StokerError, ValueError):
    """An argument or option that stoker cannot use; the message names the fix."""


class UnsupportedStorageError(ConfigError):
    """A dataset location (URL scheme) no storage backend serves; it is refused, never turned
    into a local path. `location` is the path or URL as given."""

    def __init__(self, message: str, *, location: str | None = None) -> None:
        super().__init__(message)
        self.location = location


class ArgumentNameError(ConfigError, TypeError):
    """A keyword argument the function does not take (a typo, or another library's spelling): a
    TypeError, as Python's own would be, whose message names the argument to pass instead."""


class MissingDependencyError(StokerError, ImportError):
    """An optional package a feature needs is not installed; the message gives the `pip install`
    command. `package` is the missing distribution's name."""

    def __init__(self, message: str, *, package: str) -> None:
        super().__init__(message, name=package)
        self.package = package


class SourceError(StokerError, ValueError):
    """Input that cannot be listed: a missing path, an empty folder, a malformed list line."""

    def __init__(self, message: str, *, path: str | Path | None = None, line: int | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.line = line


class ImageError(StokerError, ValueError):
    """One image that cannot be used. `key` names the file or sample, `reason` says why."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class CorruptImageError(ImageError):
    """Truncated, damaged, empty, or not an image at all."""


class UnsupportedImageError(ImageError):
    """A readable image in a format or mode stoker cannot turn into RGB."""


class CorruptVideoError(CorruptImageError):
    """A video sample that cannot be decoded: empty, not a container FFmpeg reads, truncated (fewer
    frames decode than the container lists), frames without or with repeated timestamps."""


class UnsupportedVideoError(UnsupportedImageError):
    """A readable file that is not a usable video sample: no video stream (audio-only), or longer than
    the pack-time limits."""


class DecompressionBombError(ImageError):
    """An image whose header claims more pixels than the configured limit."""


class MapFunctionError(ImageError):
    """The function of ``PackOptions(map=)`` raised on one sample, or returned what the shards cannot hold."""


class DatasetError(StokerError, OSError):
    """A packed dataset on disk is wrong. `path` names the dataset, shard or manifest."""

    def __init__(self, message: str, *, path: str | Path | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)

    def __str__(self) -> str:  # OSError would otherwise format args as a tuple
        return str(self.args[0]) if self.args else ""


class ManifestError(DatasetError):
    """stoker.json is missing, not valid JSON, or does not match the shards."""


class ShardError(DatasetError):
    """A shard is missing, truncated, not Arrow, or does not match its checksum."""


class IncompletePackError(DatasetError):
    """The directory holds a pack that has not finished; `stoker pack --resume` completes it."""


class OutputError(StokerError, OSError):
    """Writing the output directory failed (disk full, quota, read-only, I/O error). ``errno`` is
    the operating system's; ``path`` names the directory. A stopped pack resumes (``--resume``)."""

    def __init__(self, message: str, *, path: str | Path | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.errno = errno

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DatasetClosedError(StokerError, ValueError):
    """A dataset used after ``close()`` (its shards are unmapped); open it again."""


class SampleError(StokerError, RuntimeError):
    """Loading one sample failed inside the Loader. Carries key, shard and row; the
    original exception (with its traceback from the worker thread) is `__cause__`."""

    def __init__(self, message: str, *, key: str | None = None, shard: str | None = None,
                 row: int | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.shard = shard
        self.row = row
        self.index = index


class UserTransformError(SampleError):
    """A transform the user passed (a callable in ``transforms=``) raised, or returned something that is
    not a uint8 HxWx3 array: a bug in that code, not in the data, so ``on_error="skip"`` does not hide it
    and re-packing does not help. ``transform`` names it; its exception is ``__cause__``."""

    def __init__(self, message: str, *, transform: str, key: str | None = None, shard: str | None = None,
                 row: int | None = None, index: int | None = None) -> None:
        super().__init__(message, key=key, shard=shard, row=row, index=index)
        self.transform = transform


class LoaderTimeoutError(StokerError, TimeoutError):
    """A wait for data took longer than the Loader's timeout; the message says where."""


class LoaderClosedError(StokerError, RuntimeError):
    """The loader (or one pass over it) was closed while the training loop waited for a batch."""


class WorkerError(StokerError, RuntimeError):
    """A loader thread (a worker or the device thread) ended outside any one sample's work; the
    thread's own exception, with its traceback, is `__cause__` when there is one."""
