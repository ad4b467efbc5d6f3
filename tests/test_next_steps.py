"""Every message a newcomer meets names the next step: options ignored in silence are refused, a
missing column or image folder names the flag that fixes it, a changed option is named on its own,
and shell habits (`| head`) end quietly."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_image_folder, write_image
from stoker.cli import main
from stoker.errors import ConfigError, SourceError
from stoker.packing import PackOptions, pack
from stoker.sources import open_source

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_root_log_capture() -> None:
    logging.getLogger("stoker").propagate = False   # the CLI's own handler is what a user sees
    yield
    logging.getLogger("stoker").propagate = True


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("steps") / "imgs", n_per_class=2)


@pytest.mark.parametrize("flags", [["--label-column", "fine_label"], ["--image-column", "img"],
                                   ["--label-column", "y", "--image-column", "x"]])
def test_column_flags_on_an_image_folder_are_refused_not_ignored(folder: Path, tmp_path: Path, flags: list[str],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", str(folder), str(tmp_path / "out"), "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert f"is a folder source whose labels come from its class folders" in err
    for flag in flags[::2]:
        assert f"(--{flag[2:]})" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SourceError, match="image_column= "):
        open_source(folder, image_column="img")
    assert len(open_source(folder, label_column=None).items) == 6   # the defaults and None stay accepted


def test_csv_without_its_path_column_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_image(tmp_path / "a.jpg", __import__("numpy").zeros((8, 8, 3), "uint8"))
    (tmp_path / "meta.csv").write_text("file,label\na.jpg,0\n")
    assert main(["pack", str(tmp_path / "meta.csv"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "no 'path' column in the header ['file', 'label']; pass --path-column NAME with the column holding " \
           "the image paths" in capsys.readouterr().err
    with pytest.raises(SourceError, match="pass path_column=NAME"):
        open_source(tmp_path / "meta.csv")
    assert len(open_source(tmp_path / "meta.csv", path_column="file").items) == 1
    (tmp_path / "nolabel.csv").write_text("path\na.jpg\n")
    assert main(["pack", str(tmp_path / "nolabel.csv"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "pass --label-column NAME with the column holding the labels (--no-labels for unlabelled data)" \
        in capsys.readouterr().err


def test_coco_without_root_says_pass_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    for i in range(3):
        write_image(tmp_path / "train2017" / f"{i:03d}.jpg", np.zeros((20, 30, 3), np.uint8))
    (tmp_path / "annotations").mkdir()
    ann = tmp_path / "annotations" / "instances_train2017.json"
    ann.write_text(json.dumps({"images": [{"id": i, "file_name": f"{i:03d}.jpg", "width": 30, "height": 20}
                                          for i in range(3)],
                               "annotations": [], "categories": [{"id": 1, "name": "x"}]}))
    assert main(["pack", str(ann), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"its images are not in {tmp_path / 'annotations'} (no 000.jpg, nor the next 2); pass --root with the " \
           "image folder, e.g. --root coco/train2017" in err
    with pytest.raises(SourceError, match='pass root= with the image folder, e.g. root="coco/train2017"'):
        open_source(ann)
    assert pack(ann, tmp_path / "out", root=tmp_path / "train2017", progress=False).packed == 3


def test_re_pack_with_another_option_names_that_option(folder: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", str(folder), str(tmp_path / "out"), "--quiet", "--max-side", "64"]) == 0
    capsys.readouterr()
    assert main(["pack", str(folder), str(tmp_path / "out"), "--quiet", "--max-side", "32", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "(max_side: was 64, now 32); pack with the same options to keep it, or pass --overwrite" in err
    assert "jpeg_quality" not in err   # only what differs


def test_pack_options_take_sizes_as_the_cli_does() -> None:
    assert PackOptions(shard_size="16MiB").shard_size == 16 * 2**20 == PackOptions(shard_size=16 * 2**20).shard_size
    assert PackOptions(shard_size="1g").shard_size == 2**30
    with pytest.raises(ConfigError, match="not a size: 'lots'"):
        PackOptions(shard_size="lots")


def test_a_bad_number_names_what_was_expected_not_a_function(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["pack", "a", "b", "--max-side", "abc"])
    err = capsys.readouterr().err
    assert "argument --max-side: expected a positive integer, got 'abc'" in err and "_positive" not in err
    with pytest.raises(SystemExit):
        main(["synth", "x", "--images", "0"])
    assert "expected a positive integer, got '0'" in capsys.readouterr().err


def test_a_closed_pipe_ends_quietly(folder: Path, tmp_path: Path) -> None:
    """`stoker info packed | head -1`: the reader stops early; no 'error: Broken pipe', no traceback."""
    pack(folder, tmp_path / "packed", progress=False)
    child = subprocess.Popen([sys.executable, "-m", "stoker.cli", "info", str(tmp_path / "packed")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    child.stdout.close()   # nobody reads: the child's first write meets a closed pipe
    err = child.stderr.read().decode()
    child.stderr.close()
    assert child.wait(timeout=60) == 141 and err == ""


# ---- interrupted and resumed packs -----------------------------------------------------------------

def test_ctrl_c_during_pack_names_resume(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import stoker.packing as packing

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(packing, "pack", interrupted)
    assert main(["pack", str(folder), str(tmp_path / "out"), "--quiet"]) == 130
    assert capsys.readouterr().err == ("stoker pack: interrupted (finished shards are kept; run the same command "
                                       "with --resume to finish it)\n")


def test_a_resumed_pack_rates_only_its_own_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import stoker.pack_work as work
    import stoker.packing as packing

    folder = make_image_folder(tmp_path / "imgs", n_per_class=4)   # 12 images
    real, calls = work._process_one, []

    def cut(entry, options):   # Ctrl-C at the 10th image: the first task's 8 are in finished shards
        calls.append(entry)
        if len(calls) == packing.TASK_SAMPLES + 2:
            raise KeyboardInterrupt
        return real(entry, options)
    opts = PackOptions(workers=1, shard_size=1)   # one image per shard
    monkeypatch.setattr(work, "_process_one", cut)
    with pytest.raises(KeyboardInterrupt):
        pack(folder, tmp_path / "out", options=opts, progress=False)
    monkeypatch.undo()
    # a journal and shards, or (killed before the first shard) a journal alone: both say what was left
    assert main(["info", str(tmp_path / "out")]) == 2
    assert "the pack did not finish (8 shard(s) and its journal but no stoker.json)" in capsys.readouterr().err
    summary = pack(folder, tmp_path / "out", options=opts, progress=False, resume=True)
    assert (summary.packed, summary.resumed) == (12, 8)
    assert "packed 12 images (4 now, 8 before the resume) into 12 shard(s)" in summary.format()
    summary.seconds = 2.0
    assert summary.format().endswith(", 2.0 s, 2 images/s")   # 4 images in this run, not 12

    for shard in (tmp_path / "out").glob("shard-*.arrow"):
        shard.unlink()
    (tmp_path / "out" / "stoker.json").unlink()
    (tmp_path / "out" / ".stoker-pack.jsonl").write_text("{}\n")
    assert main(["info", str(tmp_path / "out")]) == 2
    assert "the pack did not finish (its journal but no stoker.json)" in capsys.readouterr().err


# ---- Hugging Face data -----------------------------------------------------------------------------

def test_hugging_face_images_saved_as_paths_say_why_and_what_to_do(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="pip install 'stoker[test-formats]'")
    import numpy as np

    for i in range(3):
        write_image(tmp_path / "imgs" / f"{i}.jpg", np.zeros((8, 8, 3), np.uint8))
    ds = datasets.Dataset.from_dict({"image": [str(tmp_path / "imgs" / f"{i}.jpg") for i in range(3)],
                                     "label": [0, 1, 0]}).cast_column("image", datasets.Image())
    ds.to_parquet(str(tmp_path / "train.parquet"))   # datasets keeps the files' paths here, not their bytes
    with pytest.raises(SourceError) as err:
        open_source(tmp_path / "train.parquet")
    message = str(err.value)
    assert "no rows with image bytes in" in message and "3 of 3 rows hold only an image path" in message
    assert f"train.parquet:row 0: only a path ({str(tmp_path / 'imgs' / '0.jpg')!r})" in message
    assert "re-save the dataset with the images embedded" in message and "`stoker pack train.csv OUT`" in message


def test_a_save_to_disk_folder_is_named_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    datasets = pytest.importorskip("datasets", reason="pip install 'stoker[test-formats]'")
    from formats_helpers import photos
    import stoker

    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in photos(4, seed=2)],
                                     "label": [0, 1, 0, 1]},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.ClassLabel(names=["a", "b"])}))
    ds.save_to_disk(str(tmp_path / "saved"))
    assert main(["info", str(tmp_path / "saved")]) == 2
    err = capsys.readouterr().err
    assert "a Hugging Face dataset (save_to_disk), not a stoker pack; pack it once with `stoker pack " \
           f"{tmp_path / 'saved'} OUT`" in err and "did not finish" not in err
    # the Loader reads it as it reads any unpacked source
    loader = stoker.Loader(tmp_path / "saved", batch_size=2, transforms=[stoker.RandomResizedCrop(16)], seed=0)
    images, labels = next(iter(loader))
    assert tuple(images.shape) == (2, 3, 16, 16) and sorted(labels.tolist()) == [0, 1]
    loader.close()
