"""The CUDA tests' CPU rehearsal (a plugin of tests/conftest.py): where torch has no usable GPU, each
test of tests/cuda (those marked `cuda`) still runs, up to its first CUDA call, instead of being skipped
whole.

While such a test's module is imported, and while the test is set up, run and torn down, `torch.cuda.is_available()` says
True and `torch.cuda.device_count()` 1 (as on a one-GPU host), so the test and stoker take their GPU
paths. Everything before the first real CUDA call runs for real on the CPU: keyword arguments, option
values, data building, CPU reference batches, layouts, imports. That call then raises torch's own
"no CUDA" error (`Torch not compiled with CUDA enabled`, `No CUDA GPUs are available`, ...); only that
error, raised by torch itself or carried as the cause of the error that reached the test, becomes a
skip whose reason names the line that reached the GPU and how much of the test ran before it
("CPU rehearsal: reached CUDA at line 7 of the test body ..."; a test whose first statement, or one
of whose fixtures, already needs the GPU says that nothing of its body was rehearsed). Any other error
(a keyword stoker no longer takes, a tensor of the wrong layout, a renamed function, a failed assert)
fails the test as it would on a GPU. A test that runs to its end passes: it never needed a GPU.

On a host with a working GPU nothing here changes anything. `STOKER_CUDA_REHEARSAL=0` turns the
rehearsal off (the tests then skip with "needs a CUDA GPU", as they did before it existed).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import textwrap
import traceback
from pathlib import Path
from typing import Iterator

import pytest
import torch

CUDA_TESTS = Path(__file__).resolve().parent / "cuda"
REHEARSAL = not torch.cuda.is_available() and os.environ.get("STOKER_CUDA_REHEARSAL", "1") != "0"

#: torch's own errors for a CUDA call where no GPU can be used: a CPU-only build, a CUDA build on a
#: host without a driver or device. Matched on torch's messages, never on stoker's.
NO_CUDA = re.compile("|".join((
    r"Torch not compiled with CUDA enabled",
    r"compiled without CUDA support",
    r"requires CUDA support",
    r"Tried to instantiate dummy base class (Stream|Event|CUDAGraph|ExternalStream)",
    r"Cannot access accelerator device when none is available",
    r"no pinned memory allocator is available",
    r"Found no NVIDIA driver on your system",
    r"No CUDA GPUs are available",
    r"CUDA driver initialization failed",
    r"no CUDA-capable device is detected",
)))


def _is_no_cuda(exc: BaseException) -> bool:
    if isinstance(exc, AttributeError) and getattr(exc, "obj", None) is torch._C:
        return bool(re.search(r"'_cuda", str(exc)))   # a CUDA binding a CPU-only build does not have
    return isinstance(exc, (AssertionError, RuntimeError)) and bool(NO_CUDA.search(str(exc)))


def no_cuda_error(exc: BaseException) -> BaseException | None:
    """torch's "no CUDA" error behind `exc`: `exc` itself, or its cause or context (stoker carries an
    error of its device thread to the caller as the cause of its own)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _is_no_cuda(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def reported_available() -> Iterator[None]:
    """torch.cuda (and torch.accelerator) reported available with one device, for the duration (rehearsal
    only)."""
    if not REHEARSAL:
        yield
        return
    saved = torch.cuda.is_available, torch.cuda.device_count, torch.accelerator.is_available
    # torch.accelerator too: DataLoader(pin_memory=True) asks it, and would quietly not pin
    torch.cuda.is_available, torch.cuda.device_count, torch.accelerator.is_available = (
        (lambda: True), (lambda: 1), (lambda: True))
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count, torch.accelerator.is_available = saved


def _first_statement_line(fn: object) -> int | None:
    """The line (in the file) of the first statement of test function `fn`'s body, docstring aside."""
    try:
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return start + body[0].lineno - 1 if body else None


def rehearsal_reason(item: pytest.Item, exc: BaseException, when: str) -> str:
    """The skip reason: where the test reached the GPU and how much of it ran on the CPU first."""
    cause = no_cuda_error(exc)
    message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    fn = getattr(item, "function", None)
    code = getattr(fn, "__code__", None)
    lineno = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        if frame.f_code is code:
            lineno = line   # the innermost line of the test body on the way to the error
    if when == "setup" or lineno is None:
        return f"CPU rehearsal: a fixture reached CUDA before the test body ran (nothing of it rehearsed): {message}"
    first = _first_statement_line(fn)
    source = Path(code.co_filename).read_text().splitlines()[lineno - 1].strip()
    if first is not None and lineno <= first:
        return (f"CPU rehearsal: its first statement, line {lineno} ({source}), reaches CUDA "
                f"(nothing of the test body rehearsed): {message}")
    n = None if first is None else lineno - first
    ran = "" if n is None else f", {n} line{'s' * (n != 1)} into the body"
    return f"CPU rehearsal: ran on the CPU up to line {lineno} ({source}){ran}, which reaches CUDA: {message}"


def _in_cuda_tests(path: Path) -> bool:
    return CUDA_TESTS in Path(path).resolve().parents


def _rehearsed(item: pytest.Item) -> bool:
    return REHEARSAL and _in_cuda_tests(item.path) and item.get_closest_marker("cuda") is not None


def _run(item: pytest.Item, when: str) -> Iterator[None]:
    if not _rehearsed(item):
        return (yield)
    with reported_available():
        try:
            return (yield)
        except Exception as exc:
            if no_cuda_error(exc) is None:
                raise
            # reported at the test's own location (as a skip mark's reason is), not at this line
            raise pytest.skip.Exception(rehearsal_reason(item, exc, when), _use_item_location=True) from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _run(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _run(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    return (yield from _run(item, "teardown"))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A test module's `skipif(not torch.cuda.is_available())` is read when it is imported: rehearsed."""
    ours = isinstance(collector, pytest.Module) and _in_cuda_tests(collector.path)
    with reported_available() if ours else contextlib.nullcontext():
        return (yield)


def pytest_report_header(config: pytest.Config) -> str | None:
    if REHEARSAL:
        return ("tests/cuda: no usable GPU here; CPU rehearsal (each test runs up to its first CUDA call, then "
                "skips naming it; STOKER_CUDA_REHEARSAL=0 skips them whole)")
    return None
