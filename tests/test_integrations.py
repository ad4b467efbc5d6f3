"""docs/integrations.md runs as written: Lightning and accelerate end to end on CPU, resumed from
their own checkpoints; the timm replacement for create_loader (its stoker half always; the part
that imports timm where timm is installed)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import stoker
from stoker.tools.synth import make_imagenet_like
from torchvision_helpers import torchvision_importable


@pytest.fixture(autouse=True)
def _torchvision_imports() -> None:
    """Lightning (through torchmetrics) and timm import torchvision where it is installed; one built for
    another torch (the CUDA wheel beside a CPU torch) is made importable first."""
    torchvision_importable()

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def _blocks(heading: str) -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], flags=re.S)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """README's first steps: 120 synthetic images packed into ./packed."""
    root = tmp_path_factory.mktemp("integrations")
    make_imagenet_like(root / "imgs", 120, classes=10, seed=0, workers=1)
    stoker.pack(root / "imgs", root / "packed", progress=False)
    return root


@pytest.fixture()
def in_workdir(workdir: Path):
    cwd = Path.cwd()
    os.chdir(workdir)
    try:
        yield workdir
    finally:
        os.chdir(cwd)


def _run(code: str, **names) -> dict:
    namespace = {"__name__": "docs_integrations", **names}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


def test_lightning_checkpoint_carries_the_loader_and_resume_is_exact(in_workdir: Path) -> None:
    L = pytest.importorskip("lightning")
    (code,) = _blocks("PyTorch Lightning")
    ns = _run(code)   # trains 20 steps, writes step20.ckpt
    state = torch.load("step20.ckpt", weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    # 120 images are 4 batches of 32 (the last of 24): 20 steps end epoch 4, the next one is epoch 5
    assert state[0]["format"] == "stoker.Loader/1" and (state[0]["epoch"], state[0]["sample"]) == (5, 0)

    class Recording(ns["Classifier"]):
        seen: list

        def training_step(self, batch, batch_idx):
            self.seen.append(batch[1].tolist())
            return super().training_step(batch, batch_idx)

    def fit(max_steps: int, ckpt: str | None = None, save: str | None = None) -> list:
        model = Recording()
        model.seen = []
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(model, ns["PackedImages"]("packed"), ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        return model.seen

    whole = fit(9)
    first = fit(5, save="step5.ckpt")   # mid-epoch (epoch 1, batch 2)
    rest = fit(9, ckpt="step5.ckpt")
    assert first + rest == whole and len(rest) == 4


def test_timm_create_loader_replacement(in_workdir: Path) -> None:
    helper, without_timm, usage = _blocks("timm's training script")
    ns = _run(helper)
    data_config = {"input_size": (3, 48, 40), "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225),
                   "crop_pct": 0.875, "interpolation": "bicubic"}
    train = ns["stoker_loader"]("packed", data_config, 16, is_training=True, device="cpu")
    images, labels = next(iter(train))
    assert images.dtype == torch.float32 and images.shape == (16, 3, 48, 40) and labels.shape == (16,)
    assert -2.2 < float(images.min()) and float(images.max()) < 2.7 and abs(float(images.mean())) < 1.5
    assert len(train) == 120 // 16   # drop_last while training, as create_loader
    val = ns["stoker_loader"]("packed", data_config, 16, is_training=False, device="cpu")
    first = [y.tolist() for _, y in val]
    assert len(val) == 8 and first == [y.tolist() for _, y in val]   # sequential: same order each pass
    train.close()
    val.close()
    # the block for machines where timm cannot import runs everywhere
    plain = _run(without_timm, **ns)
    assert plain["images"].shape == (64, 3, 224, 224) and plain["images"].dtype == torch.float32
    assert len(plain["loader_train"]) == 1 and len(plain["loader_eval"]) == 2   # 120 images, batch 64
    try:
        import timm
        from timm.data import resolve_data_config
    except Exception as exc:   # not installed here; where torchvision is broken it raises RuntimeError
        pytest.skip(f"timm is not importable ({type(exc).__name__}); its stoker half ran above")
    # the values written out for machines without timm are what timm resolves for a ResNet
    resolved = resolve_data_config({}, model=timm.create_model("resnet18", num_classes=10))
    for key in ("input_size", "mean", "std"):
        assert tuple(resolved[key]) == tuple(plain["data_config"][key]), key
    real = _run(usage, **ns)
    assert real["images"].shape == (64, 3, 224, 224) and torch.isfinite(real["loss"])


def test_accelerate_save_state_carries_the_loader(in_workdir: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    (code,) = _blocks("Hugging Face accelerate")
    ns = _run(code)
    saved = ns["train"].state_dict()
    assert (saved["epoch"], saved["batch"]) == (0, 3)
    ns["train"].load_state_dict(saved)   # a plain iter() reads a whole epoch; a resume continues
    expected = [y.tolist() for _, y in ns["train"]]   # what the run would have seen next
    ns["train"].close()

    again = stoker.Loader("packed", 32, seed=0, transforms=[stoker.RandomResizedCrop(64),
                                                            stoker.RandomHorizontalFlip()])
    acc = accelerate.Accelerator()
    acc.register_for_checkpointing(again)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, stride=4), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    acc.prepare(model, optimizer)
    acc.load_state("checkpoint")
    assert again.state_dict() == saved
    assert [y.tolist() for _, y in again] == expected and len(expected) == 1   # 4 batches of 120 images
