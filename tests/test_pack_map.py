"""`PackOptions(map=fn)`: the user's function per sample at pack time. Changed, several or dropped
samples land in the shards in source order (the same for any worker count); its failures are skips
with their reason; a resume notices a changed function; the example in docs/packing.md runs."""

from __future__ import annotations

import json
import shutil
import sys
import re
from pathlib import Path

import numpy as np
import pytest

import stoker.pack_work as work
from stoker.errors import ConfigError, MapFunctionError
from stoker.pack_map import PackSample, function_fingerprint
from stoker.packing import JOURNAL_NAME, SKIPPED_NAME, PackOptions, pack
from stoker.reader import open_dataset

from conftest import make_image_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("map") / "imgs", n_per_class=4)   # 12 JPEGs, 3 classes


def _rows(path: Path) -> list[tuple]:
    with open_dataset(path, verify=True) as ds:
        return [(s.key, int(s.label), bytes(s.data)) for s in (ds.sample(i) for i in range(len(ds)))]


def _pixels(path: Path) -> dict[str, np.ndarray]:
    with open_dataset(path) as ds:
        return {ds.sample(i).key: np.asarray(ds[i][0]) for i in range(len(ds))}


def relabel_drop_split(s: PackSample):
    """class 0 dropped, class 1 relabelled to 2, class 2 split into two halves (left, right)."""
    if s.label == 0:
        return None
    if s.label == 1:
        return s.replace(label=2)
    w = s.image.shape[1] // 2
    return [s.replace(key=s.key + "#left", image=s.image[:, :w]), s.replace(key=s.key + "#right", image=s.image[:, w:])]


def test_changed_several_and_dropped_samples(folder: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    pack(folder, plain, options=PackOptions(workers=1), progress=False)
    summary = pack(folder, tmp_path / "mapped", options=PackOptions(workers=1, map=relabel_drop_split), progress=False)
    assert (summary.packed, summary.dropped, summary.skipped) == (4 + 8, 4, 0)
    assert "4 dropped by the pack function" in summary.format()
    before, after = _rows(plain), _rows(tmp_path / "mapped")
    # class 1 kept byte for byte (the function read no pixels) under its new label, in source order
    assert [(k, 2, d) for k, y, d in before if y == 1] == [r for r in after if not r[0].endswith(("left", "right"))]
    originals = {k: px for k, px in _pixels(plain).items()}
    halves = _pixels(tmp_path / "mapped")
    for key, px in originals.items():
        if key.startswith("eel/"):
            w = px.shape[1] // 2
            left, right = halves[key + "#left"], halves[key + "#right"]
            assert left.shape[:2] == (px.shape[0], w) and right.shape[1] == px.shape[1] - w
            # re-encoded (JPEG) halves of the decoded original: close to its pixels
            assert np.abs(left.astype(int) - px[:, :w]).mean() < 4
    keys = [k for k, _, _ in after]
    assert keys.index("eel/000.jpg#left") + 1 == keys.index("eel/000.jpg#right")
    assert json.loads((tmp_path / "mapped" / "stoker.json").read_text())["pack_options"]["map"] == \
        function_fingerprint(relabel_drop_split)


def test_output_is_the_same_for_any_worker_count(folder: Path, tmp_path: Path) -> None:
    for workers in (1, 3):
        pack(folder, tmp_path / f"w{workers}", options=PackOptions(workers=workers, map=relabel_drop_split),
             progress=False)
    assert _rows(tmp_path / "w1") == _rows(tmp_path / "w3")


def picky(s: PackSample):
    if s.key.endswith("001.jpg"):
        raise RuntimeError("no thanks")
    if s.key.endswith("002.jpg"):
        return s.replace(label=99)        # outside the 3 classes
    if s.key.endswith("003.jpg"):
        return {"key": s.key}             # not a PackSample
    return s


def test_failures_are_skips_with_their_reason(folder: Path, tmp_path: Path) -> None:
    summary = pack(folder, tmp_path / "out", options=PackOptions(workers=2, map=picky), progress=False)
    assert (summary.packed, summary.skipped) == (3, 9)
    skipped = [json.loads(line) for line in (tmp_path / "out" / SKIPPED_NAME).read_text().splitlines()]
    reasons = {s["key"]: s["reason"] for s in skipped}
    assert "map function picky raised RuntimeError: no thanks (at " in reasons["cat/001.jpg"]
    assert "test_pack_map.py" in reasons["cat/001.jpg"]
    assert "label 99, outside the 3 classes" in reasons["dog/002.jpg"]
    assert "returned a dict; expected the PackSample" in reasons["eel/003.jpg"]
    with pytest.raises(MapFunctionError, match="cat/001.jpg: map function picky raised RuntimeError"):
        pack(folder, tmp_path / "fail", options=PackOptions(workers=1, map=picky, on_error="fail"), progress=False)


def double_label(s: PackSample):
    return s.replace(label=(s.label + 1) % 3)


def shift_label(s: PackSample):
    return s.replace(label=(s.label + 2) % 3)


def _ctrl_c_at_the_tenth_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack is interrupted (KeyboardInterrupt) as its tenth sample starts, leaving a journal to resume."""
    real, calls = work._process_one, []

    def cut(entry, w):
        calls.append(entry)
        if len(calls) == 10:
            raise KeyboardInterrupt
        return real(entry, w)
    monkeypatch.setattr(work, "_process_one", cut)


def test_resume_notices_a_changed_function(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opts = PackOptions(workers=1, shard_size=1, map=double_label)   # one sample per shard
    full = tmp_path / "full"
    pack(folder, full, options=opts, progress=False)
    out = tmp_path / "cut"
    _ctrl_c_at_the_tenth_sample(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        pack(folder, out, options=opts, progress=False)
    monkeypatch.undo()
    assert (out / JOURNAL_NAME).exists()
    with pytest.raises(ConfigError, match="map: was '[0-9a-f]{64}', now '[0-9a-f]{64}'.*the pack function changed"):
        pack(folder, out, options=PackOptions(workers=1, shard_size=1, map=shift_label), progress=False, resume=True)
    summary = pack(folder, out, options=opts, progress=False, resume=True)
    assert summary.resumed > 0 and _rows(out) == _rows(full)
    # a finished pack made with another function is refused too, not silently kept
    with pytest.raises(ConfigError, match="other options.*map: was"):
        pack(folder, out, options=PackOptions(workers=1, shard_size=1, map=shift_label), progress=False, resume=True)


def test_a_named_fingerprint_overrides_the_computed_one(folder: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The user declares a new version of the function the same (map_fingerprint="v1"): resume takes it."""
    out = tmp_path / "out"
    _ctrl_c_at_the_tenth_sample(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        pack(folder, out, options=PackOptions(workers=1, shard_size=1, map=double_label, map_fingerprint="v1"),
             progress=False)
    monkeypatch.undo()
    rewritten = lambda s: s.replace(label=(1 + s.label) % 3)   # noqa: E731 (the same output, other code)
    summary = pack(folder, out, options=PackOptions(workers=1, shard_size=1, map=rewritten, map_fingerprint="v1"),
                   progress=False, resume=True)
    assert summary.packed == 12 and json.loads((out / "stoker.json").read_text())["pack_options"]["map"] == "v1"


def test_fingerprint_follows_code_constants_and_closures() -> None:
    def make(k: int):
        return lambda s: s.replace(label=k)

    def helper_user(s):
        return _helper(s)
    assert function_fingerprint(make(1)) == function_fingerprint(make(1))
    assert function_fingerprint(make(1)) != function_fingerprint(make(2))   # a closure value
    assert function_fingerprint(double_label) != function_fingerprint(shift_label)   # a constant
    before = function_fingerprint(helper_user)
    global _helper
    old = _helper
    _helper = lambda s: None   # noqa: E731 (a changed helper of the same module counts)
    try:
        assert function_fingerprint(helper_user) != before
    finally:
        _helper = old
    assert function_fingerprint(helper_user) == before


def _helper(s):
    return s


def test_options_and_sources_the_function_cannot_follow(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="map="):
        PackOptions(map="not a function")
    with pytest.raises(ConfigError, match="map_fingerprint"):
        PackOptions(map_fingerprint="v1")   # without map=


def test_the_sample_as_a_mapping_and_its_pixels() -> None:
    import io

    from PIL import Image

    rgb = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    s = PackSample("a.png", buf.getvalue(), 1, {"caption": "x"})
    assert (s["key"], s["label"], s["caption"], s.get("missing", 5)) == ("a.png", 1, "x", 5)
    assert not s.decoded and np.array_equal(s.image, rgb) and s.decoded   # PNG: lossless
    grey = s.replace(image=rgb[:, :, 0])
    assert grey.data is None and grey.image.shape == (20, 30, 3)
    with pytest.raises(ValueError, match=r"uint8 pixels \[H, W, 3\]"):
        s.replace(image=rgb.astype(np.float32))
    with pytest.raises(TypeError):
        s.extras["caption"] = "y"   # read-only: a change is a replace(extras=...)


def _doc_block(doc: Path, heading: str) -> str:
    text = doc.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_packing_md_example_runs(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _doc_block(ROOT / "docs" / "packing.md", "## Your own function at pack time")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(folder, tmp_path / "photos")
    scope: dict = {}
    exec(compile(code, "docs/packing.md", "exec"), scope)
    summary = scope["summary"]
    assert summary.packed == 12 * 2 and summary.dropped == 0
    with open_dataset(tmp_path / "packed") as ds:
        assert all(max(ds.heights[i], ds.widths[i]) <= 64 for i in range(len(ds)))


def test_cli_map_takes_module_function(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from stoker.cli import main

    (tmp_path / "mypack.py").write_text("def keep_dogs(s):\n    return s if s.label == 1 else None\n")
    monkeypatch.chdir(tmp_path)
    assert main(["pack", str(folder), "out", "--map", "mypack:keep_dogs", "--no-progress"]) == 0
    assert "packed 4 images (8 dropped by the pack function)" in capsys.readouterr().out
    assert main(["pack", str(folder), "out2", "--map", "mypack:nothing", "--no-progress"]) == 2
    assert "--map mypack:nothing: mypack has no function nothing" in capsys.readouterr().err


PREP = """
from stoker import PackSample

SIZE = {size}

def crop(s: PackSample):
    return s.replace(image=s.image[:SIZE, :SIZE])
"""


@pytest.mark.parametrize("how", ["python", "cli"])
def test_resume_notices_a_changed_module_constant(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  how: str) -> None:
    """A prep script with SIZE = 32, interrupted after its first shards, SIZE changed to 48, resumed: refused
    (it was accepted, and the finished pack held 32x32 and 48x48 crops)."""
    import importlib

    from stoker.cli import main

    script = tmp_path / "prep.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"

    def load(size: int):
        script.write_text(PREP.format(size=size))
        sys.modules.pop("prep", None)
        importlib.invalidate_caches()
        return importlib.import_module("prep").crop

    with pytest.MonkeyPatch.context() as cut:
        _ctrl_c_at_the_tenth_sample(cut)
        with pytest.raises(KeyboardInterrupt):
            pack(folder, out, options=PackOptions(workers=1, shard_size=1, map=load(32)), progress=False)
    crop48 = load(48)
    if how == "python":
        with pytest.raises(ConfigError, match="the pack function changed"):
            pack(folder, out, options=PackOptions(workers=1, shard_size=1, map=crop48), progress=False, resume=True)
    else:
        assert main(["pack", str(folder), str(out), "--map", f"{script}:crop", "--shard-size", "1", "--workers", "1",
                     "--resume", "--no-progress"]) == 2
    assert function_fingerprint(load(32)) != function_fingerprint(crop48)
    assert function_fingerprint(load(32)) == function_fingerprint(load(32))


def test_an_array_global_is_fingerprinted_whole() -> None:
    import types as _types

    code = "import numpy as np\nTABLE = np.zeros(5000)\ndef f(s):\n    return TABLE\n"
    a, b = _types.ModuleType("ma"), _types.ModuleType("ma")
    exec(code, a.__dict__)
    exec(code + "TABLE[2500] = 1\n", b.__dict__)
    assert function_fingerprint(a.f) != function_fingerprint(b.f)


@pytest.mark.parametrize("returned", ["array", "pil"])
def test_the_functions_pixels_meet_max_pixels(folder: Path, tmp_path: Path, returned: str) -> None:
    """max_pixels=3,000: the function's 60x60 images are skipped as a source image over the limit is, naming
    the sample and the limit (they were all stored); its 40x40 ones are kept."""
    from PIL import Image

    def grow(s: PackSample):
        big = np.zeros((60, 60, 3) if s.label == 0 else (40, 40, 3), np.uint8)
        return s.replace(image=big if returned == "array" else Image.fromarray(big))

    summary = pack(folder, tmp_path / "out", options=PackOptions(map=grow, max_pixels=3_000, workers=1),
                   progress=False)
    assert summary.packed == 8 and summary.skipped == 4
    reasons = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert all("60x60 = 3,600 pixels exceeds the limit of 3,000" in r["reason"] for r in reasons), reasons[:1]


@pytest.mark.parametrize("spelling", ["./mypack.py:keep_dogs", "mypack.py:keep_dogs", "{abs}:keep_dogs",
                                      "sub/mypack.py:keep_dogs", "mypack:keep_dogs"])
def test_cli_map_spellings(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str], spelling: str) -> None:
    from stoker.cli import main

    (tmp_path / "sub").mkdir()
    for where in (tmp_path, tmp_path / "sub"):
        (where / "mypack.py").write_text("def keep_dogs(s):\n    return s if s.label == 1 else None\n")
    monkeypatch.chdir(tmp_path)
    spec = spelling.format(abs=tmp_path / "mypack.py")
    sys.modules.pop("mypack", None)
    assert main(["pack", str(folder), "out", "--map", spec, "--no-progress"]) == 0, capsys.readouterr().err
    assert "packed 4 images (8 dropped by the pack function)" in capsys.readouterr().out


@pytest.mark.parametrize("spec, words", [
    ("./missing.py:f", "no file"), ("mypack.py:nothing", "has no function nothing"), ("mypack.py:VALUE", "not a function"),
    ("mypack.py", "expected MODULE:FUNCTION or FILE.py:FUNCTION"), ("broken.py:f", "raised SyntaxError"),
    ("nomodule:f", "cannot import nomodule"),
])
def test_cli_map_wrong_spellings_are_one_line(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str], spec: str, words: str) -> None:
    from stoker.cli import main

    (tmp_path / "mypack.py").write_text("VALUE = 3\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("mypack", None)
    assert main(["pack", str(folder), "out", "--map", spec, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and f"--map {spec}" in err, err


def test_the_fingerprint_is_the_same_in_every_process(tmp_path: Path) -> None:
    """A set of strings (a global, or the frozenset `x in {...}` compiles to) has another order in each process
    (string hashing): the fingerprint sorts it, so a resume in a new process is not refused for nothing."""
    import subprocess

    (tmp_path / "prep_set.py").write_text(
        "KEEP = {'cat', 'dog', 'eel', 'fox', 'gnu'}\n\n"
        "def keep(s):\n    return s if s.extras.get('kind') in KEEP or s.key in {'a', 'b', 'c', 'd'} else None\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from prep_set import keep; "
            "from stoker.pack_map import function_fingerprint; print(function_fingerprint(keep))")
    prints = {subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                             env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)}).stdout
              for seed in range(6)}
    assert len(prints) == 1, prints
