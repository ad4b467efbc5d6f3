"""Interpreter exit with a loader thread still inside a long call: the thread is told to stop and joined
before the interpreter finalizes (a daemon killed inside native code aborts the process: SIGABRT,
"terminate called without an active exception", seen with decode="gpu" on a busy machine)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stoker
from conftest import make_image_folder

HERE = Path(__file__).resolve().parent

SCRIPT = """
import sys, time
import stoker
from stoker import RandomResizedCrop
from stoker.device.stage import DeviceOptions
from gpu_standin import FixedRateDecoder

class Marking(FixedRateDecoder):
    def decode(self, datas, regions=None):
        out = super().decode(datas, regions)
        if self.latency_s >= 8:
            with open(sys.argv[2], "a") as f:
                f.write("finished\\n")
        return out

if __name__ == "__main__":
    dec = Marking()
    loader = stoker.Loader(sys.argv[1], batch_size=8, transforms=[RandomResizedCrop(32)],
                           device=DeviceOptions("cpu", decode="gpu", gpu_decoder=dec))
    it = iter(loader)
    next(it), next(it)
    dec.latency_s = 8.0     # the calls now in flight outlast close()'s bounded join
    time.sleep(0.3)
    loader.close()
    print("closed", flush=True)
"""


def test_a_decoder_call_in_flight_at_exit_finishes_before_the_interpreter(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "imgs", n_per_class=24, sizes=((120, 160), (96, 128)))
    stoker.pack(tmp_path / "imgs", tmp_path / "packed", progress=False)
    mark = tmp_path / "mark"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path / "packed"), str(mark)],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.strip() == "closed"
    # the decode thread was joined at exit, not killed mid-call (before: no line, the thread died with the process)
    assert mark.exists() and "finished" in mark.read_text(), out.stderr[-2000:]
