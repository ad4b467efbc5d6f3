"""The journal and the output folder of a pack: what makes it resumable.

After every finished shard one fsynced line goes to ``OUT/.stoker-pack.jsonl``; its first line (the
header) records the number of source items, the source's fingerprint and the options that shape the
output (the pack function's fingerprint among them). ``resume=True`` checks the header against this
call and the shards on disk against their lines, keeps the valid prefix and carries on from the
recorded source position. OUT is held under an OS lock for the whole pack.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import OVERWRITE, RESUME, ConfigError
from .integrity import shard_matches
from .shards import MANIFEST_NAME, ShardInfo, shard_name
from .sources import Source
from .storage import StorageBackend as Storage
from .storage.lock import LockHeldError, holder_text

JOURNAL_NAME = ".stoker-pack.jsonl"
SKIPPED_NAME = "skipped.jsonl"
#: held (an OS file lock) by the pack writing the directory; the file stays, it is never data
LOCK_NAME = ".stoker.lock"

__all__ = ["JOURNAL_NAME", "LOCK_NAME", "SKIPPED_NAME", "PackState", "append_line", "changes", "load_journal",
           "locked_out", "map_hint", "owned_files", "prepare_out", "remove", "source_fingerprint"]


@dataclass
class PackState:
    """Progress recorded in the journal: finished shards and what came before them."""

    shards: list[ShardInfo] = field(default_factory=list)
    consumed: int = 0   # source items handled (packed or skipped) up to the last finished shard
    packed: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: int = 0    # source items the pack function returned None for
    skipped: list[dict[str, str]] = field(default_factory=list)
    fingerprint: str = ""   # the source listing's, kept in the manifest for a later resume=True to check


#: the manifest's pack_options key holding the source listing's fingerprint (`source_fingerprint`)
LISTING_KEY = "source_listing_sha256"


def source_fingerprint(source: Source) -> str:
    """SHA-256 over every item's key, label and extras, and the label schema."""
    digest = hashlib.sha256()
    digest.update(json.dumps([source.label_type, source.classes, source.extra_columns]).encode())
    for item in source.items:
        listed = [item.key, item.label, item.extras] + ([item.label_maps] if item.label_maps else [])
        digest.update(json.dumps(listed, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def append_line(storage: Storage, obj: dict[str, Any]) -> None:
    """One fsynced line of the journal."""
    storage.append_line(JOURNAL_NAME, json.dumps(obj))


def owned_files(storage: Storage) -> list[str]:
    """Files a pack writes into OUT (finished or not); nothing else there is touched."""
    names = {MANIFEST_NAME, JOURNAL_NAME, SKIPPED_NAME, f".{MANIFEST_NAME}.tmp", f".{JOURNAL_NAME}.tmp",
             f".{SKIPPED_NAME}.tmp"}
    present = storage.list()
    return ([n for n in sorted(names) if n in present] + fnmatch.filter(present, "shard-*.arrow")
            + fnmatch.filter(present, ".shard-*.arrow.tmp"))


def remove(storage: Storage, names: list[str]) -> None:
    for name in names:
        storage.remove(name)


def load_journal(storage: Storage, header: dict[str, Any]) -> PackState:
    """Check the journal against ``header`` and the shards on disk; keep the valid prefix."""
    lines = storage.read_bytes(JOURNAL_NAME).decode("utf-8").splitlines()
    try:
        found = json.loads(lines[0]) if lines else {}
    except (json.JSONDecodeError, RecursionError):
        found = {}
    for field_name in ("items", "fingerprint", "pack_options"):
        if found.get(field_name) != header[field_name]:
            what = {"items": "number of source items", "fingerprint": "source listing (keys, labels, extras)",
                    "pack_options": "pack options or source"}[field_name]
            raise ConfigError.spelled(
                f"{storage.location} holds an unfinished pack whose {what} differs from this call "
                f"({changes(found.get(field_name), header[field_name])}); resume with the "
                f"same source and options{map_hint(found.get(field_name), header[field_name])}, or pass "
                "{overwrite} to start over", {"overwrite": OVERWRITE})
    state, kept = PackState(), [lines[0]]
    for line in lines[1:]:
        try:
            entry = json.loads(line)
            info = ShardInfo(**entry["shard"])
        except (json.JSONDecodeError, RecursionError, KeyError, TypeError):
            break  # a line torn by the crash: its shard is redone
        if info.file != shard_name(len(state.shards)) or not shard_matches(storage, info):
            break  # damaged or missing shard: redo from here
        state.shards.append(info)
        state.consumed, state.packed = entry["consumed"], entry["packed"]
        state.bytes_in, state.bytes_out = entry["bytes_in"], entry["bytes_out"]
        state.dropped = entry.get("dropped", 0)
        state.skipped.extend(entry["skipped"])
        kept.append(line)
    keep = {s.file for s in state.shards}
    present = storage.list()
    remove(storage, [n for n in fnmatch.filter(present, "shard-*.arrow") if n not in keep]
            + fnmatch.filter(present, ".shard-*.arrow.tmp"))
    storage.write_atomic(JOURNAL_NAME, ("\n".join(kept) + "\n").encode())
    return state


def map_hint(was: Any, now: Any) -> str:
    """When the pack function's fingerprint is what differs: how to declare a change that does not matter."""
    if isinstance(was, dict) and isinstance(now, dict) and was.get("map") != now.get("map"):
        return (" (the pack function changed: pass the one the pack was made with, or, if the change does not "
                "alter its output, PackOptions(map_fingerprint=) / --map-fingerprint with the saved fingerprint)")
    return ""


def changes(was: Any, now: Any) -> str:
    """What differs between the options a pack was made with and this call's, one `name: was X, now Y`
    per option (not the whole dicts, in which one changed value is hard to spot)."""
    if not (isinstance(was, dict) and isinstance(now, dict)):
        return f"was {was!r}, now {now!r}"
    unset = "(not set)"
    return "; ".join(f"{name}: was {was.get(name, unset)!r}, now {now.get(name, unset)!r}"
                     for name in sorted(set(was) | set(now), key=str) if was.get(name, unset) != now.get(name, unset))


@contextmanager
def locked_out(storage: Storage) -> Iterator[None]:
    """Create OUT and hold its lock for the whole pack: a second pack into it fails at once."""
    try:
        storage.makedirs()
    except (FileExistsError, NotADirectoryError):
        what = "is a file" if Path(storage.location).is_file() else "is under a file, not a folder"
        raise ConfigError(f"output {storage.location} {what}; expected a directory (empty, or holding a "
                          "pack to resume): choose another output path") from None
    lock = storage.lock(LOCK_NAME)
    try:
        lock.__enter__()
    except LockHeldError as exc:
        raise ConfigError(f"{storage.location} is being written by another pack: {holder_text(exc.holder)}; "
                          "wait for it to finish (then pass resume=True / --resume if it was stopped), or "
                          "choose another output directory") from None
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def prepare_out(storage: Storage, header: dict[str, Any], resume: bool, overwrite: bool) -> PackState | None:
    """Make OUT ready; returns the state to continue from, or None when the pack is finished."""
    owned = owned_files(storage)
    has_manifest, has_journal = MANIFEST_NAME in owned, JOURNAL_NAME in owned
    if overwrite:
        remove(storage, owned)
    elif resume and has_manifest:
        return None
    elif resume and has_journal:
        return load_journal(storage, header)
    elif resume:
        remove(storage, owned)  # shards with no journal are not ours to trust
    elif owned:
        state = "a finished pack" if has_manifest else "an unfinished pack"
        raise ConfigError.spelled(
            f"{storage.location} already holds {state} ({owned[0]}, ...); pass {{resume}} to finish it, "
            "{overwrite} to replace it, or choose an empty directory", {"resume": RESUME, "overwrite": OVERWRITE})
    append_line(storage, header)
    return PackState()
