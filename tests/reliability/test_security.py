"""Datasets are data: nothing in a shard or manifest is executed, no path leaves its root,
decompression bombs are refused by pixel count before any pixel is decoded."""

from __future__ import annotations

import ast
import io
import os
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from .rhelpers import jpeg_claiming, make_image_folder, png_header_only

import stoker
from stoker import codecs, open_dataset, open_loose
from stoker.errors import DecompressionBombError, ShardError, SourceError
from stoker.packing import PackOptions, pack
from stoker.sources import open_source

SRC = Path(stoker.__file__).resolve().parent
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def _violations(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"{where} from {node.module} import")
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            base = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
            if isinstance(fn, ast.Name) and name in FORBIDDEN_CALLS:
                found.append(f"{where} {name}()")
            if base in FORBIDDEN_MODULES or (base == "torch" and name == "load"):
                found.append(f"{where} {base}.{name}()")  # torch.load unpickles
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    found.append(f"{where} allow_pickle=")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in FORBIDDEN_MODULES:
            found.append(f"{where} {node.value.id}.{node.attr}")
    return found


# The process mode (Workers(processes=N)) hands its own spawned worker processes the Loader's RenderSpec
# and sends exceptions back, pickled over the private pipes between them: what multiprocessing's
# Connection does with every message anyway. No dataset byte is pickled or unpickled there; only
# these in-memory calls are allowed, in its two modules, the parent's side and the child's
# (docs/security.md).
PROCESS_HANDOFF = re.compile(r"(procs|proc_child)\.py:\d+ (import pickle|pickle\.(dumps|loads|HIGHEST_PROTOCOL)(\(\))?)")
# `stoker pack --engine ray` with a pack-time `map=` function: the user's own module is registered with Ray's
# cloudpickle so its workers get the function by value (Ray pickles every task's arguments anyway). It
# registers and unregisters a module; it unpickles nothing itself, in that one module only.
RAY_BY_VALUE = re.compile(r"ray_engine\.py:\d+ cloudpickle\.(un)?register_pickle_by_value(\(\))?")
ALLOWED = (PROCESS_HANDOFF, RAY_BY_VALUE)


def test_no_pickle_eval_exec_in_src():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 10
    bad = [v for f in files for v in _violations(f) if not any(a.fullmatch(v) for a in ALLOWED)]
    assert not bad, "datasets are data; nothing may be unpickled or evaluated: " + ", ".join(bad)


def test_the_process_handoff_allowance_admits_no_file_unpickling():
    assert PROCESS_HANDOFF.fullmatch("procs.py:12 pickle.loads()")
    assert PROCESS_HANDOFF.fullmatch("proc_child.py:119 pickle.loads()")
    for other in ("procs.py:12 pickle.load()", "procs.py:3 pickle.Unpickler", "reader.py:5 pickle.loads()",
                  "procs.py:7 eval()", "procs.py:9 import marshal", "proc_child.py:3 pickle.load()",
                  "my_procs.py:4 pickle.loads()"):
        assert not PROCESS_HANDOFF.fullmatch(other), other


def test_the_ray_allowance_admits_only_the_by_value_registration():
    assert RAY_BY_VALUE.fullmatch("ray_engine.py:90 cloudpickle.register_pickle_by_value()")
    for other in ("ray_engine.py:9 cloudpickle.loads()", "ray_engine.py:9 cloudpickle.load()",
                  "packing.py:9 cloudpickle.register_pickle_by_value()", "ray_engine.py:2 import cloudpickle"):
        assert not RAY_BY_VALUE.fullmatch(other), other


def test_the_scan_catches_what_it_forbids(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import pickle\nfrom marshal import loads\neval('1')\nexec('x=1')\n"
                     "import torch\ntorch.load('f')\nimport numpy as np\nnp.load('f', allow_pickle=True)\n")
    assert len(_violations(probe)) >= 6


# ---------------------------------------------------------------- paths

def test_symlinked_shard_pointing_outside_is_refused(small_pack, tmp_path):
    name = "shard-00000.arrow"
    outside = tmp_path / "elsewhere.arrow"
    (small_pack / name).rename(outside)
    (small_pack / name).symlink_to(outside)
    with pytest.raises(ShardError, match="outside the dataset"):
        open_dataset(small_pack)
    assert not stoker.verify(small_pack).ok


@pytest.mark.parametrize("kind", ["list", "csv"])
@pytest.mark.parametrize("where", ["../outside.jpg", "{abs}", "sub/../../outside.jpg", "link.jpg", "linkdir/x.jpg"])
def test_list_and_csv_are_trusted_and_root_only_shapes_keys(tmp_path, kind, where):
    """A user's own list may point anywhere (absolute paths, '..', links): that is what lists the
    field writes look like, and the user wrote it. root= decides keys; a path outside it has none."""
    root = tmp_path / "root"
    make_image_folder(root, n_per_class=1, classes=("a",))
    outside = tmp_path / "outside.jpg"
    outside.write_bytes((root / "a" / "000.jpg").read_bytes())
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "x.jpg").write_bytes(outside.read_bytes())
    (root / "link.jpg").symlink_to(outside)
    (root / "linkdir").symlink_to(tmp_path / "outdir")
    path = where.format(abs=outside)
    if kind == "list":
        listing = root / "train.txt"
        listing.write_text(f"a/000.jpg 0\n{path} 1\n")
    else:
        listing = root / "train.csv"
        listing.write_text(f"path,label\na/000.jpg,0\n{path},1\n")
    source = open_source(listing)
    assert source.items[1].read() == outside.read_bytes()
    lexically_inside = where in ("link.jpg", "linkdir/x.jpg")
    if lexically_inside:
        assert source.items[1].key == where
    else:
        assert source.items[1].key == outside.as_posix()
        with pytest.raises(SourceError, match="not under the root") as info:
            open_source(listing, root=root)
        assert info.value.line == (2 if kind == "list" else 3)  # the CSV's header is line 1


def test_folder_symlink_out_is_refused(tmp_path):
    root = make_image_folder(tmp_path / "root", n_per_class=1)
    (tmp_path / "secret.jpg").write_bytes((root / "cat" / "000.jpg").read_bytes())
    (root / "cat" / "leak.jpg").symlink_to(tmp_path / "secret.jpg")
    with pytest.raises(SourceError, match="outside the source root") as info:
        open_source(root)
    assert "for a tree you trust, write its images to a file list" in str(info.value)
    # the way the message names: a list of the trusted tree's files, links followed as written
    listing = tmp_path / "train.txt"
    listing.write_text("".join(f"{p} 0\n" for p in sorted(root.rglob("*.jpg"))))
    source = open_source(listing)
    assert any(item.key.endswith("leak.jpg") for item in source.items)


def test_tar_members_never_read_outside_the_tar(tmp_path):
    """Member names are data (keys), never paths: '../x' and '/abs' members are read from inside
    the tar; symlink and hard-link members, which could point anywhere, are ignored."""
    jpg = simplejpeg.encode_jpeg(np.full((32, 32, 3), 200, np.uint8), 90)
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(simplejpeg.encode_jpeg(np.zeros((32, 32, 3), np.uint8), 90))
    tar_path = tmp_path / "data.tar"
    with tarfile.open(tar_path, "w") as tf:
        for name in ("ok.jpg", "../escape.jpg", "/abs.jpg"):
            info = tarfile.TarInfo(name)
            info.size = len(jpg)
            tf.addfile(info, io.BytesIO(jpg))
        link = tarfile.TarInfo("link.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, str(secret)
        tf.addfile(link)
        hard = tarfile.TarInfo("hard.jpg")
        hard.type, hard.linkname = tarfile.LNKTYPE, "../secret.jpg"
        tf.addfile(hard)
    source = open_source(tar_path)
    assert sorted(i.key for i in source.items) == sorted(["ok.jpg", "../escape.jpg", "/abs.jpg"])
    out = tmp_path / "out"
    pack(source, out, options=PackOptions(workers=1, raw_below=0), progress=False)  # bytes kept as is
    assert not (tmp_path / "escape.jpg").exists() and not Path("/abs.jpg").exists()
    with open_dataset(out) as ds:
        for i in range(len(ds)):
            s = ds.sample(i)
            assert s.data.tobytes() == jpg, f"{s.key} was read from outside the tar"


# ---------------------------------------------------------------- bombs

@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_bombs_refused_before_decoding(fmt, monkeypatch):
    """A JPEG claiming 65,500 x 65,500 (JPEG's size fields stop at 65,535) and a PNG claiming
    100,000 x 100,000, through every entry point (a shard's encoding column is data too, so a PNG
    may arrive labelled "jpeg"): DecompressionBombError, and no decoder ever ran."""
    data = jpeg_claiming(65_500, 65_500) if fmt == "jpeg" else png_header_only(100_000, 100_000)
    decoded = []

    def fake_decode(*args, **kwargs):
        decoded.append("simplejpeg")
        raise ValueError("decoder must not run")
    monkeypatch.setattr(simplejpeg, "decode_jpeg", fake_decode)
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append("pillow"))
    for call in (lambda: codecs.probe(data, "bomb"), lambda: codecs.decode_pillow_rgb(data, "bomb"),
                 lambda: codecs.decode_rgb(data, "jpeg", "bomb"), lambda: codecs.decode_rgb(data, "png", "bomb")):
        with pytest.raises(DecompressionBombError, match="bomb"):
            call()
    # a PNG labelled "jpeg" reaches libjpeg-turbo, which rejects it at the signature (no pixels)
    assert decoded == ([] if fmt == "jpeg" else ["simplejpeg"]), decoded


def test_max_pixels_is_honoured_by_pack(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((100, 100, 3), np.uint8)).save(folder / "big.png")
    Image.fromarray(np.zeros((10, 10, 3), np.uint8)).save(folder / "small.png")
    out = tmp_path / "out"
    summary = pack(folder, out, kind="files", options=PackOptions(workers=1, max_pixels=5_000), progress=False)
    assert summary.packed == 1 and summary.skipped == 1
    assert "exceeds the limit of 5,000" in (out / "skipped.jsonl").read_text()


def test_manifest_cannot_name_files_outside(small_pack):
    import json
    manifest = small_pack / "stoker.json"
    obj = json.loads(manifest.read_text())
    for evil in ("../x.arrow", "/etc/passwd", ".hidden.arrow", "a/b.arrow", "x.arrow\x00", "C:\\x.arrow"):
        obj["shards"][0]["file"] = evil
        manifest.write_text(json.dumps(obj))
        with pytest.raises(stoker.errors.ManifestError, match="plain shard file name"):
            open_dataset(small_pack)
    assert os.path.exists(small_pack / "shard-00000.arrow")


# ---------------------------------------------------------------- Arrow extension types

def _rewrite_first_shard(root: Path, change) -> str:
    """Rewrite the first shard with ``change(table) -> table``, then update its manifest entry
    (size, SHA-256, columns checksum) so that only the schema can give it away."""
    import hashlib
    import json

    import pyarrow as pa

    from stoker.shards import MANIFEST_NAME, columns_digest

    manifest = json.loads((root / MANIFEST_NAME).read_text())
    entry = manifest["shards"][0]
    path = root / entry["file"]
    table = change(pa.ipc.open_file(pa.memory_map(str(path))).read_all())
    with pa.OSFile(str(path) + ".new", "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(str(path) + ".new", path)
    data = path.read_bytes()
    reader = pa.ipc.open_file(pa.py_buffer(data))
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                 columns_sha256=columns_digest([reader.get_batch(k) for k in range(reader.num_record_batches)]))
    (root / MANIFEST_NAME).write_text(json.dumps(manifest))
    return entry["file"]


def _py_extension_height(table):
    """The height column tagged as pyarrow 14.0.0's pickled "arrow.py_extension_type" (the shape
    of CVE-2023-47248: a fixed pyarrow reads it as plain int32 with the tag left in its metadata)."""
    import pyarrow as pa

    i = table.schema.get_field_index("height")
    tagged = table.schema.field(i).with_metadata({b"ARROW:extension:name": b"arrow.py_extension_type",
                                                  b"ARROW:extension:metadata": b"\x80\x04\x95 not run"})
    return table.set_column(i, tagged, table.column(i))


def _registered_extension_column(table):
    """An unlisted column of a registered extension type (UUID)."""
    import pyarrow as pa

    uuids = pa.ExtensionArray.from_storage(pa.uuid(), pa.array([bytes(16)] * len(table), pa.binary(16)))
    return table.append_column("evil", uuids)


def _nested_extension_label(table):
    import pyarrow as pa

    i = table.schema.get_field_index("label")
    tagged = pa.field("item", pa.int64(), metadata={b"ARROW:extension:name": b"arrow.py_extension_type"})
    labels = pa.array([[v] for v in table.column(i).to_pylist()], pa.list_(tagged))
    return table.set_column(i, pa.field("label", labels.type), labels)


@pytest.mark.parametrize("change, expected", [
    (_py_extension_height, "extension type 'arrow.py_extension_type'"),
    (_registered_extension_column, "extension type 'arrow.uuid'"),
    (_nested_extension_label, "extension type 'arrow.py_extension_type'"),
], ids=["pickled-extension-tag", "registered-extension", "nested-in-list"])
def test_shards_with_arrow_extension_types_are_refused(small_pack, change, expected):
    shard = _rewrite_first_shard(small_pack, change)
    with pytest.raises(ShardError, match=expected) as info:
        open_dataset(small_pack)
    assert shard in str(info.value) and "never writes" in str(info.value)
    assert not stoker.verify(small_pack).ok


def test_pyarrow_floor_excludes_the_unpickling_release():
    """pyarrow 14.0.0 unpickles extension metadata while reading a file, before stoker sees the
    schema (CVE-2023-47248); the dependency floor must exclude it."""
    import re

    from packaging.requirements import Requirement

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    line = re.search(r'"(pyarrow[^"]*)"', pyproject).group(1)
    spec = Requirement(line).specifier
    assert "14.0.0" not in spec and "13.0.0" not in spec and "14.0.1" in spec, line
