"""Property test of the video path: mutated and cut videos of every codec PyAV's wheel encodes go through
the pack-time check (``probe_video``) and the clip decode (with the file's own index, and with the index
of the undamaged file, as when stored bytes changed after packing). Only stoker's errors come out (an
ImageError subclass, or a ConfigError for frames outside the index), never another exception, a crash or
a hang.

In a child process with a 3 GiB address-space limit (a decoder's crash or runaway allocation fails this
test instead of pytest), derandomized, with a time limit.
"""

from __future__ import annotations

import pytest

from .rhelpers import run_child

pytest.importorskip("av", reason="videos need PyAV: pip install 'stoker[video]'")

FUZZ_EXAMPLES = 150   # per codec

_FUZZ_CHILD = r"""
import os, resource, sys, warnings
warnings.simplefilter("ignore")
os.environ["SVT_LOG"] = "1"
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st
from stoker.loading.clips import decode_clip_into
from stoker.errors import StokerError
from stoker.tools.synth_video import CODECS, VideoStyle, make_video
from stoker.video import probe_video

N = int(sys.argv[1])
STYLE = dict(seconds=2, fps=10, size=(48, 64), keyframe_seconds=0.5)
SEEDS = {codec: make_video(1, style=VideoStyle(codec=codec, **STYLE)) for codec in sorted(CODECS)}
INDEX = {codec: probe_video(data, codec, max_pixels=1 << 22) for codec, data in SEEDS.items()}
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

def clip(data, index):
    frames = np.array([1, 6, 11, min(17, index.frames - 1)]) % index.frames
    dst = np.empty((4, 16, 16, 3), np.uint8)
    decode_clip_into(data, index, frames, dst, (2.0, 3.0, 20.0, 30.0), True, key="fuzz")

def check(codec, data):
    for call in (lambda: clip(data, probe_video(data, "fuzz", max_pixels=1 << 22, max_seconds=20)),
                 lambda: clip(data, INDEX[codec])):
        try:
            call()
        except StokerError:
            continue
        except Exception as exc:
            raise AssertionError(f"{codec}: {type(exc).__name__} escaped: {exc}") from exc

mutation = st.tuples(st.integers(0, 1 << 20), st.integers(0, 255))
config = settings(max_examples=N, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))

for codec in sorted(SEEDS):
    @config
    @given(st.lists(mutation, min_size=1, max_size=24), st.integers(0, 1 << 20), st.booleans())
    def mutated(flips, cut, shorten):
        data = bytearray(SEEDS[codec])
        for pos, value in flips:
            data[pos % len(data)] = value
        if shorten:
            data = data[: max(1, len(data) - cut % len(data))]
        check(codec, bytes(data))
    mutated()
print("fuzz ok")
"""


def test_fuzzed_videos_only_raise_stoker_errors() -> None:
    proc = run_child(_FUZZ_CHILD, str(FUZZ_EXAMPLES), timeout=300)
    assert proc.returncode == 0 and "fuzz ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-5000:]
