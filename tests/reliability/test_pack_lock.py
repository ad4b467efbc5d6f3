"""Two packs into one OUT: the second fails at once naming the holder, instead of racing the first.

Before the lock, both could exit 0 with the second silently replacing the first's dataset and
leaving its shards orphaned (``overwrite=True`` makes that happen every time).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from stoker import open_dataset
from stoker.errors import ConfigError
from stoker.packing import PackOptions, pack

from .rhelpers import HERE, make_image_folder

#: The first pack waits for this file before reading its first image (bounded, like every wait).
_HOLDING_PACK = r"""
import sys, time
from dataclasses import replace
from pathlib import Path
from stoker.packing import PackOptions, pack
from stoker.sources import open_source

src, out, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])

class Gate:
    name = "gate"
    def read(self, offset, size):
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return items[offset].path.read_bytes()

source = open_source(src)
items = source.items
source = replace(source, items=[replace(it, store=Gate(), offset=i) for i, it in enumerate(items)])
print(pack(source, out, options=PackOptions(workers=1), progress=False))
"""


def test_a_second_pack_into_the_same_out_fails_at_once_naming_the_holder(tmp_path):
    src = make_image_folder(tmp_path / "src", n_per_class=3)
    out, go = tmp_path / "out", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    first = subprocess.Popen([sys.executable, "-c", _HOLDING_PACK, str(src), str(out), str(go)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / ".stoker-pack.jsonl").exists() and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.02)
        started = time.monotonic()
        with pytest.raises(ConfigError, match=rf"being written by another pack: pid {first.pid} on host "
                                              rf"{socket.gethostname()}"):
            pack(src, out, options=PackOptions(workers=1), progress=False, overwrite=True)
        assert time.monotonic() - started < 50   # at once, not after the first pack ends
    finally:
        go.touch()
        stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr[-3000:]
    with open_dataset(out, verify=True) as ds:
        assert len(ds) == 9
    assert sorted(p.name for p in out.glob("shard-*")) == [s["file"] for s in
                                                          json.loads((out / "stoker.json").read_text())["shards"]]


def test_the_lock_is_released_when_a_pack_ends_or_fails(tmp_path):
    src = make_image_folder(tmp_path / "src", n_per_class=2)
    out = tmp_path / "out"
    pack(src, out, options=PackOptions(workers=1), progress=False)
    with pytest.raises(ConfigError, match="already holds a finished pack"):
        pack(src, out, options=PackOptions(workers=1), progress=False)
    summary = pack(src, out, options=PackOptions(workers=1), progress=False, overwrite=True)
    assert summary.packed == 6
