"""The device stage on the CPU: DeviceOptions, conversion numerics, Fence, and prefetch over every batch shape.

The CUDA side (streams, events, record_stream) is in tests/cuda/test_device_cuda.py."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch

from stoker.device.stage import (IMAGENET_MEAN, IMAGENET_STD, DeviceOptions, DeviceStage, Fence, as_device_options, convert,
                           is_on)
from stoker.device.prefetcher import Prefetcher, prefetch
from stoker.errors import ConfigError, LoaderTimeoutError

FORMATS = [torch.contiguous_format, torch.channels_last]
# float64 reference cast to the dtype vs our result: at most about one unit in the last place of values up to ~2.7
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def cpu_opts(**kw) -> DeviceOptions:
    return DeviceOptions("cpu", **kw)


def nhwc_batch(b: int = 2, h: int = 5, w: int = 7, c: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (b, h, w, c), dtype=torch.uint8, generator=g)
    x[0, 0, 0] = 0  # both ends of the range
    x[0, 0, 1] = 255
    return x


def reference(images: torch.Tensor, layout: str, mean, std, from_uint8: bool = True) -> torch.Tensor:
    x = images.double()
    if layout == "nhwc":
        x = x.permute(0, 3, 1, 2)
    if from_uint8:
        x = x / 255
    if mean is None:
        return x
    m = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
    return (x - m) / s


# ---- DeviceOptions ----------------------------------------------------------------------------
def test_defaults_resolve_dtype_and_format():
    o = cpu_opts()
    assert (o.device, o.normalize, o.dtype, o.memory_format) == (torch.device("cpu"), None, torch.uint8,
                                                                 torch.contiguous_format)
    assert not o.is_cuda
    n = cpu_opts(normalize="imagenet")
    assert n.normalize == (IMAGENET_MEAN, IMAGENET_STD) and n.dtype == torch.float32
    assert cpu_opts(normalize="ImageNet").normalize == (IMAGENET_MEAN, IMAGENET_STD)


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("float", torch.float32),
                                         ("float16", torch.float16), ("half", torch.float16),
                                         ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                         ("uint8", torch.uint8), (torch.bfloat16, torch.bfloat16),
                                         (torch.float16, torch.float16), ("FP16", torch.float16)])
def test_dtype_names(name, dtype):
    assert cpu_opts(dtype=name).dtype == dtype


@pytest.mark.parametrize("name, fmt", [(None, torch.contiguous_format), ("contiguous", torch.contiguous_format),
                                       ("nchw", torch.contiguous_format), ("channels_last", torch.channels_last),
                                       (torch.channels_last, torch.channels_last),
                                       (torch.contiguous_format, torch.contiguous_format)])
def test_memory_format_names(name, fmt):
    assert cpu_opts(memory_format=name).memory_format == fmt


def test_normalize_forms():
    assert cpu_opts(normalize=((0.5,), (0.25,))).normalize == ((0.5,), (0.25,))
    assert cpu_opts(normalize=(0.5, 0.25)).normalize == ((0.5,), (0.25,))
    assert cpu_opts(normalize=(np.array([0.1, 0.2, 0.3]), [0.5])).normalize == ((0.1, 0.2, 0.3), (0.5,))
    assert cpu_opts(normalize=(torch.tensor([0.1, 0.2]), (0.3, 0.4))).normalize[1] == (0.3, 0.4)


def test_options_are_frozen_and_comparable():
    a, b = cpu_opts(normalize="imagenet"), cpu_opts(normalize="imagenet")
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.dtype = torch.float16  # type: ignore[misc]


def test_decode_defaults_to_auto_on_a_cuda_device_and_the_route_says_why_it_stays_on_the_cpu(tmp_path, monkeypatch):
    """Where the device is CUDA the GPU takes a measured share of each batch's JPEGs when a decoder works there,
    by default; elsewhere the CPU decodes. decode="auto" without a working decoder stays on the CPU and the
    route names the reason."""
    from conftest import make_image_folder
    from stoker.loader import Loader
    from stoker.transforms import RandomResizedCrop

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)   # the options a CUDA node makes
        assert DeviceOptions("cuda").decode == as_device_options("cuda").decode == "auto"
        assert DeviceOptions("cuda", decode="cpu").decode == "cpu"
    assert DeviceOptions("cpu").decode == as_device_options("cpu").decode == "cpu"

    class Broken:   # a decoder object that cannot decode here: the probe says so
        name = "broken stand-in"

        def decode(self, datas):
            raise RuntimeError("no GPU here")
    folder = make_image_folder(tmp_path / "f", n_per_class=2)
    with Loader(folder, 2, transforms=[RandomResizedCrop(16)],
                device=DeviceOptions("cpu", decode="auto", gpu_decoder=Broken())) as ld:
        assert ld.route.gpu == "none" and any(r.startswith("CPU only: ") for r in ld.route.reasons)
        assert len(list(ld)) == len(ld)


@pytest.mark.parametrize("device, match", [
    ("gpu", "not a device torch understands"),
    ("mps", "supports 'cuda' and 'cpu'"),
    (-1, "must be >= 0"),
    (True, "device must be"),
    (1.5, "device must be"),
])
def test_bad_devices(device, match):
    with pytest.raises(ConfigError, match=match):
        DeviceOptions(device)


@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0, torch.device("cuda")])
def test_cuda_without_a_gpu_names_the_fix(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"sees no CUDA GPU; install a CUDA build of torch .* device='cpu'"):
        DeviceOptions(device)


def test_cuda_index_out_of_range(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ConfigError, match=r"has 2 CUDA GPU\(s\), indices 0..1"):
        DeviceOptions("cuda:2")
    assert DeviceOptions("cuda").device == torch.device("cuda")  # "cuda" keeps no index until a pass starts
    assert DeviceOptions("cuda").resolved().device == torch.device("cuda", 1)  # then: the current GPU
    assert DeviceOptions(0).device == torch.device("cuda", 0)


class ThreadDevices:
    """Stands in for two CUDA GPUs and the runtime's per-thread current device (GPU 0 in a new thread)."""

    def __init__(self, monkeypatch, count: int = 2) -> None:
        self.local = threading.local()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(self.local, "device", 0))
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(self.local, "device", int(d)))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: ("stream", device))
        monkeypatch.setattr(torch.cuda, "set_stream", lambda s: setattr(self.local, "stream", s))


def test_cuda_is_the_local_ranks_gpu_when_a_pass_starts(monkeypatch, recwarn):
    """A Loader made before torch.cuda.set_device(local_rank) used to put every rank's batches on cuda:0:
    "cuda" was frozen to the current device when the options were made."""
    devices = ThreadDevices(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    early = DeviceOptions("cuda")  # made before set_device, as a training script may: no warning yet
    assert early.device == torch.device("cuda") and not recwarn.list
    torch.cuda.set_device(1)
    stage = DeviceStage(early)  # what a pass makes when it starts
    assert stage.opts.device == torch.device("cuda", 1) and stage.stream == ("stream", torch.device("cuda", 1))
    assert not recwarn.list  # LOCAL_RANK and the current device agree
    assert DeviceOptions("cuda:0").resolved().device == torch.device("cuda", 0)  # an explicit index is obeyed
    monkeypatch.setenv("LOCAL_RANK", "3")  # one GPU visible per rank (CUDA_VISIBLE_DEVICES): the current one
    assert early.resolved().device == torch.device("cuda", 1) and not recwarn.list
    monkeypatch.delenv("LOCAL_RANK")
    devices.local.device = 0
    made_on_0 = DeviceOptions("cuda")
    torch.cuda.set_device(1)   # no torchrun: the current device when the pass starts, not when made
    assert made_on_0.resolved().device == torch.device("cuda", 1)


def test_a_pass_warns_when_local_rank_and_the_current_device_disagree(monkeypatch):
    ThreadDevices(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    opts = DeviceOptions("cuda")
    with pytest.warns(UserWarning, match=r"cuda:1 here \(LOCAL_RANK=1\), but the current CUDA device is cuda:0; "
                                         r"call torch.cuda.set_device\(1\)"):
        assert DeviceStage(opts).opts.device == torch.device("cuda", 1)


def test_convert_takes_an_unresolved_cuda_as_any_gpu():
    """DeviceOptions("cuda") keeps no index until a pass starts: convert() called by hand with it must
    still take images on the GPU they are on (`is_on`, the check convert makes)."""
    assert is_on(torch.device("cuda", 1), torch.device("cuda"))
    assert is_on(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not is_on(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not is_on(torch.device("cpu"), torch.device("cuda"))
    opts = DeviceOptions("cpu")
    with pytest.raises(ConfigError, match="images are on meta but the options say cpu"):
        convert(torch.empty((2, 4, 4, 3), dtype=torch.uint8, device="meta"), opts)


def test_the_stage_binds_the_device_thread_to_its_gpu(monkeypatch):
    devices = ThreadDevices(monkeypatch)
    stage = DeviceStage(DeviceOptions("cuda:1"))
    seen = []
    worker = threading.Thread(target=lambda: (stage.bind(), seen.append((torch.cuda.current_device(),
                                                                          devices.local.stream))))
    worker.start()
    worker.join()
    # its GPU and its copy stream become the bound thread's current ones; the caller's thread is left alone
    assert seen == [(1, stage.stream)] and torch.cuda.current_device() == 0
    assert getattr(devices.local, "stream", None) is None


@pytest.mark.parametrize("normalize, match", [
    ("cifar", "only named statistics are 'imagenet'"),
    ((0.485, 0.456, 0.406), r"a \(mean, std\) pair"),
    (42, r"a \(mean, std\) pair"),
    (((0.5,), (0.0,)), "std must be > 0"),
    (((0.5,), (-0.2,)), "std must be > 0"),
    (((123.7, 116.3, 103.5), (58.4, 57.1, 57.4)), "looks like 0-255 units.*divide by 255"),
    (((0.5, 0.5, 0.5), (58.4, 57.1, 57.4)), "looks like 0-255 units"),
    (((0.5, 0.5), (0.2, 0.2, 0.2)), "mean has 2 values and std 3"),
    (((), (0.2,)), "mean is empty"),
    ((("a",), (0.2,)), "mean must be a number or a sequence"),
    (("ab", (0.2,)), "mean must be numbers"),
    (((float("nan"),), (0.2,)), "must be finite"),
])
def test_bad_normalize(normalize, match):
    with pytest.raises(ConfigError, match=match):
        cpu_opts(normalize=normalize)


@pytest.mark.parametrize("dtype", ["float64", torch.float64, torch.int32, "int8", 3])
def test_bad_dtype(dtype):
    with pytest.raises(ConfigError, match="is not supported; use 'float32', 'float16', 'bfloat16' or 'uint8'"):
        cpu_opts(dtype=dtype)


def test_uint8_with_normalize_is_refused():
    with pytest.raises(ConfigError, match="uint8 cannot hold normalized values"):
        cpu_opts(normalize="imagenet", dtype="uint8")


@pytest.mark.parametrize("fmt", ["nhcw", torch.preserve_format, 1])
def test_bad_memory_format(fmt):
    with pytest.raises(ConfigError, match="'contiguous' .* or 'channels_last'"):
        cpu_opts(memory_format=fmt)


# ---- convert ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("normalize", [None, "imagenet"])
def test_convert_uint8_matches_float64_reference(dtype, fmt, layout, normalize):
    x = nhwc_batch(b=3, h=6, w=5)
    if layout == "nchw":
        x = x.permute(0, 3, 1, 2).contiguous()
    opts = cpu_opts(normalize=normalize, dtype=dtype, memory_format=fmt)
    out = convert(x, opts, layout=layout)
    assert out.shape == (3, 3, 6, 5) and out.dtype == dtype and out.is_contiguous(memory_format=fmt)
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if normalize else (None, None)
    ref = reference(x, layout, mean, std)
    assert (out.double() - ref).abs().max().item() <= TOLERANCE[dtype]
    assert (out.double() - ref.to(dtype).double()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_convert_on_the_cpu_by_tables_equals_the_arithmetic_bit_for_bit(channels, fmt, layout):
    """uint8 -> normalized float32 on the CPU goes through per-channel tables (normalize_by_table); the
    values are addcmul's exactly, in the asked-for memory format, whatever the input layout."""
    x = torch.randint(0, 256, (4, 9, 7, channels), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    if layout == "nchw":
        x = x.permute(0, 3, 1, 2).contiguous()
    mean, std = ((0.3,) * channels, (0.2,) * channels) if channels != 3 else (IMAGENET_MEAN, IMAGENET_STD)
    opts = cpu_opts(normalize=(mean, std), memory_format=fmt)
    out = convert(x, opts, layout=layout)
    view = x.permute(0, 3, 1, 2) if layout == "nhwc" else x
    scale, shift = opts._affine(view.device, True)
    assert out.is_contiguous(memory_format=fmt) and torch.equal(out, torch.addcmul(shift, view, scale))


def test_normalize_by_table_declines_what_it_cannot_do():
    from stoker.device.stage import all_levels, normalize_by_table
    x = torch.zeros((2, 3, 4, 4), dtype=torch.uint8)
    levels = all_levels(3).float()
    assert not normalize_by_table(x.float(), levels, torch.empty(2, 3, 4, 4))  # not uint8
    assert not normalize_by_table(x, levels, torch.empty(2, 3, 4, 4, dtype=torch.float16))  # not float32
    assert not normalize_by_table(x, all_levels(1).float(), torch.empty(2, 3, 4, 4))  # tables for other channels
    strided = torch.empty(2, 3, 4, 8)[..., ::2]
    assert not normalize_by_table(x, levels, strided)  # neither NCHW nor channels_last


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_float_input_is_not_rescaled(in_dtype, dtype, fmt):
    x = (nhwc_batch().double() / 255).to(in_dtype)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    out = convert(x, cpu_opts(normalize=(mean, std), dtype=dtype, memory_format=fmt), layout="nhwc")
    assert out.dtype == dtype and out.is_contiguous(memory_format=fmt)
    ref = reference(x, "nhwc", mean, std, from_uint8=False)
    assert (out.double() - ref).abs().max().item() <= TOLERANCE[dtype]
    plain = convert(x, cpu_opts(dtype=dtype, memory_format=fmt), layout="nhwc")  # no normalize: a cast only
    assert (plain.double() - x.double().permute(0, 3, 1, 2)).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_to_uint8_is_a_layout_change(fmt):
    x = nhwc_batch()
    out = convert(x, cpu_opts(memory_format=fmt), layout="nhwc")
    assert out.dtype == torch.uint8 and out.is_contiguous(memory_format=fmt)
    assert torch.equal(out, x.permute(0, 3, 1, 2))
    if fmt == torch.channels_last:  # NHWC memory is already channels_last: a view, no copy
        assert out.data_ptr() == x.data_ptr()


def test_convert_nchw_float32_without_work_returns_the_input():
    x = nhwc_batch().permute(0, 3, 1, 2).contiguous().float() / 255
    assert convert(x, cpu_opts(dtype="float32"), layout="nchw") is x


def test_convert_one_channel_and_broadcast_normalize():
    x = nhwc_batch(c=1)
    out = convert(x, cpu_opts(normalize=((0.5,), (0.25,))), layout="nhwc")
    assert out.shape == (2, 1, 5, 7)
    assert torch.allclose(out.double(), reference(x, "nhwc", (0.5,), (0.25,)), atol=1e-5)
    # one mean for all channels, one std per channel
    y = nhwc_batch()
    out = convert(y, cpu_opts(normalize=((0.5,), (0.2, 0.3, 0.4))), layout="nhwc")
    ref = reference(y, "nhwc", (0.5, 0.5, 0.5), (0.2, 0.3, 0.4))
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_convert_channel_mismatch_names_both():
    with pytest.raises(ConfigError, match=r"normalize has 3 values per channel but the images have 1 channel"):
        convert(nhwc_batch(c=1), cpu_opts(normalize="imagenet"), layout="nhwc")
    with pytest.raises(ConfigError, match=r"normalize has 3 values per channel but the images have 4 channel"):
        convert(nhwc_batch(c=4), cpu_opts(normalize="imagenet"), layout="nhwc")


def test_convert_constants_are_made_once():
    opts = cpu_opts(normalize="imagenet")
    convert(nhwc_batch(), opts)
    first = dict(opts._constants)
    convert(nhwc_batch(seed=1), opts)
    assert opts._constants.keys() == first.keys()
    assert all(opts._constants[k][0] is first[k][0] for k in first)


@pytest.mark.parametrize("images, kw, match", [
    (torch.zeros(5, 7, 3, dtype=torch.uint8), {}, "must be a 4-D batch"),
    (torch.zeros(2, 5, 7, 3, dtype=torch.int32), {}, "must be uint8 .* or float"),
    (torch.zeros(2, 5, 7, 3, dtype=torch.uint8), {"layout": "hwc"}, "layout must be 'nhwc' or 'nchw'"),
])
def test_convert_bad_input(images, kw, match):
    with pytest.raises(ConfigError, match=match):
        convert(images, cpu_opts(normalize="imagenet"), **kw)


def test_convert_float_to_uint8_is_refused():
    with pytest.raises(ConfigError, match="does not quantize"):
        convert(torch.zeros(1, 2, 2, 3), cpu_opts(dtype="uint8"))


def test_convert_wrong_device(monkeypatch):
    opts = cpu_opts()
    object.__setattr__(opts, "device", torch.device("meta"))
    with pytest.raises(ConfigError, match="images are on cpu but the options say meta; upload them first"):
        convert(nhwc_batch(), opts)


# ---- Fence and the stage on the CPU -----------------------------------------------------------
class FakeEvent:
    def __init__(self, done_after: float | None = None) -> None:
        self.t_done = None if done_after is None else time.monotonic() + done_after
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.t_done is not None and time.monotonic() >= self.t_done


def test_cpu_fence_is_always_done():
    f = Fence()
    assert f.done()
    f.wait(0.001)


def test_fence_waits_for_the_event():
    ev = FakeEvent(done_after=0.03)
    f = Fence(ev)
    assert not f.done()
    t0 = time.monotonic()
    f.wait(5.0)
    assert f.done() and 0.025 <= time.monotonic() - t0 < 30.0   # never early; the upper bound guards a hang
    assert ev.queries < 200  # short sleeps, not a busy spin


def test_fence_times_out_saying_what_it_waited_for():
    f = Fence(FakeEvent(), what="the copy of batch 7 to cuda:0")
    t0 = time.monotonic()
    with pytest.raises(LoaderTimeoutError, match=r"the copy of batch 7 to cuda:0 had not finished after 0.05 s"):
        f.wait(0.05)
    assert 0.045 <= time.monotonic() - t0 < 30.0


def test_fence_returns_early_when_stopped():
    f = Fence(FakeEvent())
    stop = threading.Event()
    threading.Timer(0.02, stop.set).start()
    t0 = time.monotonic()
    f.wait(120.0, stop)  # no error
    assert time.monotonic() - t0 < 60.0 and not f.done()   # the stop, not the 120 s timeout


def test_cpu_stage_is_plain():
    stage = DeviceStage(cpu_opts(normalize="imagenet"))
    assert stage.stream is None
    x = nhwc_batch()
    with stage.context():
        up = stage.upload(x)
        fence = stage.fence()
    assert up is x and fence.done()
    batch = (up, [up], {"a": up})
    assert stage.handoff(batch, fence) is batch


# ---- prefetch -----------------------------------------------------------------------------------
Pair = namedtuple("Pair", "image label")


def test_prefetch_tensors_pass_through_when_nothing_to_convert():
    batches = [nhwc_batch(seed=k) for k in range(3)]
    got = list(prefetch(batches, "cpu"))
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, batches))


def test_prefetch_converts_a_bare_tensor():
    batches = [nhwc_batch(seed=k) for k in range(3)]
    opts = cpu_opts(normalize="imagenet", memory_format="channels_last")
    for got, x in zip(prefetch(batches, DeviceOptions("cpu", normalize="imagenet", memory_format="channels_last")),
                      batches):
        assert torch.equal(got, convert(x, opts, layout="nhwc"))
        assert got.is_contiguous(memory_format=torch.channels_last)


def test_prefetch_tuple_list_namedtuple_dict_nested():
    x, y = nhwc_batch(), torch.tensor([3, 4])
    opts = cpu_opts(dtype="float32")
    want = convert(x, opts, layout="nhwc")
    extras = {"idx": np.arange(2), "names": ["a", "b"], "nested": (torch.ones(2), {"deep": np.ones(2)}),
              "n": 7, "none": None, "strs": np.array(["u", "v"])}

    (t,) = prefetch([(x, y, extras)], DeviceOptions("cpu", dtype="float32"))
    assert type(t) is tuple and torch.equal(t[0], want) and torch.equal(t[1], y)
    e = t[2]
    assert isinstance(e["idx"], torch.Tensor) and e["idx"].tolist() == [0, 1]
    assert e["names"] == ["a", "b"] and e["n"] == 7 and e["none"] is None
    assert isinstance(e["strs"], np.ndarray)  # numpy strings have no tensor form: passed unchanged
    assert isinstance(e["nested"], tuple) and isinstance(e["nested"][1]["deep"], torch.Tensor)

    (lst,) = prefetch([[x, y]], DeviceOptions("cpu", dtype="float32"))
    assert type(lst) is list and torch.equal(lst[0], want)

    (nt,) = prefetch([Pair(x, y)], DeviceOptions("cpu", dtype="float32"))
    assert type(nt) is Pair and torch.equal(nt.image, want) and torch.equal(nt.label, y)

    (d,) = prefetch([OrderedDict(label=y, pixel_values=x)], DeviceOptions("cpu", dtype="float32"))
    assert type(d) is OrderedDict and list(d) == ["label", "pixel_values"] and torch.equal(d["pixel_values"], want)

    dd = defaultdict(list, img=x)
    (d2,) = prefetch([dd], DeviceOptions("cpu", dtype="float32"))
    assert torch.equal(d2["img"], want)


def test_prefetch_numpy_leaves_become_tensors():
    arr = nhwc_batch().numpy()
    arr.flags.writeable = False  # read-only arrays (e.g. memory-mapped) are copied, not shared
    (got,) = prefetch([(arr, np.array([1, 2]))], DeviceOptions("cpu", normalize="imagenet"))
    assert isinstance(got[0], torch.Tensor) and got[0].dtype == torch.float32 and got[0].shape == (2, 3, 5, 7)
    assert got[1].tolist() == [1, 2]
    (plain,) = prefetch([arr], "cpu")
    assert isinstance(plain, torch.Tensor) and np.array_equal(plain.numpy(), arr)


def test_prefetch_images_selects_the_leaf():
    x, y = nhwc_batch(), torch.tensor([1, 2])
    (t,) = prefetch([(y, x)], DeviceOptions("cpu", dtype="float32"), images=1)
    assert t[0] is y and t[1].dtype == torch.float32 and t[1].shape == (2, 3, 5, 7)
    (t,) = prefetch([(y, x)], DeviceOptions("cpu", dtype="float32"), images=-1)
    assert t[1].dtype == torch.float32
    (d,) = prefetch([{"a": x, "b": y}], DeviceOptions("cpu", dtype="float32"), images="a")
    assert d["a"].dtype == torch.float32 and d["b"] is y
    (nt,) = prefetch([Pair(x, y)], DeviceOptions("cpu", dtype="float32"), images="image")
    assert nt.image.dtype == torch.float32


@pytest.mark.parametrize("batch, images, match", [
    ((torch.zeros(1), nhwc_batch()), 5, "out of range for batches of 2 items"),
    ((nhwc_batch(),), "image", "is a key, but the batches are tuples"),
    (Pair(nhwc_batch(), 1), "pixels", r"no such field; the batch's fields are \['image', 'label'\]"),
    ({"a": nhwc_batch()}, "b", r"no such key in the batch; its keys are \['a'\]"),
    ({"a": nhwc_batch()}, None, r"none of \['image', 'images', 'img', 'pixel_values', 'x'\]"),
    (nhwc_batch(), 0, "the batches are single tensors; drop images="),
    (("paths", nhwc_batch()), None, r"batch\[0\] should be the image tensor but is a str; pass images="),
    ((torch.zeros(4), nhwc_batch()), None, r"batch\[0\] should be a 4-D image batch but has shape \(4,\)"),
    (42, None, "cannot find the images in a batch of type int"),
])
def test_prefetch_image_selection_errors(batch, images, match):
    with pytest.raises(ConfigError, match=match):
        list(prefetch([batch], DeviceOptions("cpu", dtype="float32"), images=images))


def test_prefetch_layout_auto_and_explicit():
    nchw = nhwc_batch().permute(0, 3, 1, 2).contiguous()
    (a,) = prefetch([nchw], DeviceOptions("cpu", dtype="float32"))
    assert torch.equal(a, nchw.float() / 255)
    (b,) = prefetch([nhwc_batch()], DeviceOptions("cpu", dtype="float32"))
    assert torch.equal(b, nhwc_batch().permute(0, 3, 1, 2).float() / 255)
    odd = torch.zeros(2, 8, 8, 8, dtype=torch.uint8)  # no dim looks like channels
    with pytest.raises(ConfigError, match=r"neither dim 1 and the last dim look like channels.*layout='nchw'"):
        list(prefetch([odd], DeviceOptions("cpu", dtype="float32")))
    tiny = torch.zeros(2, 3, 8, 3, dtype=torch.uint8)  # both do: ambiguous
    with pytest.raises(ConfigError, match="both dim 1 and the last dim look like channels"):
        list(prefetch([tiny], DeviceOptions("cpu", dtype="float32")))
    (c,) = prefetch([tiny], DeviceOptions("cpu", dtype="float32"), layout="nhwc")
    assert c.shape == (2, 3, 3, 8)
    (m,) = prefetch([odd], DeviceOptions("cpu", dtype="float32"), layout="nchw")
    assert m.shape == (2, 8, 8, 8)


@pytest.mark.parametrize("kw, match", [({"layout": "hwc"}, "layout must be 'auto', 'nchw' or 'nhwc'"),
                                       ({"images": 1.0}, "images must be None"),
                                       ({"images": True}, "images must be None")])
def test_prefetch_bad_arguments(kw, match):
    with pytest.raises(ConfigError, match=match):
        prefetch([], "cpu", **kw)


def test_prefetch_len_and_iterating_twice():
    batches = [(nhwc_batch(seed=k), torch.tensor([k])) for k in range(4)]
    p = prefetch(batches, DeviceOptions("cpu", normalize="imagenet"))
    assert len(p) == 4
    first = [b[1].item() for b in p]
    second = [b[1].item() for b in p]
    assert first == second == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="has no len"):
        len(prefetch((b for b in batches), "cpu"))
    assert list(prefetch([], "cpu")) == []


class Source:
    """A source whose iterator records how it ended."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at
        self.started = self.finished = self.closed = 0
        self.error = RuntimeError("disk on fire")

    def __iter__(self):
        self.started += 1
        try:
            for k in range(self.n):
                if k == self.fail_at:
                    raise self.error
                yield nhwc_batch(b=1, seed=k), torch.tensor([k])
        finally:
            self.finished += 1


def test_exhaustion_closes_the_source():
    src = Source(3)
    assert [b[1].item() for b in prefetch(src, DeviceOptions("cpu", dtype="float16"))] == [0, 1, 2]
    assert src.finished == 1


def test_early_break_closes_the_source_generator():
    src = Source(100)
    for k, _ in enumerate(prefetch(src, DeviceOptions("cpu", dtype="float16"))):
        if k == 2:
            break
    assert src.finished == 1  # CPython closes the abandoned generator at once; its finally ran


def test_close_ends_iterations_in_progress():
    src = Source(100)
    with prefetch(src, "cpu") as p:
        it = iter(p)
        next(it)
        keep = it  # still referenced: only close() can end it
    assert src.finished == 1
    with pytest.raises(StopIteration):
        next(keep)
    assert [b[1].item() for b in p][:2] == [0, 1]  # a closed Prefetcher can be iterated again


def test_source_exception_propagates_unchanged_after_earlier_batches():
    src = Source(10, fail_at=3)
    got = []
    with pytest.raises(RuntimeError) as info:
        for b in prefetch(src, DeviceOptions("cpu", normalize="imagenet")):
            got.append(b[1].item())
    assert info.value is src.error
    assert got == [0, 1, 2] and src.finished == 1


def test_conversion_error_on_a_later_batch_comes_after_the_earlier_ones():
    batches = [nhwc_batch(), nhwc_batch(), torch.zeros(2, 8, 8, 8, dtype=torch.uint8)]
    got = []
    with pytest.raises(ConfigError, match="cannot tell the layout"):
        for b in prefetch(batches, DeviceOptions("cpu", dtype="float32")):
            got.append(b)
    assert len(got) == 2


def test_cpu_batch_is_kept_until_its_fence_is_done(monkeypatch):
    """The source's CPU batch stays referenced while its (fake) copy is in flight."""
    import gc
    import weakref

    events: list[FakeEvent] = []

    def fence(self):
        ev = FakeEvent()  # never done until we say so
        events.append(ev)
        return Fence(ev)

    monkeypatch.setattr(DeviceStage, "fence", fence)
    monkeypatch.setattr(DeviceStage, "handoff", lambda self, batch, f: batch)
    refs = []

    def source():
        for k in range(3):
            x = torch.full((1, 2, 2, 3), k, dtype=torch.uint8)
            refs.append(weakref.ref(x))
            yield x

    it = iter(prefetch(source(), DeviceOptions("cpu", dtype="float32")))
    next(it)
    next(it)
    gc.collect()
    assert refs[0]() is not None and refs[1]() is not None  # fences not done: CPU batches alive
    for ev in events:
        ev.t_done = 0.0  # the copies finish
    next(it)
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


class FakeLoader:
    """Stands in for a stoker.Loader: does its own device copy given the options."""

    def __init__(self) -> None:
        self.opts = None
        self.closed = 0

    def __len__(self) -> int:
        return 5

    def iter_on(self, opts):
        self.opts = opts
        outer = self

        class It:
            def __init__(self):
                self.k = 0

            def __iter__(self):
                return self

            def __next__(self):
                if self.k == 5:
                    raise StopIteration
                self.k += 1
                return self.k

            def close(self):
                outer.closed += 1

        return It()


def test_prefetch_delegates_to_a_stoker_loader():
    loader = FakeLoader()
    p = prefetch(loader, DeviceOptions("cpu", normalize="imagenet", dtype="bf16", memory_format="channels_last"))
    assert isinstance(p, Prefetcher) and p.stage is None and len(p) == 5
    assert list(p) == [1, 2, 3, 4, 5]
    assert loader.opts == DeviceOptions("cpu", "imagenet", "bf16", "channels_last")
    assert loader.closed == 1
    for k in p:
        break
    assert loader.closed == 2
    with pytest.raises(ConfigError, match="do not apply to a stoker.Loader"):
        prefetch(loader, "cpu", images=0)


def test_prefetch_starts_no_threads():
    before = threading.active_count()
    p = prefetch([(nhwc_batch(seed=k), k) for k in range(3)], DeviceOptions("cpu", normalize="imagenet"))
    for _ in p:
        assert threading.active_count() == before


def test_a_device_value_is_read_one_way():
    assert as_device_options(None) is None
    opts = DeviceOptions("cpu", normalize="imagenet")
    assert as_device_options(opts) is opts
    plain = as_device_options("cpu")
    assert plain == DeviceOptions(device="cpu") and plain.dtype == torch.uint8 and not plain.converts
    assert opts.converts and DeviceOptions("cpu", memory_format="channels_last").converts
    with pytest.raises(AttributeError):  # frozen: a resolved value cannot drift from its checks
        opts.dtype = torch.float16  # type: ignore[misc]


def test_prefetch_refuses_gpu_decode_for_decoded_batches():
    class Decoder:
        def decode(self, datas):
            return datas
    with pytest.raises(ConfigError, match="decode='gpu' applies to a stoker.Loader"):
        prefetch([nhwc_batch()], DeviceOptions("cpu", decode="gpu", gpu_decoder=Decoder()))
    with pytest.raises(ConfigError, match="prefetch needs a device"):
        prefetch([nhwc_batch()], None)  # type: ignore[arg-type]


# ---- one pass into the final dtype; the copy stream's priority -------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_normalizing_to_half_precision_is_one_pass_into_the_final_dtype_and_layout(dtype, fmt, monkeypatch):
    """addcmul(out=) computes in float32 and rounds as it stores: on CUDA one kernel, no float32 batch and
    no second cast pass; bit for bit what computing in float32 and casting would give."""
    x = nhwc_batch(b=3, h=16, w=12)
    opts = cpu_opts(normalize="imagenet", dtype=dtype, memory_format=fmt)
    outs = []
    real = torch.addcmul

    def spy(*args, out=None, **kwargs):
        outs.append(out)
        return real(*args, out=out, **kwargs)

    monkeypatch.setattr(torch, "addcmul", spy)
    got = convert(x, opts)
    monkeypatch.undo()
    assert len(outs) == 1 and outs[0] is got  # the kernel wrote the final tensor itself
    assert got.dtype == dtype and got.is_contiguous(memory_format=fmt)
    f32 = convert(x, cpu_opts(normalize="imagenet", dtype="float32", memory_format=fmt))
    assert torch.equal(got, f32.to(dtype))


def test_constants_are_filled_on_the_device_not_copied_from_the_host(monkeypatch):
    """A copy from pageable host memory to the GPU blocks the host (an implicit sync on the first batch)."""
    def no_copies(self, *args, **kwargs):
        raise AssertionError("the normalize constants must not be copied to the device")

    opts = cpu_opts(normalize=((0.5, 0.25, 0.125), (0.5, 0.5, 0.25)))
    monkeypatch.setattr(torch.Tensor, "to", no_copies)
    scale, shift = opts._affine(torch.device("cpu"), True)
    monkeypatch.undo()
    assert scale.shape == shift.shape == (1, 3, 1, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale.flatten(), torch.tensor([2 / 255, 2 / 255, 4 / 255]))
    torch.testing.assert_close(shift.flatten(), torch.tensor([-1.0, -0.5, -0.5]))


def test_the_copy_stream_runs_at_the_default_priority(monkeypatch):
    """The conversion and the batch ops run on the copy stream: at a high priority their kernels would
    preempt the training step's."""
    import stoker.device.stage as device

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: made.append((device, priority)))
    device.copy_stream(torch.device("cuda", 0))
    assert made == [(torch.device("cuda", 0), 0)]


class RecordingStream:
    """Stands in for torch.cuda.Stream: records what the copy stream was asked to wait for."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: "RecordingStream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def test_a_batch_already_on_the_gpu_is_copied_after_the_work_that_made_it(monkeypatch):
    """Torch orders nothing between streams: a source tensor made on the caller's stream and read on the
    copy stream (converted, or moved to the device it is on) needs the copy stream to wait for the caller's.
    Host batches get no wait, so their copies keep overlapping the caller's step."""
    log: list[str] = []
    opts = cpu_opts(dtype="float32")
    object.__setattr__(opts, "device", torch.device("meta"))  # a device tensor that runs on the CPU
    stage = DeviceStage(cpu_opts())
    stage.opts, stage.stream = opts, RecordingStream("copy", log)
    caller = RecordingStream("caller", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(DeviceStage, "context", lambda self: contextlib.nullcontext())
    monkeypatch.setattr(DeviceStage, "fence", lambda self: Fence(None))
    monkeypatch.setattr(DeviceStage, "handoff", lambda self, batch, fence: batch)
    upload = DeviceStage.upload
    monkeypatch.setattr(DeviceStage, "upload", lambda self, t: log.append("upload") or upload(self, t))
    p = prefetch([], opts)
    p.stage = stage
    p.source = [(torch.zeros(2, 5, 6, 3, device="meta"), torch.tensor([1, 2])),
                (torch.zeros(2, 5, 6, 3, dtype=torch.uint8), torch.tensor([1, 2]))]
    out = list(p)
    assert len(out) == 2 and all(x.device.type == "meta" and x.dtype == torch.float32 for x, _ in out)
    assert log == ["copy waits for caller", "upload", "upload", "upload", "upload"]
