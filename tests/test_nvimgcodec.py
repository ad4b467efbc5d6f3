"""nvImageCodec's own features against the real library, on any machine: its CPU backend
(libjpeg-turbo) runs the same Python API the GPU path calls, so the wrapper, the batch decoder on it
and the decoder benchmark are checked here before any GPU runs them.
tests/test_decode_libraries.py checks what every decoder library must do; tests/cuda runs them on a GPU.

`make test` installs nvImageCodec (the `test-gpu-decode` extra); where it does not import, these skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stoker.errors import ConfigError, CorruptImageError
from stoker.device.gpu_decode import GpuBatchDecoder, NvImageCodecDecoder
from stoker.transforms import Pipeline, RandomHorizontalFlip, RandomResizedCrop
from test_decode_libraries import as_tensor
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
    assert decoder.name == f"nvImageCodec {nv.__version__} CPU (libjpeg-turbo)" and not decoder.writes_at_call
    with pytest.raises(ConfigError, match="decodes on a CUDA device or the CPU, not meta"):
        NvImageCodecDecoder("meta")


def test_batch_decoder_matches_the_cpu_path_and_a_corrupt_sample_fails_alone(decoder: NvImageCodecDecoder) -> None:
    pipe = Pipeline([RandomResizedCrop(96), RandomHorizontalFlip()])
    jobs, refs = jobs_for(pipe, make_jpegs(seed=7), SIZES, seed=4)
    jobs[2].data = as_tensor(b"not a JPEG " * 50)  # a corrupt sample comes back as a failure naming its key
    out = torch.full((len(jobs), 3, 96, 96), 9, dtype=torch.uint8)
    failures = GpuBatchDecoder(decoder, "cpu").run(jobs, out)
    assert [job.row for job, _ in failures] == [2]
    assert isinstance(failures[0][1], CorruptImageError) and failures[0][1].key == jobs[2].key
    assert (rows(out)[2] == 9).all()
    for i, ref in enumerate(refs):
        if i != 2:
            assert psnr(rows(out)[i], ref) > 40, f"sample {i}: {psnr(rows(out)[i], ref):.1f} dB against the CPU path"


def test_the_decoder_benchmark_runs_the_backend_through_the_batch_decoder(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_decode.py"
    spec = importlib.util.spec_from_file_location("stoker_bench_gpu_decode", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([str(tmp_path / "cache"), "--images", "12", "--batch", "5", "--rounds", "1",
                       "--json", str(tmp_path / "r.json")]) == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert row["decoder"].startswith("nvImageCodec") and row["failed"] == 0
    # whole images of about 400 x 350 pixels were decoded
    assert 0.08 < row["decoded_mpix_per_image"] < 0.25 and row["ms_per_image"] > 0
    assert "| decoder | ms/image |" in capsys.readouterr().out
