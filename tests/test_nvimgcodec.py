"""nvImageCodec's own features against the real library, on any machine: its CPU backend
(libjpeg-turbo) runs the same Python API the GPU path calls, so the wrapper, region decode (code-stream
regions, the margin that keeps it pixel-identical; CPU only) and the decoder benchmark are checked
here before any GPU runs them.
tests/test_decode_libraries.py checks what every decoder library must do; tests/cuda runs them on a GPU.

`make test` installs nvImageCodec (the `test-gpu-decode` extra); where it does not import, these skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.errors import ConfigError, CorruptImageError
from stoker.gpu_decode import REGION_MARGIN, GpuBatchDecoder, NvImageCodecDecoder
from stoker.transforms import Pipeline, RandomHorizontalFlip, RandomResizedCrop
from test_decode_libraries import as_tensor, kinds_of_jpeg, libjpeg_turbo
from test_gpu_decode import SIZES, jobs_for, make_jpegs, psnr, rows

try:
    from nvidia import nvimgcodec as nv
except Exception as exc:  # missing, or a build whose libraries do not load here
    pytest.skip(f"nvImageCodec does not import here ({type(exc).__name__}: {exc}); pip install -e '.[test-gpu-decode]'",
                allow_module_level=True)


@pytest.fixture(scope="module")
def decoder() -> NvImageCodecDecoder:
    return NvImageCodecDecoder("cpu")


def test_the_wrapper_builds_on_the_installed_release(decoder: NvImageCodecDecoder) -> None:
    # the names the wrapper uses exist in this release (ColorSpec.SRGB, not RGB, since 0.7; Backend kinds)
    assert decoder.name.startswith(f"nvImageCodec {nv.__version__} CPU (libjpeg-turbo)")
    assert decoder.regions and decoder.name.endswith("region decode") and not decoder.writes_at_call
    with pytest.raises(ConfigError, match="decodes on a CUDA device or the CPU, not meta"):
        NvImageCodecDecoder("meta")


JPEGS = kinds_of_jpeg()
REGION_DECODER = NvImageCodecDecoder("cpu")


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(sorted(JPEGS)), corners=st.tuples(*[st.floats(0, 1)] * 4),
       thin=st.tuples(st.booleans(), st.booleans()))
def test_inside_its_margin_a_region_decode_is_the_whole_decode(kind: str, corners: tuple[float, ...],
                                                               thin: tuple[bool, bool]) -> None:
    whole = libjpeg_turbo(JPEGS[kind])
    h, w = whole.shape[1:]
    top, left = min(int(corners[0] * h), h - 1), min(int(corners[1] * w), w - 1)
    bottom = top + 1 + (int(corners[2] * 3) if thin[0] else int(corners[2] * (h - top - 1)))  # 1-3 px or any
    right = left + 1 + (int(corners[3] * 3) if thin[1] else int(corners[3] * (w - left - 1)))
    bottom, right = min(bottom, h), min(right, w)
    m = REGION_MARGIN
    region = (max(0, top - m), max(0, left - m), min(h, bottom + m), min(w, right + m))
    out = REGION_DECODER.decode([as_tensor(JPEGS[kind])], regions=[region])[0]
    assert isinstance(out, torch.Tensor), out
    assert tuple(out.shape) == (3, region[2] - region[0], region[3] - region[1])
    inner = out[:, top - region[0]:bottom - region[0], left - region[1]:right - region[1]]
    assert torch.equal(inner, whole[:, top:bottom, left:right])


def test_batch_decoder_decodes_only_the_crops_and_matches_the_cpu_path(decoder: NvImageCodecDecoder) -> None:
    pipe = Pipeline([RandomResizedCrop(96), RandomHorizontalFlip()])
    jpegs = make_jpegs(seed=7)
    jobs, refs = jobs_for(pipe, jpegs, SIZES, seed=4)
    jobs[2].data = as_tensor(b"not a JPEG " * 50)  # a corrupt sample comes back as a failure naming its key
    decoded: list[tuple[int, int]] = []

    class Recording(NvImageCodecDecoder):
        def _tensor(self, image):
            out = super()._tensor(image)
            decoded.append(tuple(out.shape[1:]))
            return out

    out = torch.full((len(jobs), 3, 96, 96), 9, dtype=torch.uint8)
    failures = GpuBatchDecoder(Recording("cpu"), "cpu").run(jobs, out)
    assert [job.row for job, _ in failures] == [2]
    assert isinstance(failures[0][1], CorruptImageError) and failures[0][1].key == jobs[2].key
    assert (rows(out)[2] == 9).all()
    # only each crop's rectangle was decoded (the probe aside): fewer pixels than the whole images
    assert sum(h * w for h, w in decoded) < 0.9 * sum(h * w for i, (h, w) in enumerate(SIZES) if i != 2)
    whole = torch.full_like(out, 9)
    plain = NvImageCodecDecoder("cpu")
    plain.regions = False
    assert len(GpuBatchDecoder(plain, "cpu").run(jobs, whole)) == 1
    assert torch.equal(out, whole)  # region decode changes no pixel
    for i, ref in enumerate(refs):
        if i != 2:
            assert psnr(rows(out)[i], ref) > 40, f"sample {i}: {psnr(rows(out)[i], ref):.1f} dB against the CPU path"


def test_the_decoder_benchmark_counts_what_region_decode_saves(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_decode.py"
    spec = importlib.util.spec_from_file_location("stoker_bench_gpu_decode", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([str(tmp_path / "cache"), "--images", "12", "--batch", "5", "--rounds", "1",
                       "--json", str(tmp_path / "r.json")]) == 0
    rows = {r["decoder"].rsplit(", ", 1)[1]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert set(rows) == {"region decode", "whole images"}
    assert rows["whole images"]["failed"] == rows["region decode"]["failed"] == 0
    # RandomResizedCrop reads part of each image: a region decode hands back fewer pixels
    assert rows["region decode"]["decoded_mpix_per_image"] < rows["whole images"]["decoded_mpix_per_image"]
    assert "| decoder | ms/image |" in capsys.readouterr().out
