"""Why the process mode (`procs.py`) refuses or fails, in words that name the fix: what the worker
process cannot import, how a worker process died (a signal, the out-of-memory killer, a script
without a `__main__` guard), and the worker process's exceptions rebuilt in the training process."""

from __future__ import annotations

import ast
import importlib
import os
import pickletools
import signal
import sys
from pathlib import Path
from typing import Any

from ..errors import WorkerError

__all__ = ["RemoteTraceback", "child_imports", "has_main_guard", "killed_fix", "main_references", "main_script",
           "out_of_files", "rebuild", "signal_name", "start_failure"]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in the worker process, as text (the `__cause__` of what
    the consumer raises, like concurrent.futures' _RemoteTraceback)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def rebuild(data: dict) -> BaseException:
    """The exception `proc_child.portable` described: the same class and message (a class the parent cannot
    import becomes a WorkerError with the same text); the child's traceback text is its innermost cause."""
    module, name = data["cls"]
    cls: Any = None
    try:
        cls = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
    except Exception:
        cls = None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        exc = cls.__new__(cls)
        exc.args = data["args"]
        try:
            exc.__dict__.update(data["state"])
        except AttributeError:
            pass
    else:
        exc = WorkerError(f"{name}: {' '.join(map(str, data['args']))}")
    cause = rebuild(data["cause"]) if data["cause"] is not None else None
    if cause is None:
        exc.__cause__ = RemoteTraceback(data["tb"])
    else:
        exc.__cause__ = cause
    return exc


def main_references(data: bytes) -> list[Any]:
    """The objects a pickle names by reference to `__main__` (functions and classes the worker
    process must find by name), read from its opcodes without unpickling anything."""
    main = sys.modules.get("__main__")
    memo: list[Any] = []
    pushed: list[Any] = [None, None]   # the last two values pushed (strings; None for anything else)
    found: list[Any] = []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "MEMOIZE":
            memo.append(pushed[-1])
            continue
        value = None
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            value = arg
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            value = memo[int(arg)] if int(arg) < len(memo) else None
        elif op.name in ("STACK_GLOBAL", "GLOBAL"):
            module, name = pushed[-2:] if op.name == "STACK_GLOBAL" else arg.split(" ", 1)
            if module == "__main__" and isinstance(name, str):
                obj: Any = main
                for part in name.split("."):
                    obj = getattr(obj, part, None)
                found.append(obj if obj is not None else name)
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):   # protocols below 4
            memo.extend([None] * (int(arg) + 1 - len(memo)))
            memo[int(arg)] = pushed[-1]
            continue
        pushed = [pushed[-1], value]
    return found


def main_script() -> Path | None:
    """The file the worker process runs again as its `__mp_main__` (None: a notebook, `python -c`,
    the interactive prompt)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return Path(path) if path and os.path.isfile(path) else None


def child_imports(obj: Any) -> bool:
    """Whether the worker process finds `obj` (defined in `__main__`) by name: it runs the main
    script again, so what that file defines; not a notebook cell or `python -c`."""
    script = main_script()
    if script is None:
        return False
    code = getattr(obj, "__code__", None)
    return code is None or os.path.abspath(code.co_filename) == os.path.abspath(script)


def has_main_guard(script: Path | None) -> bool:
    """Whether `script` runs its top-level work under `if __name__ == "__main__":` (True when there is no
    script to run again, or it cannot be read)."""
    if script is None:
        return True
    try:
        tree = ast.parse(script.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return True
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                "__name__" in ast.dump(node.test) and "'__main__'" in ast.dump(node.test):
            return True
    return False


def start_failure(code: int | None, pid: int | None, guarded: bool, who: str | None = None) -> str:
    """Why a worker process that died before it mapped its slots died, and what to do. `who`: how to
    name it (default "stoker's worker process (pid N)"; with several, which of them)."""
    head = who or f"stoker's worker process (pid {pid})"
    if code is not None and code < 0:
        return f"{head} was killed by {signal_name(-code)} (exit code {code}) while starting; " + killed_fix(-code)
    if not guarded:
        return (f"{head} exited with code {code} while starting, before it mapped its slots (its error is printed "
                f"above). The worker process is started with 'spawn', which imports your main script again: "
                f"training code at the top level of a script must be under `if __name__ == \"__main__\":`. Add that "
                f"guard, or use worker threads (Workers(processes=0))")
    return (f"{head} exited with code {code} while starting, before it mapped its slots; its error, if any, is "
            f"printed above. Use worker threads (Workers(processes=0)) to see the failure in this process")


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def killed_fix(number: int) -> str:
    if number == signal.SIGBUS:
        return ("the shared memory behind its batch ring ran out (a small /dev/shm: Docker's default is 64 MB): raise "
                "it (`docker run --shm-size=1g`), lower workers=stoker.Workers(prefetch=...) or batch_size=, or use "
                "worker threads (Workers(processes=0))")
    if number == signal.SIGKILL:
        return ("most often by the out-of-memory killer (see `dmesg`, or the container's memory limit): lower "
                "batch_size=, workers=stoker.Workers(prefetch=...) or num_threads, or give the job more memory")
    return "something outside stoker ended it; start a new pass, or use worker threads (Workers(processes=0))"




def out_of_files(exc: OSError) -> str | None:
    """The fix for an OSError of the process mode's start that is the open-file limit (EMFILE/ENFILE:
    each worker process needs pipes, and multiprocessing's resource tracker more), or None for another."""
    import errno
    import resource

    if exc.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (f"stoker's worker processes could not start: this process reached its limit of {soft} open files "
            f"({exc.strerror}). Raise the limit (`ulimit -n 4096` in the shell that starts training, or "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ...) in the script), or run the workers as threads: "
            f"workers=stoker.Workers(processes=0)")
