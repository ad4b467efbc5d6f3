"""`stoker.pack(src, out, resume=True)` run again on a finished pack: the same listing and options
return the pack as it is (README's example can run twice); a listing that changed since (a file added
or removed, a label moved) is an error naming overwrite=True, not the old pack passed off as current."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import stoker
from conftest import make_image_folder, smooth_rgb, write_image
from stoker.errors import ConfigError
from stoker.shards import read_manifest


def test_a_rerun_reuses_the_pack_and_a_changed_listing_is_refused(tmp_path: Path) -> None:
    imgs = make_image_folder(tmp_path / "imgs", n_per_class=2)
    first = stoker.pack(imgs, tmp_path / "packed", resume=True, progress=False)
    again = stoker.pack(imgs, tmp_path / "packed", resume=True, progress=False)
    assert not first.already_complete and again.already_complete and again.packed == first.packed == 6
    write_image(imgs / "cat" / "new.jpg", smooth_rgb(np.random.default_rng(1), 40, 40))
    with pytest.raises(ConfigError, match=r"listing .* has changed since it was packed; pass overwrite=True"):
        stoker.pack(imgs, tmp_path / "packed", resume=True, progress=False)
    (imgs / "cat" / "new.jpg").unlink()
    shutil.move(imgs / "dog" / "000.jpg", imgs / "eel" / "moved.jpg")   # same count, another label
    with pytest.raises(ConfigError, match="has changed since"):
        stoker.pack(imgs, tmp_path / "packed", resume=True, progress=False)
    redone = stoker.pack(imgs, tmp_path / "packed", overwrite=True, progress=False)
    assert redone.packed == 6 and stoker.pack(imgs, tmp_path / "packed", resume=True, progress=False).already_complete


def test_a_pack_from_before_the_listing_was_recorded_still_resumes(tmp_path: Path) -> None:
    """A manifest without the listing's fingerprint (older packs): resume=True returns it, unchecked."""
    imgs = make_image_folder(tmp_path / "imgs", n_per_class=1)
    stoker.pack(imgs, tmp_path / "packed", progress=False)
    path = tmp_path / "packed" / "stoker.json"
    manifest = json.loads(path.read_text())
    assert manifest["pack_options"].pop("source_listing_sha256")
    path.write_text(json.dumps(manifest))
    assert stoker.pack(imgs, tmp_path / "packed", resume=True, progress=False).already_complete
    assert "source_listing_sha256" not in read_manifest(tmp_path / "packed").pack_options
