"""`stoker pack --engine ray`: the per-sample work of packing (read, decode check, resize,
re-encode) on the workers of a Ray cluster, results streamed back in source order.

The driver keeps what decides the output: it cuts shards, writes them through storage, keeps the
journal and writes the manifest. So a Ray pack is byte-for-byte the pack a local run makes (same
shards, same checksums, same skipped.jsonl), and `--resume` works the same. Workers read the
source paths themselves: on a cluster, the images must be on a file system every node mounts
(NFS, Lustre, a FUSE mount), and stoker must be installed in the workers' environment.

A pack function (``PackOptions(map=)``) travels with the options. Its module, when it is the user's
own (not installed in site-packages, not stoker), is pickled by value (cloudpickle), so a function
defined in a training script or a module beside it runs on workers that do not have that file.
"""

from __future__ import annotations

import sys
import sysconfig
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import ConfigError, StokerError

INSTALL_HINT = "pip install 'stoker[ray]'"
#: samples per Ray task: large enough that task overhead (about a millisecond) stays small
RAY_TASK_SAMPLES = 64


def require_ray() -> Any:
    """The ray module, or ConfigError naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"engine='ray' needs Ray: {INSTALL_HINT}") from None
    return ray


def run_on_ray(fn: Callable[[Any, Any], list], tasks: Iterator[Any], options: Any, *, address: str | None,
               timeout: float) -> Iterator[list]:
    """Yield `fn(task, options)` for each task, in task order, computed on Ray workers; at most
    4 tasks per cluster CPU in flight. Connects to `address` ("auto", "ray://host:10001", ...) or,
    when Ray is not initialised and no address is given, starts a local instance (and stops it
    after). Outstanding tasks are cancelled on an error or Ctrl-C."""
    ray = require_ray()
    started_here = False
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"cannot connect to the Ray cluster at {address!r}: {exc}; start it with "
                              f"`ray start --head` or pass --address of a running one") from None
        started_here = True
    try:
        remote = ray.remote(num_cpus=1, max_retries=2)(fn)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        with _by_value(getattr(getattr(options, "options", options), "map", None)):
            opts_ref = ray.put(options)
        window: deque = deque()
        try:
            for task in tasks:
                window.append(remote.remote(task, opts_ref))
                if len(window) >= 4 * max(cpus, 1):
                    yield _get(ray, window.popleft(), timeout)
            while window:
                yield _get(ray, window.popleft(), timeout)
        finally:
            for ref in window:
                ray.cancel(ref)
    finally:
        if started_here:
            ray.shutdown()


@contextmanager
def _by_value(fn: Any) -> Iterator[None]:
    """While the options are pickled: the module of the user's function `fn` by value, unless it is
    ``__main__`` (cloudpickle's default already) or installed (the workers import it as the driver does)."""
    from ray import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    where = getattr(module, "__file__", None)
    installed = [Path(p).resolve() for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}]
    own = (module is not None and where is not None and module.__name__ != "__main__"
           and not module.__name__.startswith("stoker")
           and not any(Path(where).resolve().is_relative_to(p) for p in installed))
    if own:
        cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        if own:
            cloudpickle.unregister_pickle_by_value(module)


def _get(ray: Any, ref: Any, timeout: float) -> list:
    errors = ray.exceptions
    try:
        return ray.get(ref, timeout=timeout)
    except errors.GetTimeoutError:
        raise StokerError(f"a Ray pack task took more than {timeout:.0f} s and looks stuck (a worker without "
                          "access to the source files?); rerun with resume=True (--resume)") from None
    except (errors.WorkerCrashedError, errors.ObjectLostError, errors.NodeDiedError, errors.RaySystemError) as exc:
        # the cluster failed, not the data: the shards written so far are kept and resume finishes them
        raise StokerError(f"Ray workers died running a pack task, and its retries died too ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); the finished shards are kept: "
                          "check the workers' memory and logs, then rerun with resume=True (--resume) to finish "
                          "the pack") from None
