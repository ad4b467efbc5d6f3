"""The CLI answers every failure with one line saying what to do, never a traceback: disk full
(without ``.stoker.json.tmp`` or ``.skipped.jsonl.tmp`` left behind), an output path under a file,
a batch ring larger than the machine's memory.

Before the fix each of these printed a raw traceback (``OSError: [Errno 28]``, ``RuntimeError ...
can't allocate 150528000000 bytes``).
"""

from __future__ import annotations

import errno

import pytest

from stoker import Loader, RandomResizedCrop
from stoker.errors import ConfigError, OutputError
from stoker.packing import PackOptions, pack

from .rhelpers import make_image_folder, run_child

#: The CLI's pack with the disk filling up when ``target`` is written (a shard, or a small file
#: written atomically: fsync of its temporary fails with ENOSPC, as a full disk does).
_FULL_DISK_PACK = r"""
import errno, os, sys
from stoker import cli, shards
from stoker.storage import local

src, out, target = sys.argv[1:4]
if target == "shard":
    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    shards._HashingSink.write = full
else:
    real_fsync = os.fsync
    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(target):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)
    local.os.fsync = fsync
sys.exit(cli.main(["pack", src, out, "--workers", "1"]))
"""


@pytest.mark.parametrize("target", ["shard", ".stoker.json.tmp", ".skipped.jsonl.tmp"])
def test_disk_full_is_one_line_and_leaves_no_temporary(tmp_path, target):
    pytest.importorskip("resource")   # POSIX: /proc/self/fd names the file being synced
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    out = tmp_path / "out"
    proc = run_child(_FULL_DISK_PACK, str(src), str(out), target)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "stoker pack: error: cannot write" in proc.stderr and "No space left on device" in proc.stderr
    assert "free some disk space" in proc.stderr and "--resume" in proc.stderr
    assert not list(out.glob(".*.tmp")), sorted(p.name for p in out.iterdir())


def test_disk_full_in_the_library_is_an_output_error_with_the_errno(tmp_path, monkeypatch):
    from stoker import shards

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards._HashingSink, "write", full)
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    with pytest.raises(OutputError) as info:
        pack(src, tmp_path / "out", options=PackOptions(workers=1), progress=False)
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)


def test_output_under_a_file_is_one_line(tmp_path):
    src = make_image_folder(tmp_path / "src", n_per_class=1)
    (tmp_path / "afile").write_text("x")
    proc = run_child("import sys; from stoker import cli; sys.exit(cli.main(['pack', sys.argv[1], sys.argv[2]]))",
                     str(src), str(tmp_path / "afile" / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "is under a file, not a folder" in proc.stderr


def test_a_batch_ring_larger_than_memory_is_refused_up_front(small_pack):
    with pytest.raises(ConfigError, match=r"batch ring needs 4 slots x 1000000 images x 224x224x3 bytes = .* GiB.*"
                                          r"lower batch_size= \(--batch-size\), workers=stoker.Workers\(prefetch="):
        Loader(small_pack, 10**6, transforms=[RandomResizedCrop(224)])
