"""stoker.profile on CUDA batches: the step is synchronized so queued GPU work counts as compute
(skipped without CUDA). The CPU side is tested in tests/test_profile.py."""

from __future__ import annotations

import pytest
import torch

import stoker
from stoker.profiling import COMPUTE_BOUND

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_batches_are_synchronized_and_gpu_work_counts_as_step_time() -> None:
    def gpu_batches(n: int):
        for _ in range(n):
            yield torch.zeros(8, 3, 64, 64, device="cuda"), torch.zeros(8, dtype=torch.long, device="cuda")
    a = torch.randn(2048, 2048, device="cuda")
    prof = stoker.profile(gpu_batches(6), verbose=False)
    for _ in prof:
        for _ in range(20):   # queued GPU work, no sync in the loop
            a = a @ a / a.norm()
    r = prof.reports[-1]
    assert r.synchronized and r.device.startswith("cuda") and r.verdict == COMPUTE_BOUND
