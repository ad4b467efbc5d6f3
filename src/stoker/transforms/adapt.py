"""Bring your own transforms: a single transform, a list, or a Compose-like object; callables on numpy
HWC uint8 arrays, PIL images or CHW tensors.

`as_ops(transforms)` turns whatever the user passed into the list the Pipeline compiles:

- containers are flattened (the result is what `Pipeline` compiles: per-sample ops, then batch ops): a list or tuple, anything with a `.transforms` list (torchvision's and
  albumentations' `Compose`), or with a `.transforms` container (a preset object), a `torch.nn.Sequential`;
- torchvision's own transforms are replaced by stoker's equivalents with the same parameters
  (RandomResizedCrop, Resize with their interpolation and antialias, CenterCrop, RandomHorizontalFlip,
  ColorJitter, RandAugment, TrivialAugmentWide, AutoAugment(IMAGENET), GaussianBlur, RandomGrayscale),
  so a user's pipeline drops in and runs on the fast path; an interpolation stoker has no kernel for is
  refused, never swapped; conversions (ToTensor, PILToTensor, ToImage, ToDtype, ConvertImageDtype) are
  dropped (stoker's batches are uint8, converted on the device), the value range they leave kept for
  the Normalize after them (0..255 after `ToDtype(float32)` without `scale=True`), and a float conversion
  no Normalize follows made a batch op of its own (the float32 batches it gave, 0..1 or 0..255); Normalize
  and RandomErasing, which torchvision runs on normalized tensors, become stoker's batched ops
  (`batch_ops.Normalize`, `batch_ops.RandomErasing`), v2's MixUp / CutMix (and a RandomChoice of them) stoker's
  `Mixup`, as do stoker's batched ops and a `Mixup` given directly;
- any other callable is wrapped in `Adapted`: the sample is handed over as the kind it takes
  (declared with `adapt(fn, input=...)`, else detected on the first sample), its result converted
  back, its randomness made reproducible (a transform that takes `rng=` gets the sample's Generator;
  others that draw from the global torch/numpy/random generators run under one lock with those
  generators seeded from the sample's key), and a failure names the transform.

Each slow path (PIL or tensor round trip, the global-generator lock) is announced once with a
one-line warning naming the transform and a faster alternative.
"""

from __future__ import annotations

import random
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, StokerError
from . import batch_ops, colour, mixing, policy
from .mixing import Mixup
from .geometry import INTERPOLATIONS, CenterCrop, RandomHorizontalFlip, RandomResizedCrop, Resize
from .kinds import BATCH, SAMPLE, moves_pixels, stage_of

INPUTS = ("numpy", "pil", "tensor")
RANDOMNESS = ("rng", "global", "none")
_GLOBAL_RNG_LOCK = threading.Lock()  # the global generators are process-wide: one seeded call at a time
_CONVERSIONS = {"ToTensor", "PILToTensor", "ToImage", "ToImageTensor", "ToDtype", "ConvertImageDtype",
                "ConvertImageDType", "ToPureTensor"}


class TransformError(StokerError, TypeError):
    """A user transform takes or returns something that is not an image; names the transform."""


def _name(fn: Any) -> str:
    """How errors and warnings call a transform: a function's name, or an object's repr when
    short (`RandomRotation(degrees=[-10.0, 10.0])`), else its class name."""
    if hasattr(fn, "__code__"):  # a lambda by where it was written: `make_pipeline.<locals>.<lambda>`
        return fn.__qualname__ if fn.__name__ == "<lambda>" else fn.__name__
    text = repr(fn)
    return text if len(text) <= 80 and " at 0x" not in text else type(fn).__name__


def _from_torchvision(t: Any) -> bool:
    return type(t).__module__.startswith("torchvision.")


POLICY_INTERPOLATIONS = ("nearest", "bilinear")  # the policies' rotate/shear/translate kernels (pixels.py)
#: PIL's integer filter codes, which torchvision transforms also accept for `interpolation=`
_PIL_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def _interp_name(value: Any) -> str:
    """torchvision's InterpolationMode (or a PIL filter code) as its name: "bilinear", "nearest-exact"..."""
    if isinstance(value, int) and not hasattr(value, "value"):
        return _PIL_FILTERS.get(value, str(value))
    return str(getattr(value, "value", value)).lower()


def _interp(t: Any, allowed: tuple[str, ...], default: str) -> str:
    """The interpolation of torchvision transform `t` (`default` where it has none), refused (never
    swapped) where stoker has no such kernel."""
    name = _interp_name(getattr(t, "interpolation", default))
    if name not in allowed:
        raise ConfigError(f"{type(t).__name__}(interpolation={name}): stoker's {type(t).__name__} supports "
                          f"{', '.join(allowed)}; choose one of those, or keep torchvision's op with "
                          f"stoker.adapt({type(t).__name__}(...)) (slower: it runs on PIL images)")
    return name


def _resize_args(t: Any) -> dict[str, Any]:
    """interpolation= and antialias= of a torchvision resize, as stoker's geometry takes them. antialias=None
    (no antialiasing on tensors) is False; NEAREST ignores it, as torchvision does."""
    return {"interpolation": _interp(t, INTERPOLATIONS, "bilinear"), "antialias": bool(getattr(t, "antialias", True))}


def _range(value: Any) -> Any:
    """ColorJitter stores (min, max) lists or None; stoker takes the same (0 for None)."""
    return 0 if value is None else (float(value[0]), float(value[1]))


def _fill(value: Any) -> Any:
    if value is None or isinstance(value, (int, float)):
        return value
    if isinstance(value, dict):  # torchvision v2: {type: fill}; images use the entry for images or None
        return next(iter(value.values()), None)
    return tuple(value)


def translate(t: Any) -> Any:
    """stoker's equivalent of a torchvision transform (same parameters), "drop" for a conversion that
    stoker's batches make unnecessary, or None when there is no equivalent."""
    if not _from_torchvision(t):
        return None
    name = type(t).__name__
    if name in _CONVERSIONS:
        return "drop"
    if name == "RandomResizedCrop":
        return RandomResizedCrop(tuple(t.size), scale=tuple(t.scale), ratio=tuple(t.ratio), **_resize_args(t))
    if name == "Resize" and getattr(t, "max_size", None) is None:
        size = t.size
        return Resize(size if isinstance(size, int) else tuple(size), **_resize_args(t))
    if name == "CenterCrop":
        return CenterCrop(tuple(t.size))
    if name == "RandomHorizontalFlip":
        return RandomHorizontalFlip(p=float(t.p))
    if name == "ColorJitter":
        return colour.ColorJitter(_range(t.brightness), _range(t.contrast), _range(t.saturation), _range(t.hue))
    if name == "RandAugment":
        return policy.RandAugment(int(t.num_ops), int(t.magnitude), int(t.num_magnitude_bins),
                                  _interp(t, POLICY_INTERPOLATIONS, "nearest"), _fill(t.fill))
    if name == "TrivialAugmentWide":
        return policy.TrivialAugmentWide(int(t.num_magnitude_bins), _interp(t, POLICY_INTERPOLATIONS, "nearest"), _fill(t.fill))
    if name == "AutoAugment" and str(getattr(t.policy, "value", t.policy)).lower() == "imagenet":
        return policy.AutoAugment("imagenet", _interp(t, POLICY_INTERPOLATIONS, "nearest"), _fill(t.fill))
    if name == "GaussianBlur":
        return colour.GaussianBlur(tuple(t.kernel_size), tuple(t.sigma))
    if name == "RandomGrayscale":
        return colour.RandomGrayscale(p=float(t.p))
    return None


#: torchvision containers that run only some of their transforms: never flattened into a sequence
_RANDOM_CONTAINERS = {"RandomChoice", "RandomApply", "RandomOrder"}


def _children(t: Any) -> list[Any] | None:
    """The transforms inside a container, or None when `t` is not one (or one that picks among them)."""
    if isinstance(t, (list, tuple)):
        return list(t)
    if _from_torchvision(t) and type(t).__name__ in _RANDOM_CONTAINERS:
        return None
    inner = getattr(t, "transforms", None)
    if isinstance(inner, (list, tuple)) and not isinstance(t, type):
        return list(inner)
    if inner is not None and not isinstance(t, type) and callable(t) and _children(inner) is not None:
        return [inner]   # a preset object (torchvision references' ClassificationPresetTrain): .transforms a Compose
    try:
        import torch

        if isinstance(t, torch.nn.Sequential):
            return list(t)
    except ImportError:  # torch is a core dependency; guarded only so this module imports on its own
        pass
    return None


def _scaling(t: Any, unscaled: bool) -> bool:
    """Whether the images are float in 0..255 after torchvision conversion `t` (they were if `unscaled`):
    `ToDtype(torch.float32)` without `scale=True` converts without dividing by 255; ToTensor,
    ConvertImageDtype and `ToDtype(..., scale=True)` scale to 0..1."""
    name = type(t).__name__
    if name in ("ToTensor", "ConvertImageDtype"):
        return False
    if name == "ToDtype" and _float_images(t):
        return not bool(getattr(t, "scale", False))
    return unscaled


def _float_images(t: Any) -> bool:
    """Whether a ToDtype / ConvertImageDtype gives images a float dtype (v2's dict form read for its Image entry)."""
    dtype = t.dtype
    if isinstance(dtype, dict):  # v2: {tv_tensors.Image: torch.float32, "others": None}
        dtype = next((v for k, v in dtype.items() if getattr(k, "__name__", k) in ("Image", "others")), None)
    return bool(getattr(dtype, "is_floating_point", False))


def _gives_float(t: Any) -> bool:
    """Whether torchvision conversion `t` makes float images (ToTensor; ConvertImageDtype or ToDtype to a float)."""
    name = type(t).__name__
    return name == "ToTensor" or (name in ("ToDtype", "ConvertImageDtype") and _float_images(t))


def _mix(t: Any) -> Mixup | None:
    """torchvision v2's MixUp / CutMix, or a RandomChoice of one of each (its v2 recipe), as a stoker Mixup."""
    if not _from_torchvision(t):
        return None
    name = type(t).__name__
    if name == "MixUp":
        return mixing.MixUp(t.alpha, t.num_classes)
    if name == "CutMix":
        return mixing.CutMix(t.alpha, t.num_classes)
    if name == "RandomChoice" and t.transforms and all(type(k).__name__ in ("MixUp", "CutMix") for k in t.transforms):
        return mixing.mix_choice([_mix(k) for k in t.transforms], list(t.p))
    return None


def _batch_op(t: Any, unscaled: bool = False) -> Any:
    """stoker's batched op for `t` (torchvision's Normalize / RandomErasing translated), or None.
    `unscaled`: a conversion before it left float values in 0..255 (stoker's Normalize works on 0..1)."""
    if stage_of(t) == BATCH:   # stoker's batched ops and a Mixup, or any op declared so
        return t
    mix = _mix(t)
    if mix is not None:
        return mix
    if _from_torchvision(t) and type(t).__name__ == "Normalize":
        k = 255.0 if unscaled else 1.0
        return batch_ops.Normalize(tuple(float(v) / k for v in t.mean), tuple(float(v) / k for v in t.std))
    if _from_torchvision(t) and type(t).__name__ == "RandomErasing":
        value = t.value if isinstance(t.value, str) or t.value is None else t.value
        return batch_ops.RandomErasing(float(t.p), tuple(t.scale), tuple(t.ratio), "random" if value is None else value)
    return None


def as_ops(transforms: Any) -> tuple[list[Any], list[Any]]:
    """(per-sample ops for the Pipeline, batch ops) from whatever `transforms=` was given."""
    if transforms is None:
        return [], []
    flat: list[Any] = []

    def walk(t: Any) -> None:
        kids = _children(t)
        if kids is None:
            flat.append(t)
        else:
            for k in kids:
                walk(k)

    walk(transforms)
    ops: list[Any] = []
    batch: list[Any] = []
    unscaled = floats = False
    for pos, t in enumerate(flat):
        if _from_torchvision(t) and type(t).__name__ in _CONVERSIONS:
            unscaled = _scaling(t, unscaled)
            floats = floats or _gives_float(t)
        as_batch = _batch_op(t, unscaled)
        if as_batch is not None:
            batch.append(as_batch)
            continue
        if batch:
            raise ConfigError(f"transform #{pos} ({_name(t)}) comes after {type(batch[-1]).__name__}, which stoker runs "
                              f"on whole batches; put per-image transforms before Normalize/RandomErasing/Mixup")
        native = translate(t)
        if native == "drop":
            continue
        if native is not None:
            ops.append(native)
        elif stage_of(t) is not None:   # declared planned geometry or per-sample op (kinds.py)
            ops.append(t)
        elif callable(t):
            ops.append(adapt(t))
        else:
            raise ConfigError(f"transform #{pos} is {t!r}: expected a stoker transform, a torchvision transform, "
                              f"or a callable on a uint8 HWC numpy array, a PIL image or a CHW tensor")
    if floats and not any(getattr(op, "gives", None) == "float" for op in batch):
        # a float conversion no Normalize follows: the batches are the floats it made (0..1, or 0..255 unscaled),
        # converted where the batch ops run (after the copy, on a device)
        k = 255.0 if unscaled else 1.0
        batch.insert(0, batch_ops.Normalize((0.0, 0.0, 0.0), (1.0 / k,) * 3))
    return ops, batch


# ---- adapting one callable --------------------------------------------------------------------
def _takes_rng(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "rng" in params


def _to_kind(img: np.ndarray, kind: str) -> Any:
    if kind == "numpy":
        return img
    if kind == "pil":
        from PIL import Image

        return Image.fromarray(img)
    import torch

    return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)


def _to_array(out: Any, name: str) -> np.ndarray:
    """A transform's result as uint8 HWC RGB: numpy HWC/HW, PIL, or a CHW tensor (uint8, or float in [0, 1])."""
    if isinstance(out, np.ndarray):
        arr = out
    elif hasattr(out, "mode") and hasattr(out, "size") and hasattr(out, "convert"):  # a PIL image
        arr = np.asarray(out if out.mode == "RGB" else out.convert("RGB"))
    elif hasattr(out, "permute") and hasattr(out, "numpy"):  # a torch tensor, CHW
        t = out.detach().cpu()
        if t.ndim != 3 or t.shape[0] not in (1, 3):
            raise TransformError(f"transform {name} returned a tensor of shape {tuple(t.shape)}; expected CHW "
                                 f"with 1 or 3 channels")
        if t.dtype.is_floating_point:
            t = (t.clamp(0, 1) * 255).round()
        arr = t.numpy().astype(np.uint8).transpose(1, 2, 0)
    else:
        raise TransformError(f"transform {name} returned {type(out).__name__}; expected an image (a uint8 HWC numpy "
                             f"array, a PIL image or a CHW tensor)")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] not in (1, 3):
        raise TransformError(f"transform {name} returned a {arr.dtype} array of shape {arr.shape}; expected a uint8 "
                             f"HxWx3 array (or HxW grey)")
    if arr.shape[2] == 1:
        arr = np.repeat(arr, 3, axis=2)
    return arr


def _seeded_call(fn: Callable[..., Any], arg: Any, seed: int) -> Any:
    """Call `fn` with torch's CPU generator, numpy's legacy global and `random` seeded from `seed`,
    restoring their states afterwards (the training loop's draws are left as they were)."""
    import torch

    with _GLOBAL_RNG_LOCK:
        t_state, np_state, py_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
        try:
            torch.default_generator.manual_seed(seed)
            np.random.seed(seed & 0xFFFFFFFF)
            random.seed(seed)
            return fn(arg)
        finally:
            torch.set_rng_state(t_state)
            np.random.set_state(np_state)
            random.setstate(py_state)


@dataclass
class Adapted:
    """A user callable made into a per-sample op: `input` is what it takes ("numpy", "pil",
    "tensor"; None: detected on the first sample), `random` how its randomness is keyed ("rng": it
    takes `rng=`; "global": it draws from torch/numpy/random's global generators, seeded per sample
    under one lock; "none": deterministic)."""

    fn: Callable[..., Any]
    input: str | None = None
    random: str | None = None
    name: str = ""
    _warned: bool = field(default=False, repr=False)
    stage = SAMPLE

    @property
    def moves_pixels(self) -> bool:
        """What the wrapped callable declares (undeclared: it may move pixels)."""
        return moves_pixels(self.fn)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(f"adapt() needs a callable, got {self.fn!r}")
        if self.input is not None and self.input not in INPUTS:
            raise ConfigError(f"adapt(input=...) must be one of {INPUTS} or None (detect), got {self.input!r}")
        if self.random is None:
            self.random = "rng" if _takes_rng(self.fn) else ("global" if _uses_global_rng(self.fn) else "none")
        if self.random not in RANDOMNESS:
            raise ConfigError(f"adapt(random=...) must be one of {RANDOMNESS}, got {self.random!r}")
        self.name = self.name or _name(self.fn)
        if self.input is None and _from_torchvision(self.fn):
            self.input = "pil"  # what torchvision transforms were written and tested for

    def _warn_once(self) -> None:
        if self._warned:
            return
        self._warned = True
        slow = []
        if self.input in ("pil", "tensor"):
            slow.append(f"each sample goes to a {'PIL image' if self.input == 'pil' else 'CHW tensor'} and back")
        if self.random == "global":
            slow.append("it draws from global generators, so calls are serialised under one lock")
        if slow:
            warnings.warn(f"stoker: transform {self.name} runs on a slow path ({'; '.join(slow)}); stoker's own ops "
                          f"(stoker.transforms) or a numpy callable taking rng= run in parallel", stacklevel=2)

    def _call(self, arg: Any, rng: np.random.Generator | None) -> Any:
        if self.random == "rng":
            return self.fn(arg, rng=rng if rng is not None else np.random.default_rng())
        if self.random == "global":
            seed = int((rng if rng is not None else np.random.default_rng()).integers(1 << 62))
            return _seeded_call(self.fn, arg, seed)
        return self.fn(arg)

    def _detect(self, img: np.ndarray, rng: np.random.Generator | None) -> Any:
        """Try numpy, then PIL, then a tensor; keep the first kind the callable accepts. A kind counts
        as rejected when the call raises AttributeError, TypeError or ValueError (`'numpy.ndarray' object
        has no attribute 'rotate'`); any other exception is the transform's own failure, and what it
        returns is checked like any later result.
        Each try gets a copy of the sample and a generator in the same state, so detection changes no
        result."""
        state = None if rng is None else rng.bit_generator.state
        errors = []
        for kind in INPUTS:
            if rng is not None:
                rng.bit_generator.state = state
            try:
                out = self._call(_to_kind(img.copy(), kind), rng)
            except (AttributeError, TypeError, ValueError) as exc:  # not the kind it takes
                errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                continue
            except Exception as exc:
                self._note(exc, img, kind)
                raise
            self.input = kind
            return out
        raise TransformError(f"transform {self.name} accepts none of a uint8 HWC numpy array, a PIL image or a CHW "
                             f"uint8 tensor ({'; '.join(errors)}); declare what it takes with "
                             f"stoker.adapt(fn, input='numpy'|'pil'|'tensor')")

    def _note(self, exc: BaseException, img: np.ndarray, kind: str | None) -> None:
        """Name the transform on its own exception (kept as it is, with its traceback): the Loader's
        SampleError repeats the note beside the sample's key."""
        exc.add_note(f"in transform {self.name} ({kind or 'numpy'} input, a {img.shape[1]}x{img.shape[0]} image)")

    def __call__(self, img: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        if self.input is None:
            out = self._detect(img, rng)
        else:
            try:
                out = self._call(_to_kind(img, self.input), rng)
            except Exception as exc:
                self._note(exc, img, self.input)
                raise
        self._warn_once()
        return _to_array(out, self.name)


def _uses_global_rng(fn: Any) -> bool:
    """Transform objects from libraries (torch modules, torchvision, albumentations...) draw from
    global generators; a plain function of the image is taken as deterministic."""
    try:
        import torch

        if isinstance(fn, torch.nn.Module):
            return True
    except ImportError:
        pass
    module = type(fn).__module__ or ""
    return not (callable(fn) and hasattr(fn, "__code__")) and module.split(".")[0] not in ("builtins", "functools")


def adapt(fn: Callable[..., Any], input: str | None = None, random: str | None = None, name: str = "") -> Adapted:
    """Wrap a callable for `Loader(transforms=...)`: `input` "numpy" | "pil" | "tensor" (None:
    detect), `random` "rng" | "global" | "none" (None: `rng=` in its signature gives "rng",
    a transform object "global", a plain function "none")."""
    return fn if isinstance(fn, Adapted) else Adapted(fn, input, random, name)
