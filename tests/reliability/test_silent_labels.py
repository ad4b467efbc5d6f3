"""No silent label corruption: labels mixing numbers and names are an error naming the lines, and a
pack cannot write its dataset inside the folder it packs (the next pack of that folder would gain a
class for it and shift every label by one; a killed pack there could not resume).
"""

from __future__ import annotations

import json

import pytest

from stoker.errors import SourceError
from stoker.packing import PackOptions, pack

from .rhelpers import make_image_folder


def test_one_name_among_numeric_labels_is_an_error_naming_the_lines(tmp_path):
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    (src / "l.txt").write_text("cat/000.jpg 2\ncat/001.jpg 10\ndog/000.jpg x\n")
    with pytest.raises(SourceError, match=r"l\.txt line 3: label 'x' is a name while .*l\.txt line 1 has the number '2'"):
        pack(src / "l.txt", tmp_path / "out", options=PackOptions(workers=1), progress=False)


@pytest.mark.parametrize("where", ["_packed", "cat/packed", "."])
def test_out_inside_the_source_folder_is_refused(tmp_path, where):
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    out = src / where
    with pytest.raises(SourceError, match="is inside the source folder .*write OUT outside the source folder"):
        pack(src, out, options=PackOptions(workers=1), progress=False)
    assert not (src / "_packed").exists() and not (src / "cat" / "packed").exists()
    # the folder still packs to the same classes and labels elsewhere
    pack(src, tmp_path / "out", options=PackOptions(workers=1), progress=False)
    assert json.loads((tmp_path / "out" / "stoker.json").read_text())["classes"] == ["cat", "dog", "eel"]


def test_out_beside_a_list_in_its_folder_is_fine(tmp_path):
    """A list is not walked, so its folder may hold the output."""
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    (src / "l.txt").write_text("cat/000.jpg 0\ndog/000.jpg 1\n")
    summary = pack(src / "l.txt", src / "packed", options=PackOptions(workers=1), progress=False)
    assert summary.packed == 2
