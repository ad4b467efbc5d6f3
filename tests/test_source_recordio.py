"""MXNet RecordIO source: files MXNet 1.9.1 wrote (tests/fixtures/recordio), the spec writer checked
against them byte for byte, and damaged framing: skips naming the record, or errors naming the line."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from formats_helpers import CORRUPT_JPEG, pack_and_read, photos, read_shards, skipped
from recordio_writer import MAGIC_BYTES, RecordWriter, pack, part, write_rec

from stoker import Loader
from stoker.cli import main
from stoker.errors import SourceError
from stoker.packing import PackOptions
from stoker.packing import pack as stoker_pack
from stoker.sources import open_source
from stoker.transforms import Resize

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "recordio"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
KEEP_BYTES = PackOptions(workers=1, raw_below=0)   # the fixture's 16x24 JPEGs stay JPEG, byte for byte


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pack(src: Path, out: Path) -> tuple[dict, dict]:
    stoker_pack(src, out, options=KEEP_BYTES, progress=False)
    return read_shards(out), json.loads((out / "stoker.json").read_text())


@pytest.mark.parametrize("name, src, label_type", [
    ("imagenet", "imagenet/train.rec", "int64"), ("scores", "scores.rec", "float64"),
    ("vector", "vector.rec", "list<float64>"), ("faces", "faces", "int64")])
def test_mxnet_written_files_pack_byte_for_byte_with_labels(tmp_path: Path, name: str, src: str,
                                                            label_type: str) -> None:
    """Every image MXNet wrote comes back byte for byte with its label: whole float labels as class
    ids, other scalars as floats, vectors as float rows; a record MXNet split at magic words is
    rejoined; the InsightFace header and identity records are no samples, what they say is kept."""
    rows, manifest = _pack(FIXTURE / src, tmp_path / "out")
    expected = EXPECTED[name]["images"] if name == "faces" else EXPECTED[name]
    file = name if name in ("scores", "vector") else "train"
    assert {k: (_sha(r["image"]), r["label"]) for k, r in rows.items()} == {
        f"{file}.rec/{k}": (e["sha256"], e["label"]) for k, e in expected.items()}
    assert {r["encoding"] for r in rows.values()} == {"jpeg"}
    assert manifest["label_type"] == label_type and manifest["pack_options"]["source_kind"] == "recordio"
    if name == "faces":
        assert "InsightFace layout in train.rec: header record 0 lists images 1..6 and 3 identities" in \
            manifest["pack_options"]["source"]
        assert "property: 3 identities, images 16x24" in manifest["pack_options"]["source"]
        assert not (tmp_path / "out" / "skipped.jsonl").exists() or not skipped(tmp_path / "out")


def test_split_record_is_the_one_mxnet_split(tmp_path: Path) -> None:
    """Key 3 of the im2rec-style file is stored in three parts (flags 1, 2, 3): the reader puts back
    the two magic words the writer took out of its JPEG's comment."""
    src = open_source(FIXTURE / "imagenet" / "train.rec")
    item = next(i for i in src.items if i.key == "train.rec/3")
    data = item.read()
    assert item.store is not None and data.count(MAGIC_BYTES) == 2 and _sha(data) == EXPECTED["imagenet"]["3"]["sha256"]


def _images(path: Path) -> dict[str, bytes]:
    return {i.key: i.read() for i in open_source(path).items}


def test_spec_writer_rewrites_mxnets_files_byte_for_byte(tmp_path: Path) -> None:
    """The test writer, given the images and headers MXNet stored, writes the very same .rec and .idx
    bytes: it is a faithful stand-in for MXNet in the damage tests below."""
    imagenet = _images(FIXTURE / "imagenet" / "train.rec")
    assert {k: _sha(v) for k, v in imagenet.items()} == {f"train.rec/{k}": e["sha256"]
                                                         for k, e in EXPECTED["imagenet"].items()}
    ours = write_rec(tmp_path / "imagenet" / "train.rec",
                     [(float(EXPECTED["imagenet"][str(k)]["label"]), imagenet[f"train.rec/{k}"]) for k in range(6)])
    for suffix in (".rec", ".idx"):
        assert ours.with_suffix(suffix).read_bytes() == (FIXTURE / "imagenet" / f"train{suffix}").read_bytes()
    for name, label in (("scores", float), ("vector", list)):
        images = _images(FIXTURE / f"{name}.rec")
        with RecordWriter(tmp_path / f"{name}.rec", index=False) as w:
            for k, e in EXPECTED[name].items():
                w.write(pack(label(e["label"]), images[f"{name}.rec/{k}"], e["id"]))
        assert (tmp_path / f"{name}.rec").read_bytes() == (FIXTURE / f"{name}.rec").read_bytes()
    faces = _images(FIXTURE / "faces")
    first, end = EXPECTED["faces"]["header"]
    ranges = {0: [1, 4], 1: [4, 6], 2: [6, 7]}
    with RecordWriter(tmp_path / "faces" / "train.rec") as w:
        for k, e in EXPECTED["faces"]["images"].items():
            w.write(pack(float(e["label"]), faces[f"train.rec/{k}"], int(k)), k)
        for identity in range(3):
            w.write(pack(ranges[identity], b"", first + identity), first + identity)
        w.write(pack([first, end], b"", 0), 0)
    for name in ("train.rec", "train.idx"):
        assert (tmp_path / "faces" / name).read_bytes() == (FIXTURE / "faces" / name).read_bytes()


def test_without_idx_a_scan_gives_the_same_images(tmp_path: Path) -> None:
    """No .idx: records in file order, keyed by their number; the InsightFace header (written last,
    found by its IRHeader id 0) and identity records are still recognized."""
    shutil.copy(FIXTURE / "imagenet" / "train.rec", tmp_path / "train.rec")
    assert _images(tmp_path / "train.rec") == _images(FIXTURE / "imagenet" / "train.rec")
    (tmp_path / "faces").mkdir()
    shutil.copy(FIXTURE / "faces" / "train.rec", tmp_path / "faces" / "train.rec")
    src = open_source(tmp_path / "faces")
    assert [i.label for i in src.items] == [0, 0, 0, 1, 1, 2] and not src.skipped
    assert [_sha(i.read()) for i in src.items] == [e["sha256"] for e in EXPECTED["faces"]["images"].values()]
    assert "3 identities" in src.description


def test_cli_pack_info_verify_and_loader_with_labels(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, soft = tmp_path / "out", tmp_path / "soft"
    assert main(["pack", str(FIXTURE / "imagenet" / "train.rec"), str(out), "--no-progress", "--raw-below", "0"]) == 0
    assert main(["info", str(out)]) == 0
    assert "RecordIO" in capsys.readouterr().out
    assert main(["verify", str(out), "--decode"]) == 0
    with Loader(out, 6, transforms=[Resize((16, 16))], order="sequential", workers=1) as loader:
        (images, labels), = list(loader)
    assert images.shape[0] == 6 and labels.tolist() == [0, 1, 2, 1, 0, 2]
    assert main(["pack", str(FIXTURE / "vector.rec"), str(soft), "--no-progress"]) == 0
    with Loader(soft, 3, transforms=[Resize((16, 16))], order="sequential", workers=1) as loader:
        (_, targets), = list(loader)
    assert targets.dtype == torch.float32 and torch.equal(targets, torch.tensor(
        [e["label"] for e in EXPECTED["vector"].values()], dtype=torch.float32))


def test_detection_by_name_content_index_and_folder(tmp_path: Path) -> None:
    imgs = photos(2)
    write_rec(tmp_path / "a" / "part0.rec", [(0.0, imgs[0])], index=False)
    write_rec(tmp_path / "a" / "part1.rec", [(1.0, imgs[1])])
    (tmp_path / "a" / "part0.rec").rename(tmp_path / "a" / "noname")   # recognized by its first header
    assert open_source(tmp_path / "a" / "noname").kind == "recordio"
    assert [i.key for i in open_source(tmp_path / "a" / "part1.idx").items] == ["part1.rec/0"]
    (tmp_path / "a" / "noname").rename(tmp_path / "a" / "part0.rec")
    src = open_source(tmp_path / "a")
    assert src.kind == "recordio" and [(i.key, i.label) for i in src.items] == [("part0.rec/0", 0), ("part1.rec/0", 1)]
    assert "2 files" in src.description


# ---------------------------------------------------------------- damage

def _five(tmp_path: Path, index: bool, images: list[bytes] | None = None) -> tuple[Path, list[int]]:
    """A .rec of five photos (labels 0..4); the byte offset of each record."""
    imgs = images or photos(5, seed=3)
    rec = write_rec(tmp_path / "d" / "train.rec", [(float(i), imgs[i]) for i in range(5)], index=index)
    offsets, pos, data = [], 0, rec.read_bytes()
    while pos < len(data):
        offsets.append(pos)
        (lrec,) = struct.unpack_from("<I", data, pos + 4)
        pos += 8 + (((lrec & ((1 << 29) - 1)) + 3) & ~3)
    return rec, offsets


def _patch(path: Path, offset: int, payload: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + len(payload)] = payload
    path.write_bytes(bytes(data))


def _lrec(path: Path, offset: int) -> int:
    return struct.unpack_from("<I", path.read_bytes(), offset + 4)[0]


@pytest.mark.parametrize("index", [False, True])
@pytest.mark.parametrize("damage, reason", [
    ("bad magic", "no RecordIO magic word"),
    ("longer length", "does not end at another record header|running past byte .* where the .idx starts the next"),
    ("shorter length", "does not end at another record header"), ("huge length", "truncated"),
    ("bad part flag", "part flag 5"), ("never ending chain", "part flag 0 at byte"),
    ("huge label vector", "announces 4294967295 label values"), ("nan label", "not a finite number")])
def test_damaged_record_is_skipped_by_key_and_the_rest_packs(tmp_path: Path, index: bool, damage: str,
                                                             reason: str) -> None:
    """One damaged record (record 2) costs that record only, with a skipped.jsonl line naming it;
    the scan (no .idx) goes on at the next header, the index reads the others directly."""
    imgs = photos(5, seed=3)
    rec, offsets = _five(tmp_path, index, imgs)
    at = offsets[2]
    lrec = _lrec(rec, at)
    payload = {"bad magic": b"\x0b\x23\xd7\xce",
               "longer length": struct.pack("<II", 0xCED7230A, lrec + 16 * 4 + 700),
               "shorter length": struct.pack("<II", 0xCED7230A, lrec - 64),
               "huge length": struct.pack("<II", 0xCED7230A, (1 << 29) - 1),
               "bad part flag": struct.pack("<II", 0xCED7230A, 5 << 29 | lrec),
               "never ending chain": struct.pack("<II", 0xCED7230A, 1 << 29 | lrec),
               "huge label vector": struct.pack("<II", 0xCED7230A, lrec) + struct.pack("<I", 0xFFFFFFFF),
               "nan label": struct.pack("<II", 0xCED7230A, lrec) + struct.pack("<If", 0, float("nan"))}[damage]
    _patch(rec, at, payload)
    rows, _ = pack_and_read(rec, tmp_path / "out")
    assert {k: (r["image"], r["label"]) for k, r in rows.items()} == {
        f"train.rec/{i}": (imgs[i], i) for i in (0, 1, 3, 4)}
    reasons = skipped(tmp_path / "out")
    assert list(reasons) == ["train.rec/2"] and re.search(reason, reasons["train.rec/2"]), reasons


def test_truncated_last_record_and_trailing_garbage(tmp_path: Path) -> None:
    imgs = photos(5, seed=3)
    rec, offsets = _five(tmp_path, False, imgs)
    data = rec.read_bytes()
    rec.write_bytes(data[:offsets[4] + 100])
    src = open_source(rec)
    assert [i.key for i in src.items] == [f"train.rec/{i}" for i in range(4)]
    assert [(s["key"], "truncated" in s["reason"]) for s in src.skipped] == [("train.rec/4", True)]
    rec.write_bytes(data + b"\0" * 13)   # junk after the last record: as if its length were too short
    src = open_source(rec)
    assert [i.key for i in src.items] == [f"train.rec/{i}" for i in range(4)]
    assert [s["key"] for s in src.skipped] == ["train.rec/4"]
    assert f"bytes {offsets[4]}..{len(data) + 13} could not be read" in src.skipped[0]["reason"]


def test_split_records_written_by_the_spec_writer_and_a_broken_chain(tmp_path: Path) -> None:
    """Images whose bytes hold the magic word at aligned offsets are split into parts and read back
    whole; a chain cut short by the end of the file is a skip, not a hang."""
    imgs = photos(3, seed=4)
    crafted = [imgs[0], imgs[1] + b"\0" * (-(len(imgs[1]) + 24) % 4) + MAGIC_BYTES * 3 + b"tail", imgs[2]]
    rec = write_rec(tmp_path / "s.rec", [(float(i), b) for i, b in enumerate(crafted)], index=False)
    assert [i.read() for i in open_source(rec).items] == crafted
    cut = RecordWriter(tmp_path / "cut.rec", index=False)
    cut.write(pack(0.0, imgs[0]))
    cut.append(part(1, pack(1.0, imgs[1])[:400]) + part(2, b"more"))   # the chain's last part never comes
    cut.close()
    src = open_source(tmp_path / "cut.rec")
    assert [i.key for i in src.items] == ["cut.rec/0"]
    assert "its last part is missing" in src.skipped[0]["reason"]


def test_bad_idx_offsets_skip_their_keys(tmp_path: Path) -> None:
    imgs = photos(5, seed=3)
    rec, offsets = _five(tmp_path, True, imgs)
    size = rec.stat().st_size
    lines = [f"{k}\t{o}" for k, o in enumerate(offsets)]
    lines[1] = f"1\t{offsets[1] + 2}"        # not a multiple of 4
    lines[2] = f"2\t{offsets[2] + 64}"       # aligned, inside image data
    lines[3] = f"3\t{size + 4096}"           # outside the file
    lines.append(f"9\t{-8}")                 # negative
    rec.with_suffix(".idx").write_text("\n".join(lines) + "\n")
    rows, _ = pack_and_read(rec, tmp_path / "out")
    # the records those lines miss are still in the .rec: packed, keyed by their byte offset
    assert {k: r["image"] for k, r in rows.items()} == {"train.rec/0": imgs[0], "train.rec/4": imgs[4],
                                                        **{f"train.rec/@{offsets[k]}": imgs[k] for k in (1, 2, 3)}}
    reasons = skipped(tmp_path / "out")
    assert set(reasons) == {"train.rec/1", "train.rec/2", "train.rec/3", "train.rec/9"}
    assert "line 2 gives byte offset" in reasons["train.rec/1"] and "line 4" in reasons["train.rec/3"]
    assert "no RecordIO magic word" in reasons["train.rec/2"]


@pytest.mark.parametrize("text, message", [
    ("0\t0\n1 x\n", "line 2: expected '<key><TAB><byte offset>'"),
    ("0\t0\n1\t--8\n", "line 2: expected '<key><TAB><byte offset>'"),
    ("0\t0\n1\t\u00b2\n", "line 2: expected '<key><TAB><byte offset>'"),
    ("0\t0\n0\t0\n", "line 2: key '0' is already listed on line 1")])
def test_malformed_idx_is_an_error_naming_the_line(tmp_path: Path, text: str, message: str) -> None:
    rec, _ = _five(tmp_path, True)
    rec.with_suffix(".idx").write_text(text)
    with pytest.raises(SourceError, match=message):
        open_source(rec)


def test_records_without_image_bytes_outside_insightface_are_skipped(tmp_path: Path) -> None:
    imgs = photos(2, seed=5)
    with RecordWriter(tmp_path / "e.rec", index=False) as w:
        w.write(pack(0.0, imgs[0]))
        w.write(pack([3.0, 9.0], b"", 1))     # a header-like record, but not record 0: no InsightFace layout
        w.write(struct.pack("<IfQ", 0, 1.0, 2))   # 20 bytes: shorter than an IRHeader
        w.write(pack(1.0, CORRUPT_JPEG))
        w.write(pack(1.0, imgs[1]))
    rows, _ = pack_and_read(tmp_path / "e.rec", tmp_path / "out")
    assert {k: r["label"] for k, r in rows.items()} == {"e.rec/0": 0, "e.rec/4": 1}
    reasons = skipped(tmp_path / "out")
    assert "no image bytes" in reasons["e.rec/1"] and "shorter than its 24-byte IRHeader" in reasons["e.rec/2"]
    assert "e.rec/3" in reasons   # listed, refused by the decoder


def test_insightface_vector_labels_take_the_identity(tmp_path: Path) -> None:
    """InsightFace images labelled with a vector are labelled by its first value (as its reader does);
    outside that layout a vector stays a float row, and a scalar beside vectors becomes a 1-value row."""
    imgs = photos(3, seed=6)
    with RecordWriter(tmp_path / "f" / "train.rec") as w:
        for k in (1, 2):
            w.write(pack([float(k - 1), 0.5], imgs[k], k), k)
        w.write(pack([1, 2], b"", 3), 3)
        w.write(pack([2, 3], b"", 4), 4)
        w.write(pack([3, 5], b"", 0), 0)
    src = open_source(tmp_path / "f")
    assert [(i.key, i.label) for i in src.items] == [("train.rec/1", 0), ("train.rec/2", 1)]
    assert src.label_type == "int64" and not src.skipped
    write_rec(tmp_path / "m.rec", [([0.5, 0.5], imgs[0]), (2.0, imgs[1])])
    src = open_source(tmp_path / "m.rec")
    assert src.label_type == "list<float64>" and [i.label for i in src.items] == [[0.5, 0.5], [2.0]]


def test_labels_off_property_errors_and_label_column(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rec, _ = _five(tmp_path, True)
    assert open_source(rec, label_column=None).label_type == "none"
    with pytest.raises(SourceError, match="label_column=None"):
        open_source(rec, label_column="cls")
    assert main(["pack", str(rec), str(tmp_path / "o"), "--label-column", "cls", "--no-progress"]) == 2
    assert "--no-labels" in capsys.readouterr().err
    (rec.parent / "property").write_text("many,112,112")
    with pytest.raises(SourceError, match="property.*expected '<identities>,<height>,<width>'"):
        open_source(rec)


def test_idx_catches_a_length_that_lands_on_a_later_header(tmp_path: Path) -> None:
    """A length damaged so that it ends exactly at a later record's header frames cleanly; the
    .idx still says where the next record starts, so the record is skipped and none is swallowed."""
    imgs = photos(5, seed=3)
    rec, offsets = _five(tmp_path, True, imgs)
    _patch(rec, offsets[2] + 4, struct.pack("<I", offsets[4] - offsets[2] - 8))
    src = open_source(rec)
    assert {i.key: i.read() for i in src.items} == {f"train.rec/{i}": imgs[i] for i in (0, 1, 3, 4)}
    assert [s["key"] for s in src.skipped] == ["train.rec/2"]
    assert f"running past byte {offsets[3]}" in src.skipped[0]["reason"]


def test_loader_reads_a_rec_file_without_packing() -> None:
    with Loader(FIXTURE / "faces" / "train.rec", 6, transforms=[Resize((16, 16))], order="sequential",
                workers=1) as loader:
        (images, labels), = list(loader)
    assert images.shape == (6, 3, 16, 16) and labels.tolist() == [0, 0, 0, 1, 1, 2]


_MAGIC_HEAVY = st.lists(st.sampled_from([MAGIC_BYTES, b"\x0a", b"\x23\xd7", b"\xce", b"\0", b"jpeg"]),
                        max_size=12).map(b"".join)


@settings(max_examples=60, deadline=None)
@given(payloads=st.lists(_MAGIC_HEAVY.filter(bool), min_size=1, max_size=6), index=st.booleans())
def test_any_payload_round_trips_through_framing(tmp_path_factory, payloads: list[bytes], index: bool) -> None:
    """Whatever the bytes (magic words at any offset, aligned or not, at the start or the end), a
    record written by the spec writer reads back whole, keyed in order, with nothing skipped."""
    rec = write_rec(tmp_path_factory.mktemp("p") / "p.rec", [(float(i), p) for i, p in enumerate(payloads)],
                    index=index)
    src = open_source(rec)
    assert [(i.key, i.label, i.read()) for i in src.items] == [
        (f"p.rec/{i}", i, p) for i, p in enumerate(payloads)] and not src.skipped
