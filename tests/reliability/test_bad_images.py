"""Bad images through pack and through the loose-file Loader: 0 crashes, 0 hangs; each file is
either a correct RGB sample or a skip that is logged with its reason.

The generated set (rhelpers.hostile_files) holds truncated, bit-flipped, empty, text, bomb,
broken-CRC, CMYK, 16-bit and animated files; Pillow's test corpus adds hundreds more. The corpus
runs in a child process under a time limit and an address-space limit, so a decoder crash or a
runaway allocation fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from .rhelpers import CORPUS, CORPUS_MISSING, GOOD_SHAPE, reference_rgb, run_child

from stoker import CenterCrop, Loader, codecs, open_dataset, verify
import stoker
from stoker.errors import ImageError, SampleError
from stoker.packing import SKIPPED_NAME, PackOptions, pack

LOADER_TIMEOUT_S = 30.0  # per batch; a few 40x48 images take milliseconds
CROP = CenterCrop(GOOD_SHAPE)  # the whole valid image, unscaled: pixels compare exactly


def _skipped(out: Path) -> dict[str, str]:
    lines = (out / SKIPPED_NAME).read_text().splitlines()
    return {json.loads(line)["key"]: json.loads(line)["reason"] for line in lines}


def test_pack_hostile_files(hostile_folder, tmp_path):
    folder, files = hostile_folder
    out = tmp_path / "out"
    summary = pack(folder, out, kind="files", options=PackOptions(workers=2, raw_below=0), progress=False)
    skipped = _skipped(out)
    with open_dataset(out) as ds:
        packed = {ds.sample(i).key: i for i in range(len(ds))}
        assert set(packed) | set(skipped) == set(files), "every file is packed or skipped"
        assert not set(packed) & set(skipped)
        assert summary.packed + summary.skipped == len(files)
        for name, (data, expected) in files.items():
            if expected == "skip":
                assert name in skipped and skipped[name], f"{name} must be skipped with a reason"
            elif expected == "ok":
                assert name in packed, f"{name} is a valid image and must be packed: {skipped.get(name)}"
                s = ds.sample(packed[name])
                got = codecs.decode_rgb(s.data, s.encoding, s.key, height=s.height, width=s.width)
                ref = reference_rgb(data).astype(np.int16)
                assert got.shape == ref.shape and got.dtype == np.uint8
                # pack's promise for re-encoded samples (docs/packing.md): >= 30 dB PSNR
                mse = float(((got - ref).astype(np.float64) ** 2).mean())
                assert mse == 0 or 10 * np.log10(255**2 / mse) >= 30.0, name
    assert "pixels exceeds the limit" in skipped["bomb_png.png"] or "bomb" in skipped["bomb_png.png"]
    assert "empty" in skipped["zero.jpg"]
    assert verify(out, decode=True).ok, "whatever was packed decodes"


def _loader_one(path: Path, on_error: str) -> tuple[str, object]:
    """One file through a loose Loader of its own: ("ok", pixels) or ("error", SampleError)."""
    listing = path.parent / f".{path.name}.txt"
    listing.write_text(f"{path.name} 0\n")
    try:
        with Loader(listing, 1, transforms=[CROP], order="sequential",
                    timeout=LOADER_TIMEOUT_S, workers=stoker.Workers(num_threads=1, on_error=on_error)) as loader:
            (images, labels), = [(x.clone(), y.clone()) for x, y in loader]
        return "ok", images[0].numpy()
    except SampleError as exc:
        return "error", exc
    finally:
        listing.unlink()


def test_loose_loader_raise_each_file(hostile_folder):
    """on_error="raise", one file at a time: a valid file comes out as its exact RGB pixels, a bad
    one as a SampleError naming the file, with an ImageError (the reason) as its cause."""
    folder, files = hostile_folder
    for name, (data, expected) in files.items():
        outcome, value = _loader_one(folder / name, "raise")
        if outcome == "error":
            assert expected != "ok", f"{name}: {value}"
            assert value.key == name and name in str(value)
            assert isinstance(value.__cause__, ImageError) and value.__cause__.reason
        else:
            assert expected != "skip", f"{name} must be refused"
            assert value.shape == (3, *GOOD_SHAPE) and value.dtype == np.uint8
            if expected == "ok":
                assert np.abs(value.transpose(1, 2, 0).astype(np.int16) - reference_rgb(data)).max() <= 1, name


def test_loose_loader_skip_logs_each_bad_file(hostile_folder, caplog):
    """on_error="skip" over the whole folder: the epoch completes with every position filled, and
    each bad file is one warning naming it and the reason — the same files "raise" refuses."""
    folder, files = hostile_folder
    refused = {name for name in files if _loader_one(folder / name, "raise")[0] == "error"}
    assert refused >= {n for n, (_, e) in files.items() if e == "skip"}
    caplog.set_level(logging.WARNING, logger="stoker")
    with Loader(folder, 8, transforms=[CROP], order="sequential",
                timeout=LOADER_TIMEOUT_S, workers=stoker.Workers(num_threads=2, on_error="skip")) as loader:
        rows = sum(x.shape[0] for x, _ in loader)
        assert rows == len(files)
        assert loader.stats.skipped == len(refused)
        assert set(loader.stats.skipped_keys) == refused
    logged = {r.getMessage() for r in caplog.records if "on_error='skip'" in r.getMessage()}
    assert len(logged) == len(refused)
    for name in refused:
        assert any(f"'{name}'" in m and "Error" in m for m in logged), name


_CORPUS_CHILD = r"""
import json, logging, resource, shutil, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway allocation fails, not the machine
from stoker import Loader, RandomResizedCrop
import stoker
from stoker.packing import PackOptions, pack
from stoker.sources import IMAGE_EXTENSIONS
corpus, work = Path(sys.argv[1]), Path(sys.argv[2])
flat = work / "flat"
flat.mkdir()
for k, p in enumerate(sorted(q for q in corpus.rglob("*") if q.is_file())):
    if p.suffix.lower() in IMAGE_EXTENSIONS:
        shutil.copyfile(p, flat / f"{k:04d}_{p.name}")
names = sorted(p.name for p in flat.iterdir())
summary = pack(flat, work / "out", kind="files", options=PackOptions(workers=2), progress=False)
reasons = [json.loads(l)["reason"] for l in (work / "out" / "skipped.jsonl").read_text().splitlines()]
warned = []
class Keep(logging.Handler):
    def emit(self, record):
        warned.append(record.getMessage())
logging.getLogger("stoker").addHandler(Keep())
with Loader(flat, 16, transforms=[RandomResizedCrop(24)], timeout=60, workers=stoker.Workers(num_threads=2, on_error="skip")) as ld:
    rows = sum(x.shape[0] for x, _ in ld)
    stats = ld.stats
print(json.dumps({"files": len(names), "packed": summary.packed, "skipped": summary.skipped,
                  "reasons": reasons, "rows": rows, "loader_skipped": stats.skipped, "warned": warned}))
"""


def test_pillow_corpus_through_pack_and_loose_loader(tmp_path):
    if not CORPUS.is_dir():
        pytest.skip(CORPUS_MISSING)
    proc = run_child(_CORPUS_CHILD, str(CORPUS), str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["files"] > 400
    assert got["packed"] + got["skipped"] == got["files"]
    assert got["skipped"] > 10 and all(got["reasons"]), "the corpus has bad files; each skip has a reason"
    assert got["rows"] == got["files"], "skip mode fills every position of the epoch"
    assert got["loader_skipped"] == len(got["warned"]) > 10
    assert all("Error" in w for w in got["warned"])
