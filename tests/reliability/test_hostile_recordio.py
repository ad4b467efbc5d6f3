"""RecordIO indexes that lie: duplicate offsets, an ``.idx`` cut short or empty, any offsets at all.
Each record of the ``.rec`` is read at most once, none is lost without a word."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: the shared writers
from formats_helpers import pack_and_read, photos, skipped  # noqa: E402
from recordio_writer import RecordWriter, pack, write_rec  # noqa: E402

from stoker.errors import SourceError  # noqa: E402
from stoker.sources import open_source  # noqa: E402


def _offsets(rec: Path) -> list[int]:
    import struct

    data, pos, out = rec.read_bytes(), 0, []
    while pos < len(data):
        out.append(pos)
        (lrec,) = struct.unpack_from("<I", data, pos + 4)
        pos += 8 + (((lrec & ((1 << 29) - 1)) + 3) & ~3)
    return out


def test_duplicate_offsets_read_the_record_once(tmp_path: Path) -> None:
    """1,000 keys naming offset 0: one sample, 999 lines in skipped.jsonl naming the first key; the
    samples' bytes add up to no more than the file holds."""
    imgs = photos(3, seed=7)
    rec = write_rec(tmp_path / "d" / "train.rec", [(float(i), im) for i, im in enumerate(imgs)])
    rec.with_suffix(".idx").write_text("".join(f"{k}\t0\n" for k in range(1000)))
    src = open_source(rec)
    first = [i for i in src.items if i.key == "train.rec/0"]
    assert len(first) == 1 and first[0].read() == imgs[0]
    assert sum(i.size for i in src.items) <= rec.stat().st_size
    dupes = [s for s in src.skipped if "a record is read once" in s["reason"]]
    assert len(dupes) == 999 and "line 1 already gives key '0'" in dupes[0]["reason"]
    rows, _ = pack_and_read(rec, tmp_path / "out")
    assert len(rows) == 3 and sorted(r["image"] for r in rows.values()) == sorted(imgs)
    assert len(skipped(tmp_path / "out")) == 999


def test_an_idx_cut_short_packs_every_record_the_rec_holds(tmp_path: Path) -> None:
    """An .idx listing 3 of 40 records: the 3 under their keys, the other 37 keyed by their byte offset,
    the description says so; nothing is lost."""
    imgs = photos(40, seed=8)
    rec = write_rec(tmp_path / "d" / "train.rec", [(float(i % 4), im) for i, im in enumerate(imgs)])
    lines = rec.with_suffix(".idx").read_text().splitlines()
    rec.with_suffix(".idx").write_text("\n".join(lines[:3]) + "\n")
    offsets = _offsets(rec)
    rows, manifest = pack_and_read(rec, tmp_path / "out")
    assert len(rows) == 40
    assert {k: r["image"] for k, r in rows.items()} == {
        **{f"train.rec/{k}": imgs[k] for k in range(3)}, **{f"train.rec/@{offsets[k]}": imgs[k] for k in range(3, 40)}}
    assert rows[f"train.rec/@{offsets[9]}"]["label"] == 1
    assert "train.idx does not list 37 records train.rec holds" in manifest["pack_options"]["source"]


def test_an_idx_for_an_older_rec_is_checked_against_it(tmp_path: Path) -> None:
    """Records appended after the .idx was written, and a listed offset that is no record start: the
    appended ones are packed, the bad line is in skipped.jsonl."""
    imgs = photos(6, seed=9)
    with RecordWriter(tmp_path / "d" / "train.rec") as w:
        for k in range(3):
            w.write(pack(float(k), imgs[k]), k)
    with RecordWriter(tmp_path / "d" / "new.rec", index=False) as w:
        for k in range(3, 6):
            w.write(pack(float(k), imgs[k]))
    rec = tmp_path / "d" / "train.rec"
    rec.write_bytes(rec.read_bytes() + (tmp_path / "d" / "new.rec").read_bytes())
    (tmp_path / "d" / "new.rec").unlink()
    offsets = _offsets(rec)
    with open(rec.with_suffix(".idx"), "a") as fh:
        fh.write(f"7\t{offsets[4] + 16}\n")
    src = open_source(rec)
    assert {i.key: i.read() for i in src.items} == {
        **{f"train.rec/{k}": imgs[k] for k in range(3)}, **{f"train.rec/@{offsets[k]}": imgs[k] for k in range(3, 6)}}
    assert [s["key"] for s in src.skipped] == ["train.rec/7"]


def test_an_empty_idx_is_an_error_naming_it(tmp_path: Path) -> None:
    rec = write_rec(tmp_path / "d" / "train.rec", [(0.0, photos(1)[0])])
    rec.with_suffix(".idx").write_text("\n")
    with pytest.raises(SourceError, match=r"train\.idx lists no records; remove it to scan train\.rec"):
        open_source(rec)


_REC: dict[str, object] = {}


def _rec_for_property(root: Path) -> tuple[Path, list[int], int]:
    """Six records, one split in three parts (magic words in its image): each record's start and
    the file's size."""
    if not _REC:
        from recordio_writer import MAGIC_BYTES

        imgs = photos(6, seed=10)
        imgs[2] += b"\0" * (-(len(imgs[2]) + 24) % 4) + MAGIC_BYTES + b"abcd" + MAGIC_BYTES + b"end"
        rec = write_rec(root / "train.rec", [(float(i), im) for i, im in enumerate(imgs)])
        _REC.update(rec=rec, starts=_offsets(rec))
    rec = _REC["rec"]
    return rec, _REC["starts"], rec.stat().st_size


@settings(max_examples=150, deadline=None, derandomize=True)
@given(picks=st.lists(st.tuples(st.integers(0, 7), st.integers(-2, 300)), max_size=40))
def test_no_index_makes_the_samples_outgrow_the_file(tmp_path_factory, picks) -> None:
    """Any .idx (offsets of records, of parts inside a split record, of image bytes, repeated, out of
    the file): the samples' byte ranges never overlap, so together they are never more than the file."""
    rec, starts, size = _rec_for_property(tmp_path_factory.getbasetemp() / "prop")
    lines = []
    for k, (which, delta) in enumerate(picks):
        offset = starts[which] + 4 * delta if which < len(starts) else size + delta
        lines.append(f"{k}\t{offset}")
    rec.with_suffix(".idx").write_text("\n".join(lines) + "\n" if lines else "0\t0\n")
    src = open_source(rec)
    assert sum(i.size for i in src.items) <= size
    whole = sorted((i.offset, i.offset + i.size) for i in src.items if i.store is None)
    assert all(a[1] <= b[0] for a, b in zip(whole, whole[1:]))
    split = [i for i in src.items if i.store is not None]
    assert len(split) <= 1   # the one split record, read at most once
    assert len(src.items) <= 6
