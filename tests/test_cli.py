"""The CLI as a new user meets it: sample data from `stoker synth`, progress in logs (off a terminal),
`--quiet`, and errors that name flags rather than Python arguments."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import make_image_folder
from stoker.cli import main
from stoker.errors import ConfigError, SourceError
from stoker.packing import pack
from stoker.reader import open_dataset


@pytest.fixture(autouse=True)
def _no_root_log_capture() -> None:
    # pytest's log capture sits on the root logger; the CLI's own handler is what a user sees
    logging.getLogger("stoker").propagate = False
    yield
    logging.getLogger("stoker").propagate = True


def test_synth_then_pack_info_verify_as_the_readme_says(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["synth", "imgs", "--images", "12", "--classes", "3", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "wrote 12 ImageNet-like JPEGs (3 classes) as an ImageFolder tree" in out
    assert sorted(p.name for p in (tmp_path / "imgs").iterdir()) == ["class_000", "class_001", "class_002"]
    assert len(list((tmp_path / "imgs").rglob("*.jpg"))) == 12
    assert main(["pack", "imgs", "packed"]) == 0
    assert main(["info", "packed"]) == 0
    assert main(["verify", "packed", "--decode"]) == 0
    with open_dataset(tmp_path / "packed") as ds:
        assert len(ds) == 12 and ds.classes == ["class_000", "class_001", "class_002"]


def test_synth_list_layout_writes_a_train_txt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", str(tmp_path / "l"), "--images", "5", "--layout", "list", "--quiet"]) == 0
    lines = (tmp_path / "l" / "train.txt").read_text().splitlines()
    assert len(lines) == 5 and lines[0].startswith("images/img_000000.jpg ")
    assert capsys.readouterr().err == ""


def test_progress_goes_to_the_log_off_a_terminal_and_quiet_silences_it(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    capsys = capfd   # pack keeps Python's stderr on file descriptor 2 while it hides decoder chatter
    src = make_image_folder(tmp_path / "imgs")
    assert main(["pack", str(src), str(tmp_path / "p1")]) == 0        # capsys' stderr is not a terminal
    err = capsys.readouterr().err
    assert "stoker: pack: 12/12 img (100%)" in err
    assert main(["verify", str(tmp_path / "p1"), "--decode"]) == 0
    err = capsys.readouterr().err
    assert "stoker: verify checksums: 1/1 shard (100%)" in err
    assert "stoker: verify decode: 12/12 img (100%)" in err

    assert main(["pack", str(src), str(tmp_path / "p2"), "--quiet"]) == 0
    assert main(["verify", str(tmp_path / "p2"), "--decode", "-q"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "packed 12 images" in out and "OK" in out   # results still print


@pytest.fixture
def packed_by_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    """(source folder, its pack) after a quiet `stoker pack`, with the captured output cleared."""
    src = make_image_folder(tmp_path / "imgs")
    out = tmp_path / "packed"
    assert main(["pack", str(src), str(out), "-q"]) == 0
    capsys.readouterr()
    return src, out


def test_cli_errors_name_flags_and_library_errors_name_arguments(packed_by_cli: tuple[Path, Path],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    src, out = packed_by_cli
    assert main(["pack", str(src), str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "pass --resume to finish it, --overwrite to replace it" in err
    assert "=True" not in err

    with pytest.raises(ConfigError) as info:
        pack(src, out, progress=False)
    assert "pass resume=True to finish it, overwrite=True to replace it" in str(info.value)
    assert "--" not in str(info.value)

    with pytest.raises(ConfigError, match=r"resume=True and overwrite=True contradict"):
        pack(src, out, resume=True, overwrite=True)
    assert main(["pack", str(src), str(out), "--resume", "--overwrite"]) == 2
    assert "--resume and --overwrite contradict" in capsys.readouterr().err


def test_kind_hints_name_the_flag_on_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    odd = tmp_path / "data.bin"
    odd.write_bytes(b"x")
    assert main(["pack", str(odd), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "(or pass --kind: one of list, csv" in err and "kind=" not in err
    with pytest.raises(SourceError, match=r"\(or pass kind=\.\.\.: one of list, csv"):
        pack(odd, tmp_path / "out2")

    mixed = make_image_folder(tmp_path / "mixed")
    (mixed / "loose.jpg").write_bytes((mixed / "cat" / "000.jpg").read_bytes())
    assert main(["pack", str(mixed), str(tmp_path / "out3"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "pass --kind folder (sub-folders are classes" in err and "--kind files (every image" in err


def test_a_resume_of_a_finished_pack_says_it_was_already_complete(packed_by_cli: tuple[Path, Path],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    src, out = packed_by_cli
    assert main(["pack", str(src), str(out), "--resume", "-q"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"{out} already holds a complete pack of 12 images in 1 shard(s), " \
                   f"{sum(p.stat().st_size for p in out.glob('shard-*.arrow')) / 1e6:,.1f} MB: nothing to do"
    summary = pack(src, out, resume=True, progress=False)
    assert summary.already_complete and summary.packed == 12
    assert not pack(src, out.parent / "fresh", progress=False).already_complete
