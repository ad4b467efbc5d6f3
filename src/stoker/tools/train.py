"""The training step the tools measure: the doctor and the demo (a small CNN on the CPU or a GPU) and
the device bench (torchvision models, channels_last, bf16 autocast) run this one step, each with its
own recipe.

    step = TrainStep(small_cnn(10), "cpu")
    for images, labels in loader:     # uint8 [B, 3, H, W] (stoker) or float [B, 3, H, W] (normalized)
        step(images, labels)
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from ..errors import ConfigError

__all__ = ["TrainStep", "check_model", "load_model", "resnet18", "small_cnn"]


def small_cnn(num_classes: int = 10, width: int = 16) -> Any:
    """A small pure-PyTorch CNN for 224 px inputs: a 4x4 stride-4 stem, two stride-2 3x3 convs,
    global pooling, a linear head. A training step (forward and backward) costs about 60 MFLOP per
    image at width 16 (the doctor's default) and 120 MFLOP at width 24."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, width, 4, stride=4), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
        nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.BatchNorm2d(4 * width), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))


def resnet18(num_classes: int = 1000) -> Any:
    """ResNet-18 (He et al. 2016; torchvision's layout: 7x7 stem, four stages of two basic blocks, 64-512
    channels), freshly initialised, for machines where torchvision's models do not import: the same
    layers and FLOPs (1.8 GFLOP forward per 224 px image) as `torchvision.models.resnet18()`."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.skip(x))

    layers: list[Any] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))


def check_model(spec: str) -> None:
    """Fail early, before anything is measured, when a model spec (a torchvision model name or
    'module:callable') cannot be loaded."""
    if not spec or spec != spec.strip():
        raise ConfigError(f"model {spec!r}: expected a torchvision model name (e.g. resnet50) or 'module:callable'")
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        if module_name.split(".")[0] == "torchvision":
            from .tvimport import import_torchvision, status

            if import_torchvision() is None:  # a build for another torch still gives its models (tvimport)
                raise ConfigError(f"model {spec!r}: {status()}; give another 'module:callable' (e.g. "
                                  "stoker.tools.train:small_cnn)")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # ImportError, AttributeError, or a library built for another torch (RuntimeError)
            raise ConfigError(f"model {spec!r}: cannot load it ({type(exc).__name__}: {exc}); expected "
                              "'module:callable' returning an nn.Module, with the module importable") from exc
        if not callable(factory):
            raise ConfigError(f"model {spec!r}: {attr} is not callable")
        return
    from .tvimport import import_torchvision, status

    if import_torchvision() is None:   # a build for another torch still gives its models (tvimport)
        raise ConfigError(f"model {spec!r} is a torchvision model name and {status()}; give 'module:callable' "
                          "instead (e.g. stoker.tools.train:small_cnn)")
    import torchvision.models as tvm
    known = tvm.list_models() if hasattr(tvm, "list_models") else [n for n in dir(tvm) if not n.startswith("_")]
    if spec not in known:
        raise ConfigError(f"model {spec!r}: not a torchvision model; expected one of torchvision.models.list_models() "
                          "(e.g. resnet50, resnet18) or 'module:callable'")


def load_model(spec: str) -> Any:
    """A freshly initialised model: torchvision's `spec` (no weights), or `module:callable()`."""
    from torch import nn

    check_model(spec)
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        model = getattr(importlib.import_module(module_name), attr)()
    else:
        import torchvision.models as tvm
        model = tvm.get_model(spec) if hasattr(tvm, "get_model") else getattr(tvm, spec)()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {spec!r}: expected an nn.Module, got {type(model).__name__}")
    return model


class TrainStep:
    """One SGD step of `model` on a batch, cross entropy, `zero_grad(set_to_none=True)`.

    Images: uint8 `[B, 3, H, W]` (stoker's CPU batches) are moved to `device`, made float and
    normalized with ImageNet mean/std there; float `[B, 3, H, W]` (already normalized) are only moved.
    Integer labels wrap to the model's class count (a data set's labels may exceed a small model's);
    other labels (none, strings) train against class 0.

    The recipe: SGD(`lr`, momentum 0.9, `weight_decay`); `channels_last` puts the model and the input in
    that layout; `autocast` runs forward and loss in bfloat16 (the device bench's recipe on CUDA)."""

    def __init__(self, model: Any, device: Any, *, lr: float = 0.05, weight_decay: float = 0.0,
                 channels_last: bool = False, autocast: bool = False) -> None:
        import torch

        from .._tensors import IMAGENET_MEAN, IMAGENET_STD

        self.device = torch.device(device)
        self.channels_last = channels_last
        model = model.to(device=self.device, memory_format=torch.channels_last) if channels_last else \
            model.to(self.device)
        self.model = model.train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
        self.autocast = autocast
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1) * 255
        self.last_loss: Any = math.nan

    def prepare(self, images: Any) -> Any:
        """The model's input: on the device, float [B, 3, H, W] (normalized from uint8), channels_last if asked."""
        import torch

        x = images.to(self.device, non_blocking=True)
        if x.dtype == torch.uint8:   # uint8 -> float, normalized, on the device (keeps channels_last strides)
            x = x.float().sub_(self.mean).div_(self.std)
        # a no-op when the feed delivers channels_last already
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def targets(self, labels: Any, n: int, classes: int) -> Any:
        """Class indices in [0, classes) on the device for a batch of `n`."""
        import torch

        if isinstance(labels, torch.Tensor) and labels.dtype in (torch.int64, torch.int32):
            return labels.to(self.device, non_blocking=True).long().clamp(min=0) % classes
        return torch.zeros(n, dtype=torch.long, device=self.device)   # unlabelled or non-class labels

    def __call__(self, images: Any, labels: Any) -> None:
        import torch
        import torch.nn.functional as F

        x = self.prepare(images)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(x)
            loss = F.cross_entropy(logits, self.targets(labels, x.shape[0], logits.shape[-1]))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.last_loss = loss.detach()
