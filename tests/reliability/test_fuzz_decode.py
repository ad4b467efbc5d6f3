"""Property test of the decode path: random and mutated bytes into probe / decode_rgb /
decode_pillow_rgb raise only stoker's ImageError subclasses (or succeed with RGB uint8).

Runs in a child process: a segfault or an abort in a decoder kills the child, which the
parent reports as a failure, instead of taking pytest down with it. Bounded: a fixed number of
examples, derandomized (the same inputs on every run, so CI is reproducible), a time limit.
"""

from __future__ import annotations

from .rhelpers import run_child

FUZZ_EXAMPLES = 1500  # per property; about 15 s for both on a loaded 2-core machine

_FUZZ_CHILD = r"""
import io, resource, sys, warnings
warnings.simplefilter("ignore")
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image
from stoker import codecs
from stoker.errors import ImageError

N = int(sys.argv[1])
rng = np.random.default_rng(0)
rgb = (rng.integers(0, 255, (24, 32, 3))).astype(np.uint8)
def save(img, fmt, **kw):
    buf = io.BytesIO(); img.save(buf, fmt, **kw); return buf.getvalue()
SEEDS = [codecs.encode_jpeg(rgb, 80), save(Image.fromarray(rgb), "JPEG", progressive=True),
         save(Image.fromarray(rgb).convert("CMYK"), "JPEG"), save(Image.fromarray(rgb), "PNG"),
         save(Image.fromarray(rgb).convert("P"), "GIF"), save(Image.fromarray(rgb), "BMP"),
         save(Image.fromarray(rgb), "TIFF"), save(Image.fromarray(rgb), "WEBP"),
         save(Image.fromarray(rgb[:, :, 0]), "PNG"), save(Image.fromarray(rgb), "PPM")]

def check(data):
    calls = (lambda: codecs.probe(data, "fuzz", max_pixels=1 << 24),
             lambda: codecs.decode_pillow_rgb(data, "fuzz", max_pixels=1 << 24),
             lambda: codecs.decode_rgb(data, "jpeg", "fuzz"),
             lambda: codecs.decode_rgb(data, "jpeg", "fuzz", min_height=8, min_width=8),
             lambda: codecs.decode_rgb(data, "jpeg", "fuzz", height=24, width=32, min_height=8, min_width=8,
                                       out=np.empty(24 * 32 * 3, np.uint8)),
             lambda: codecs.decode_rgb(data, "png", "fuzz"),
             lambda: codecs.decode_rgb(data, "raw", "fuzz", height=4, width=4))
    for call in calls:
        try:
            out = call()
        except ImageError:
            continue
        except Exception as exc:
            raise AssertionError(f"{type(exc).__name__} escaped for input {bytes(data[:64])!r}...: {exc}") from exc
        if isinstance(out, np.ndarray):
            assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3, out.shape

mutation = st.tuples(st.integers(0, 10_000), st.integers(0, 255))
config = settings(max_examples=N, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))

@config
@given(st.binary(max_size=2048))
def random_bytes(data):
    check(data)

@config
@given(st.sampled_from(range(len(SEEDS))), st.lists(mutation, max_size=12),
       st.integers(0, 1 << 16), st.binary(max_size=16), st.booleans())
def mutated(seed, flips, cut, insert, use_insert):
    data = bytearray(SEEDS[seed])
    for pos, value in flips:
        data[pos % len(data)] = value
    if use_insert:
        at = cut % (len(data) + 1)
        data[at:at] = insert
    else:
        data = data[: max(0, len(data) - cut % len(data))]
    check(bytes(data))

random_bytes()
mutated()
print("fuzz ok")
"""


def test_fuzzed_bytes_only_raise_image_errors():
    proc = run_child(_FUZZ_CHILD, str(FUZZ_EXAMPLES), timeout=240)
    assert proc.returncode == 0 and "fuzz ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-5000:]
