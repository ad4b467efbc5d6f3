"""DataLoader's keywords and sources, read the way stoker means them, or refused naming stoker's own.

A DataLoader user passes what they know (`sampler=`, `persistent_workers=`, ...). Each keyword either
maps to stoker's meaning or raises a ConfigError that names stoker's argument, never a bare
TypeError; a source stoker cannot read (a torch Dataset, a list of paths) is refused with the way
to read it. `pinned_labels` remaps a dataset's labels onto a pinned class list (`classes=`).
"""

from __future__ import annotations

import os
from pathlib import Path
import warnings
import weakref
from typing import Any, Iterator, Sequence

import numpy as np

from .._torch import torch
from ..errors import ConfigError
from ..spelling import LOADER_HINTS, unknown_keyword

#: DataLoader keywords stoker has no use for, with what to pass instead
_REFUSED = {
    "prefetch_factor": "prefetch_factor counts batches per worker process; stoker's threads share one ring: pass "
                       "workers=stoker.Workers(prefetch=N) (batches prepared ahead in total, default 2)",
    "generator": "stoker's order is a pure function of (seed, epoch), not a torch.Generator's state: pass seed=<int>",
    "pin_memory_device": "batches are pinned for the current CUDA device (pin_memory=); to deliver them to a device, "
                         "pass device='cuda:N' or a stoker.DeviceOptions",
    "batch_sampler": "stoker batches by itself: pass batch_size=, and sampling=stoker.Sampling(indices=...) (a "
                     "subset) or sampling=stoker.Sampling(weights=...) (drawn with replacement) for the samples",
    "worker_init_fn": "stoker's workers are threads of this process (nothing to initialise); a transform that "
                      "needs randomness takes rng= (see docs/transforms.md)",
    "multiprocessing_context": "stoker's workers are threads: pass workers=N (or stoker.Workers(num_threads=N)); "
                               "to run them in worker processes of their own (started with 'spawn'), pass "
                               "workers=stoker.Workers(processes=1) (or processes=N for N of them)",
    "in_order": "stoker hands batches out in order always",
}


#: DataLoader keywords with a stoker meaning: (option value, its field)
_MAPPED = {
    "num_workers": ("workers", "num_threads"),   # threads here, not processes; 0 (the main process) is one
    "persistent_workers": ("workers", "persistent"),
    "pin_memory": ("workers", "pin_memory"),
    "timeout": ("workers", "timeout"),
    "drop_last": ("sampling", "drop_last"),
    "shuffle": ("sampling", "order"),
    "collate_fn": ("targets", "collate_fn"),
}
#: every keyword `Loader(**dataloader)` takes (`dataloader_keywords` reads them; any other raises)
DATALOADER_KEYWORDS = frozenset({*_MAPPED, "sampler"})
#: the Loader's keywords before its options were grouped (0.1): where each lives now
_MOVED = {**{k: "workers" for k in ("num_threads", "prefetch", "persistent", "on_error", "decode_quality")},
          **{k: "sampling" for k in ("rank", "world_size", "indices", "weights", "clips")},
          **{k: "storage" for k in ("cache_dir", "cache_limit", "storage_options", "stage")},
          **{k: "targets" for k in ("boxes", "masks", "ignore_index", "pad", "multi_label", "num_classes",
                                    "classes")}}
#: what Loader() takes by keyword: its own arguments and DataLoader's it reads
LOADER_KEYWORDS = ("transforms", "order", "seed", "sampling", "device", "columns", "targets", "storage", "workers",
                   *_MAPPED, "sampler")
_CLASS = {"workers": "Workers", "sampling": "Sampling", "storage": "Storage", "targets": "Targets"}


def dataloader_keywords(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The fields of stoker's option values that DataLoader's keywords in `kwargs` stand for, per option
    ("sampling", "workers", "targets"). A ConfigError names stoker's argument for a DataLoader keyword
    stoker has no use for, and the new spelling for a keyword of the Loader before 0.2; an
    ArgumentNameError (a TypeError) naming the likeliest meant argument for any other name."""
    out: dict[str, dict[str, Any]] = {"sampling": {}, "workers": {}, "targets": {}}
    for name, value in kwargs.items():
        if name == "collate_fn" and value is getattr(torch.utils.data, "default_collate", None):
            continue   # what stoker's batches are already (stacked images, a label tensor): nothing to call
        if name in _MAPPED:
            group, key = _MAPPED[name]
            if name == "num_workers":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ConfigError(f"num_workers must be an int >= 0, got {value!r}; stoker's spelling is "
                                      f"workers=N (worker threads, not processes)")
                value = max(value, 1)
            elif name == "shuffle":
                value = "random" if value else "sequential"
            out[group][key] = value
        elif name == "sampler":
            if value is not None:
                for key, v in _from_sampler(value).items():
                    out["sampling"][key] = v
        elif name in _REFUSED:
            raise ConfigError(f"Loader({name}=...) is DataLoader's; {_REFUSED[name]}")
        elif name in _MOVED:
            group = _MOVED[name]
            short = " (or workers=N)" if name == "num_threads" else ""
            raise ConfigError(f"Loader({name}=...) is now spelled {group}=stoker.{_CLASS[group]}({name}=...){short}: "
                              f"the Loader's options are grouped into Sampling, Storage, Targets and Workers values")
        else:
            raise unknown_keyword("Loader", name, value, LOADER_KEYWORDS, LOADER_HINTS)
    return out


def _from_sampler(sampler: Any) -> dict[str, Any]:
    """A torch sampler as stoker's sampling arguments (its own seed replaces the sampler's generator)."""
    data = torch.utils.data
    kind = type(sampler).__name__
    if isinstance(sampler, data.SequentialSampler):
        return {"order": "sequential"}
    if isinstance(sampler, data.SubsetRandomSampler):
        return {"indices": np.asarray(list(sampler.indices), dtype=np.int64)}
    if isinstance(sampler, data.RandomSampler) and not sampler.replacement and sampler._num_samples is None:
        return {"order": "random"}
    if isinstance(sampler, data.WeightedRandomSampler) and sampler.replacement \
            and sampler.num_samples == len(sampler.weights):
        return {"weights": sampler.weights.numpy()}
    if isinstance(sampler, data.distributed.DistributedSampler):
        if sampler.drop_last:
            raise ConfigError("Loader(sampler=DistributedSampler(..., drop_last=True)): stoker pads a rank's share as "
                              "DistributedSampler(drop_last=False) does; pass sampling=stoker.Sampling(drop_last=True) "
                              "instead (it drops each rank's short last batch, which holds those samples), and the "
                              "sampler without it")
        out: dict[str, Any] = {"rank": int(sampler.rank), "world_size": int(sampler.num_replicas),
                               "order": "random" if sampler.shuffle else "sequential"}
        if sampler.seed != 0:   # DistributedSampler's default seed leaves stoker's seed= free
            out["seed"] = int(sampler.seed)
        return out
    raise ConfigError(f"Loader(sampler={kind}(...)) cannot be read as stoker's sampling: pass order='random' or "
                      f"'sequential', sampling=stoker.Sampling(indices=...) (a subset, shuffled with order='random') "
                      f"or sampling=stoker.Sampling(weights=...) (one per sample, drawn with replacement each epoch "
                      f"like WeightedRandomSampler)")


def move_to_epoch(loader: Any, epoch: int) -> None:
    """A sampler's `set_epoch(epoch)` as the Loader takes it: the epoch it is at stands (a pending resume
    survives a resumed script naming that epoch again); another epoch is read from its start, except on a
    Loader restored by `load_state_dict`: there the saved position is the more exact word (a trainer that
    counts epochs its own way, as Lightning does after a checkpoint taken at `max_steps`, names another
    epoch), so the call is refused with a warning, once, and `loader.set_epoch(e)` moves it."""
    epoch = int(epoch)
    if epoch == loader.epoch:
        return
    if loader.restored:
        if not loader._sampler_warned:
            loader._sampler_warned = True
            warnings.warn(f"a sampler's set_epoch({epoch}) names another epoch than the restored Loader's "
                          f"{loader.epoch}; the position load_state_dict restored stands (call loader.set_epoch"
                          f"({epoch}) to move it)", stacklevel=3)
        return
    loader.set_epoch(epoch)


class EpochSampler:
    """`loader.sampler`: what DataLoader users and trainers read from a loader's sampler. `len()` is the
    samples this rank reads per epoch (DistributedSampler's len: pytorch/examples' distributed validation
    reads `len(val_loader.sampler)`), `set_epoch(e)` moves the Loader to epoch e with the epoch it is at
    standing (`move_to_epoch`; Lightning calls it at every epoch start, a resumed run included), and
    iterating gives this rank's sample indices of the current epoch, in order."""

    def __init__(self, loader: Any) -> None:
        self._loader = weakref.ref(loader)

    def _get(self) -> Any:
        loader = self._loader()
        if loader is None:
            raise ConfigError("loader.sampler outlived its Loader: keep a reference to the Loader while its "
                              "sampler is in use")
        return loader

    def __len__(self) -> int:
        loader = self._get()
        return int(loader.plan.epochs.samples(loader.epoch))   # the count, without computing the order

    def __iter__(self) -> Iterator[int]:
        loader = self._get()
        return iter(loader.epoch_indices(loader.epoch).tolist())

    def set_epoch(self, epoch: int) -> None:
        move_to_epoch(self._get(), epoch)

    def __repr__(self) -> str:
        loader = self._loader()
        return "EpochSampler(<closed>)" if loader is None else \
            f"EpochSampler(epoch={loader.epoch}, rank={loader.rank}, world_size={loader.world_size})"


def follow_set_epoch(sampler: Any, loader: Any) -> None:
    """A sampler the script keeps calling `set_epoch` on (`train_sampler.set_epoch(epoch)`, a resumed
    script's start epoch too) sets the Loader's epoch as well: the script's one call reaches both."""
    own = getattr(sampler, "set_epoch", None)
    if not callable(own):
        return
    ref = weakref.ref(loader)

    def set_epoch(epoch: int) -> None:
        own(epoch)
        target = ref()
        if target is not None:
            move_to_epoch(target, epoch)
    sampler.set_epoch = set_epoch


#: ImageFolder's image loaders stoker's decode stands in for (PIL, accimage): any other one is the user's own
_FOLDER_LOADERS = ("default_loader", "pil_loader", "accimage_loader")


def image_folder(source: Any, transforms: Any, loose: dict[str, dict[str, Any]]) -> tuple[Any, Any]:
    """A torchvision `ImageFolder` where DataLoader took it (`DataLoader(train_dataset, ...)` becomes
    `stoker.Loader(train_dataset, ...)`): read as its folder, with its `transform` as the transforms and its
    class list pinned (`Targets(classes=)`), so labels are ImageFolder's. Anything ImageFolder does that
    stoker would not (a `target_transform`, an image loader of the user's own) is refused naming the way.
    Any other source is returned as given."""
    if not isinstance(source, torch.utils.data.Dataset) or type(source).__name__ != "ImageFolder" \
            or not all(hasattr(source, a) for a in ("root", "samples", "classes", "transform", "target_transform")):
        return source, transforms
    if source.target_transform is not None:
        raise ConfigError(f"Loader(ImageFolder(..., target_transform={source.target_transform!r})): stoker hands out "
                          f"ImageFolder's integer labels; apply the target transform in the training step, or "
                          f"pass the ImageFolder without it")
    reader = getattr(getattr(source, "loader", None), "__name__", "")
    if reader not in _FOLDER_LOADERS:
        raise ConfigError(f"Loader(ImageFolder(..., loader={reader or source.loader!r})): stoker decodes the images "
                          f"itself (upright RGB, as ImageFolder's default loader); an image loader of your own "
                          f"runs only in a DataLoader: keep that one, wrapped as stoker.prefetch(DataLoader(...), "
                          f"'cuda')")
    if transforms is not None and source.transform is not None:
        raise ConfigError("Loader(ImageFolder(root, transform), transforms=...): the transforms are given twice; pass "
                          "them once (the ImageFolder's transform is what DataLoader applied)")
    loose["targets"].setdefault("classes", tuple(source.classes))
    return Path(source.root), source.transform if transforms is None else transforms


def check_image_folder(source: Any, dataset: Any) -> None:
    """Warn where stoker's listing of an ImageFolder's root differs from ImageFolder's own samples (another
    set of file extensions, files added since): the epoch then holds other images than DataLoader's did."""
    items = getattr(getattr(dataset, "source", None), "items", None)   # a loose dataset's listing (nothing read)
    if type(source).__name__ != "ImageFolder" or not hasattr(source, "samples") or items is None:
        return
    root = Path(source.root)
    prefix = os.path.join(str(source.root), "")   # ImageFolder's paths are os.path.join(root, class, file)
    theirs = {path[len(prefix):].replace(os.sep, "/") for path, _ in source.samples}
    ours = {item.key for item in items}
    if theirs != ours:
        only_theirs, only_ours = sorted(theirs - ours), sorted(ours - theirs)
        warnings.warn(f"Loader(ImageFolder({str(root)!r})): ImageFolder lists {len(theirs)} images, stoker {len(ours)}"
                      + (f"; only ImageFolder's: {only_theirs[:3]}" if only_theirs else "")
                      + (f"; only stoker's: {only_ours[:3]}" if only_ours else "")
                      + " (stoker reads JPEG, PNG, WebP, BMP, TIFF, PPM/PGM and GIF files; a file it cannot decode "
                        "is skipped with why)", stacklevel=3)


def check_source(source: Any) -> None:
    """Refuse, naming the way to read it, a source that is not a path, URL or stoker dataset."""
    if isinstance(source, torch.utils.data.Dataset):
        raise ConfigError(f"Loader(source) reads a packed dataset, an image folder or a file list, not a torch "
                          f"{type(source).__name__}: keep your DataLoader and wrap it, "
                          f"stoker.prefetch(DataLoader(dataset, ...), 'cuda'), or pack the images once "
                          f"(stoker pack SRC OUT) and pass OUT")
    if isinstance(source, (list, tuple)):
        raise ConfigError(f"Loader(source) takes one location, got a {type(source).__name__} of {len(source)}: "
                          f"write the paths to a file list (one 'path label' a line) or pack them (stoker pack "
                          f"LIST OUT) and pass that; for a torch Dataset use stoker.prefetch(DataLoader(...))")
    if not isinstance(source, (str, Path)) and not hasattr(source, "sample"):
        raise ConfigError(f"Loader(source) takes a path or URL (packed dataset, image folder, file list), got "
                          f"{type(source).__name__}")


def pinned_labels(labels: np.ndarray, found: Sequence[str] | None, classes: Sequence[str], where: Any
                  ) -> np.ndarray:
    """The dataset's integer labels (indices into its class names `found`) as indices into the
    pinned list `classes`, so a split missing a class keeps every other class's label."""
    if found is None:
        raise ConfigError(f"{where}: classes= pins class names, but this dataset has none (its labels are stored "
                          f"as given); drop classes=")
    if labels.dtype.kind not in "iu":
        raise ConfigError(f"{where}: classes= remaps integer class labels; this dataset's labels are "
                          f"{labels.dtype} values")
    unknown = [c for c in found if c not in classes]
    if unknown:
        raise ConfigError(f"{where}: classes {unknown} are not in the pinned list classes= ({len(classes)} names); "
                          f"add them, or pack the split without them")
    position = {name: k for k, name in enumerate(classes)}
    table = np.array([position[c] for c in found], dtype=labels.dtype)
    out = labels.copy()
    known = (labels >= 0) & (labels < len(table))
    out[known] = table[labels[known]]
    return out
