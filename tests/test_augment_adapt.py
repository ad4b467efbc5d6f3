"""Bring-your-own transforms: containers flattened, torchvision transforms translated to stoker's ops,
PIL/tensor callables adapted, their randomness keyed by the sample, failures named.

torchvision cannot be imported on CPU test machines, so its classes are stood in for by classes
with its module path and its attribute names (what `translate` reads)."""

from __future__ import annotations

import enum
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stoker.device.stage import DeviceOptions
from stoker.errors import ConfigError, SampleError
from stoker.loader import Loader
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop, colour, policy
from stoker.transforms.adapt import Adapted, TransformError, adapt, as_ops
from stoker.transforms.mixing import Mixup
from test_loader import build_packed

TV = "torchvision.transforms.transforms"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"


def tv(name: str, **attrs):
    """An object that looks to `translate` like torchvision's `name` with these attributes."""
    cls = type(name, (), {"__module__": TV, "__call__": lambda self, img: img})
    obj = cls()
    obj.__dict__.update(attrs)
    return obj


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, img):
        for t in self.transforms:
            img = t(img)
        return img


def test_single_list_compose_and_sequential_are_flattened():
    flip = RandomHorizontalFlip()
    assert as_ops(flip) == ([flip], [])
    assert as_ops(None) == ([], [])
    nested = Compose([RandomResizedCrop(8), Compose([flip, colour.RandomGrayscale(0.2)])])
    ops, batch = as_ops(nested)
    assert ops == [RandomResizedCrop(8), flip, colour.RandomGrayscale(0.2)] and batch == []
    ops, _ = as_ops(torch.nn.Sequential(torch.nn.Identity()))
    assert len(ops) == 1 and isinstance(ops[0], Adapted)


def test_torchvision_transforms_become_stokers_own():
    pipeline = Compose([
        tv("RandomResizedCrop", size=[224, 224], scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)),
        tv("RandomHorizontalFlip", p=0.5),
        tv("ColorJitter", brightness=(0.6, 1.4), contrast=None, saturation=(0.6, 1.4), hue=(-0.1, 0.1)),
        tv("RandAugment", num_ops=2, magnitude=9, num_magnitude_bins=31, interpolation=InterpolationMode.BILINEAR,
           fill=None),
        tv("RandomGrayscale", p=0.1),
        tv("GaussianBlur", kernel_size=(5, 5), sigma=(0.1, 2.0)),
        tv("ToTensor"),
        tv("Normalize", mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        tv("RandomErasing", p=0.25, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0),
    ])
    ops, batch = as_ops(pipeline)
    assert ops == [RandomResizedCrop(224), RandomHorizontalFlip(0.5),
                   colour.ColorJitter((0.6, 1.4), 0, (0.6, 1.4), (-0.1, 0.1)),
                   policy.RandAugment(2, 9, 31, "bilinear", None), colour.RandomGrayscale(0.1), colour.GaussianBlur(5, (0.1, 2.0))]
    assert [type(b).__name__ for b in batch] == ["Normalize", "RandomErasing"]
    with pytest.raises(ConfigError, match="before Normalize"):
        as_ops([tv("Normalize", mean=[0.5], std=[0.5]), RandomHorizontalFlip()])


def test_untranslatable_torchvision_transform_runs_through_pil():
    rot = tv("RandomRotation", degrees=[-10, 10])
    ops, _ = as_ops([rot])
    assert isinstance(ops[0], Adapted) and ops[0].input == "pil" and ops[0].random == "global"


@pytest.fixture
def img() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)


def test_pil_and_tensor_callables_are_detected_and_converted_back(img):
    pil_op = adapt(lambda im: im.transpose(Image.FLIP_TOP_BOTTOM))
    with pytest.warns(UserWarning, match="PIL image and back"):
        assert np.array_equal(pil_op(img.copy()), img[::-1])
    assert pil_op.input == "pil"
    tensor_op = adapt(lambda t: t.flip(-1).float() / 255.0)  # CHW in, float [0, 1] out (ToTensor-style)
    with pytest.warns(UserWarning, match="CHW tensor"):
        assert np.array_equal(tensor_op(img.copy()), img[:, ::-1])
    assert tensor_op.input == "tensor"
    grey = adapt(lambda im: im.convert("L"), input="pil")
    with pytest.warns(UserWarning):
        out = grey(img.copy())
    assert out.shape == img.shape and (out[..., 0] == out[..., 1]).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain numpy function is the fast path: no warning
        assert np.array_equal(adapt(lambda a: a[:, ::-1])(img.copy()), img[:, ::-1])


class TorchNoise:
    """A transform object drawing from torch's global generator, like torchvision's."""

    def __call__(self, im: Image.Image) -> Image.Image:
        a = np.asarray(im).astype(np.int16) + int(torch.randint(0, 50, (1,))) + random.randint(0, 5)
        return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def test_global_generator_transforms_are_keyed_by_the_sample_and_leave_global_state(img):
    op = adapt(TorchNoise(), input="pil")
    assert op.random == "global"
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match="lock"):
        a = op(img.copy(), rng=np.random.default_rng(5))
    b = op(img.copy(), rng=np.random.default_rng(5))
    c = [op(img.copy(), rng=np.random.default_rng(s)) for s in range(6, 12)]
    assert np.array_equal(a, b)
    assert any(not np.array_equal(a, x) for x in c)
    assert torch.equal(torch.get_rng_state(), before)  # the training loop's generator is untouched


def test_failures_name_the_transform(img):
    def broken(a):
        raise KeyError("boom")

    op = adapt(broken, input="numpy")
    with pytest.raises(KeyError) as info:  # the transform's own exception, named
        op(img)
    assert "in transform broken (numpy input, a 30x20 image)" in info.value.__notes__
    with pytest.raises(KeyError):  # not mistaken for "takes another kind of input"
        adapt(broken)(img)
    with pytest.raises(TransformError, match="accepts none of"):
        adapt(lambda a: a.no_such_method())(img)
    with pytest.raises(TransformError, match="returned str"):
        adapt(lambda a: "nope", input="numpy")(img)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_packed(tmp_path_factory.mktemp("adapt") / "ds", n=24)


def test_adapted_transforms_in_the_loader_are_deterministic_for_any_thread_count(packed: Path):
    tf = Compose([RandomResizedCrop(16), tv("RandomRotation"), adapt(TorchNoise(), input="pil"),
                  policy.RandAugment(), colour.ColorJitter(0.4, 0.4, 0.4, 0.1)])
    runs = []
    for threads in (1, 2):
        ops, _ = as_ops(tf)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = Loader(packed, 6, transforms=ops, seed=1, workers=threads)
            runs.append(np.concatenate([b[0].numpy().copy() for b in loader]))
    assert np.array_equal(runs[0], runs[1])


def test_a_failing_user_transform_names_sample_and_transform(packed: Path):
    def explode(a):
        raise ValueError("no thanks")

    ops, _ = as_ops([RandomResizedCrop(16), adapt(explode, input="numpy")])
    with pytest.raises(SampleError, match=r"transform explode raised ValueError: no thanks on sample 'img/\d+\.x'"):
        for _ in Loader(packed, 4, transforms=ops, workers=1):
            pass


# ---- the Loader takes all of it through transforms= -------------------------------------------
def deit_pipeline():
    """A DeiT-style torchvision Compose, as a user has it, plus a Mixup at the end."""
    return [Compose([tv("RandomResizedCrop", size=[16, 16], scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)),
                     tv("RandomHorizontalFlip", p=0.5),
                     tv("RandAugment", num_ops=2, magnitude=9, num_magnitude_bins=31,
                        interpolation=InterpolationMode.NEAREST, fill=None),
                     tv("ToTensor"), tv("Normalize", mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
                     tv("RandomErasing", p=0.25, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0)]),
            Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=24)]


def collect(loader, stop=None):
    out = []
    for k, (x, t) in enumerate(loader):
        out.append((x.clone(), t.clone()))
        if stop is not None and k + 1 == stop:
            break
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_a_torchvision_compose_drops_into_the_loader(packed: Path):
    one = collect(Loader(packed, 6, transforms=deit_pipeline(), seed=4, workers=1))
    x, t = one[0]
    assert x.shape == (6, 3, 16, 16) and x.dtype == torch.float32 and x.min() < -1.0  # normalized NCHW
    assert t.shape == (6, 24) and torch.allclose(t.sum(1), torch.ones(6))  # soft targets
    assert same(one, collect(Loader(packed, 6, transforms=deit_pipeline(), seed=4, workers=2)))
    # the device stage (here on the CPU) runs the same batch ops, with the same draws
    assert same(one, collect(Loader(packed, 6, transforms=deit_pipeline(), seed=4, device="cpu", workers=2)))
    first = Loader(packed, 6, transforms=deit_pipeline(), seed=4, workers=2)
    collect(first, stop=2)
    resumed = Loader(packed, 6, transforms=deit_pipeline(), seed=4, workers=1)
    resumed.load_state_dict(first.state_dict())
    assert same(one[2:], collect(resumed))


def test_single_transforms_and_bad_orders(packed: Path):
    batch = next(iter(Loader(packed, 4, transforms=RandomResizedCrop(12), workers=1)))
    assert batch[0].shape == (4, 3, 12, 12)
    with pytest.raises(ConfigError, match="Mixup must be the last"):
        Loader(packed, 4, transforms=[RandomResizedCrop(12), Mixup(num_classes=24), G_NORMALIZE()])
    with pytest.raises(ConfigError, match="keep one"):
        Loader(packed, 4, transforms=[RandomResizedCrop(12), G_NORMALIZE()],
               device=DeviceOptions(device="cpu", normalize="imagenet"))
    with pytest.raises(ConfigError, match="on whole batches"):
        Loader(packed, 4, transforms=[RandomResizedCrop(12), G_NORMALIZE(), colour.RandomGrayscale()])


def G_NORMALIZE():
    from stoker.transforms.batch_ops import Normalize

    return Normalize("imagenet")


def test_a_preset_object_is_flattened_like_its_compose(tmp_path: Path) -> None:
    """torchvision references' presets hold a Compose in `.transforms` and call it: such an object (built
    here in that shape around torchvision's own v1 transforms) flattens to the Compose's transforms, so the
    Loader sees the RandomResizedCrop it ends in (it blamed the data: 'images differ in size and the
    transforms do not end in a fixed size') and loads the same batches as the flat list."""
    from torchvision_helpers import v1

    T = v1()

    class PresetTrain:
        def __init__(self, crop: int) -> None:
            self.transforms = T.Compose([T.RandomResizedCrop(crop), T.RandomHorizontalFlip(), T.PILToTensor(),
                                         T.ConvertImageDtype(torch.float),
                                         T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))])

        def __call__(self, img):
            return self.transforms(img)

    preset = PresetTrain(24)
    assert as_ops(preset) == as_ops(preset.transforms) == as_ops(list(preset.transforms.transforms))
    packed = build_packed(tmp_path / "ds", n=12)
    a = Loader(packed, 4, transforms=preset, seed=2)
    b = Loader(packed, 4, transforms=preset.transforms.transforms, seed=2)
    for (x, y), (u, v) in zip(a, b):
        assert x.shape == (4, 3, 24, 24) and torch.equal(x, u) and torch.equal(y, v)
    a.close(), b.close()
