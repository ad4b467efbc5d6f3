"""The per-sample ops against torchvision's definitions, written out here as reference formulas
(torchvision itself cannot be imported on CPU test machines).

Pixels: fixed parameters give torchvision's pixels, exactly where both compute the same integer
table, within 1 where OpenCV rounds and torchvision truncates; geometric ops sample the same
nearest pixel except at exact ties. Distributions: random parameters are drawn as torchvision
draws them (tests over thousands of draws with fixed seeds and generous bounds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stoker.errors import ConfigError
from stoker.transforms import colour, pixels, policy


@pytest.fixture(scope="module")
def img() -> np.ndarray:
    """A smooth image with structure plus noise: realistic histograms and edges."""
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:61, 0:83].astype(np.float32)
    base = np.stack([120 + 100 * np.sin(x / 9), 90 + 80 * np.cos(y / 7), 60 + 50 * np.sin((x + y) / 11)], -1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


# ---- reference formulas: torchvision.transforms.functional on uint8 tensors, in numpy ----------
def ref_gray(im: np.ndarray) -> np.ndarray:
    f = im.astype(np.float32)
    return (0.2989 * f[..., 0] + 0.587 * f[..., 1] + 0.114 * f[..., 2]).astype(np.uint8)


def ref_blend(im: np.ndarray, other: np.ndarray | float, ratio: float) -> np.ndarray:
    out = ratio * im.astype(np.float32) + (1.0 - ratio) * np.asarray(other, np.float32)
    return np.clip(out, 0, 255).astype(np.uint8)


def ref_rgb2hsv(rgb: np.ndarray) -> np.ndarray:
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    maxc, minc = rgb.max(-1), rgb.min(-1)
    eqc = maxc == minc
    cr = maxc - minc
    ones = np.ones_like(maxc)
    s = cr / np.where(eqc, ones, maxc)
    crd = np.where(eqc, ones, cr)
    rc, gc, bc = (maxc - r) / crd, (maxc - g) / crd, (maxc - b) / crd
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = np.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return np.stack([h, s, maxc], -1)


def ref_hsv2rgb(hsv: np.ndarray) -> np.ndarray:
    h, s, v = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    i = np.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.astype(np.int64) % 6
    p = np.clip(v * (1.0 - s), 0.0, 1.0)
    q = np.clip(v * (1.0 - s * f), 0.0, 1.0)
    t = np.clip(v * (1.0 - s * (1.0 - f)), 0.0, 1.0)
    table = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)]
    out = np.zeros(hsv.shape, np.float64)
    for k, (a, b, c) in enumerate(table):
        m = i == k
        out[m] = np.stack([a[m], b[m], c[m]], -1)
    return out


def ref_hue(im: np.ndarray, factor: float) -> np.ndarray:
    hsv = ref_rgb2hsv(im.astype(np.float64) / 255.0)
    hsv[..., 0] = np.mod(hsv[..., 0] + factor, 1.0)
    return (ref_hsv2rgb(hsv) * 255.0).astype(np.uint8)


def ref_sharpness(im: np.ndarray, factor: float) -> np.ndarray:
    k = np.ones((3, 3), np.float32)
    k[1, 1] = 5.0
    k /= k.sum()
    f = im.astype(np.float32)
    conv = sum(k[dy, dx] * f[dy:dy + f.shape[0] - 2, dx:dx + f.shape[1] - 2] for dy in range(3) for dx in range(3))
    deg = im.copy()
    deg[1:-1, 1:-1] = np.round(conv).astype(np.uint8)
    return ref_blend(im, deg, factor)


def ref_equalize(im: np.ndarray) -> np.ndarray:
    out = np.empty_like(im)
    for c in range(3):
        ch = im[..., c]
        hist = np.bincount(ch.ravel(), minlength=256)
        nz = hist[hist != 0]
        step = nz[:-1].sum() // 255
        if step == 0:
            out[..., c] = ch
            continue
        lut = (np.cumsum(hist) + step // 2) // step
        lut = np.clip(np.concatenate(([0], lut[:-1])), 0, 255)
        out[..., c] = lut[ch]
    return out


def ref_autocontrast(im: np.ndarray) -> np.ndarray:
    f = im.astype(np.float32)
    lo, hi = f.min(axis=(0, 1)), f.max(axis=(0, 1))
    with np.errstate(divide="ignore"):
        scale = np.float32(255.0) / (hi - lo)
    bad = ~np.isfinite(scale)
    lo[bad], scale[bad] = 0, 1
    return np.clip((f - lo) * scale, 0, 255).astype(np.uint8)


def ref_affine_nearest(im: np.ndarray, inv: list[float], fill: float = 0) -> np.ndarray:
    """torchvision's tensor affine: an output pixel centre (relative to the image centre) maps through
    the inverse matrix; grid_sample(nearest, align_corners=False) rounds half to even."""
    h, w = im.shape[:2]
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    xr, yr = xs + 0.5 - w / 2, ys + 0.5 - h / 2
    xi = inv[0] * xr + inv[1] * yr + inv[2] + w / 2 - 0.5
    yi = inv[3] * xr + inv[4] * yr + inv[5] + h / 2 - 0.5
    xn, yn = np.rint(xi).astype(np.int64), np.rint(yi).astype(np.int64)
    ok = (xn >= 0) & (xn < w) & (yn >= 0) & (yn < h)
    out = np.full_like(im, fill)
    out[ok] = im[yn[ok], xn[ok]]
    return out


def ref_inverse_matrix(center, angle, translate, scale, shear):
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [d / scale, -b / scale, 0.0, -c / scale, a / scale, 0.0]
    cx, cy = center
    tx, ty = translate
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty) + cx
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty) + cy
    return m


def ref_blur(im: np.ndarray, ksize: tuple[int, int], sigma: float) -> np.ndarray:
    def kernel(k: int) -> np.ndarray:
        x = np.linspace(-(k - 1) * 0.5, (k - 1) * 0.5, k)
        pdf = np.exp(-0.5 * (x / sigma) ** 2)
        return pdf / pdf.sum()

    kx, ky = kernel(ksize[0]), kernel(ksize[1])
    px, py = ksize[0] // 2, ksize[1] // 2
    f = np.pad(im.astype(np.float64), ((py, py), (px, px), (0, 0)), mode="reflect")
    f = sum(kx[i] * f[:, i:i + im.shape[1]] for i in range(ksize[0]))
    f = sum(ky[i] * f[i:i + im.shape[0]] for i in range(ksize[1]))
    return np.clip(np.round(f), 0, 255).astype(np.uint8)


def within(a: np.ndarray, b: np.ndarray, tol: int) -> None:
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    assert diff.max() <= tol, f"max difference {diff.max()} > {tol} at {np.argwhere(diff > tol)[:3].tolist()}"


# ---- fixed parameters give torchvision's pixels -------------------------------------------------
@pytest.mark.parametrize("factor", [0.0, 0.3, 1.0, 1.7])
def test_brightness_is_exact(img, factor):
    assert np.array_equal(pixels.adjust_brightness(img, factor), ref_blend(img, 0.0, factor))


@pytest.mark.parametrize("factor", [0.0, 0.5, 1.6])
def test_contrast_within_one(img, factor):
    within(pixels.adjust_contrast(img, factor), ref_blend(img, ref_gray(img).astype(np.float32).mean(), factor), 1)


@pytest.mark.parametrize("factor", [0.0, 0.4, 1.9])
def test_saturation_is_exact(img, factor):
    within(pixels.adjust_saturation(img, factor), ref_blend(img, ref_gray(img)[..., None], factor), 0)


@pytest.mark.parametrize("factor", [-0.5, -0.23, 0.0, 0.1, 0.37])
def test_hue_within_one(img, factor):
    within(pixels.adjust_hue(img, factor), ref_hue(img, factor), 1)


@pytest.mark.parametrize("factor", [0.1, 1.0, 1.9])
def test_sharpness_within_one(img, factor):
    within(pixels.adjust_sharpness(img, factor), ref_sharpness(img, factor), 1)


@pytest.mark.parametrize("bits", [1, 4, 7, 8])
def test_posterize_is_exact(img, bits):
    assert np.array_equal(pixels.posterize(img, bits), img & np.uint8(-int(2 ** (8 - bits)) & 0xFF))


@pytest.mark.parametrize("threshold", [0.0, 128.0, 178.5, 255.0])
def test_solarize_and_invert_are_exact(img, threshold):
    assert np.array_equal(pixels.solarize(img, threshold), np.where(img >= threshold, 255 - img, img))
    assert np.array_equal(pixels.invert(img), 255 - img)


def test_autocontrast_and_equalize_are_exact(img):
    assert np.array_equal(pixels.autocontrast(img), ref_autocontrast(img))
    assert np.array_equal(pixels.equalize(img), ref_equalize(img))
    flat = np.full((8, 8, 3), 77, np.uint8)
    assert np.array_equal(pixels.autocontrast(flat), flat)  # max == min: unchanged, as torchvision
    assert np.array_equal(pixels.equalize(flat), flat)


@pytest.mark.parametrize("name,magnitude", [("ShearX", 0.27), ("ShearX", -0.19), ("ShearY", 0.13),
                                            ("TranslateX", 11.7), ("TranslateY", -9.2), ("Rotate", 23.0),
                                            ("Rotate", -131.0)])
def test_geometric_ops_sample_torchvisions_pixels(img, name, magnitude):
    h, w = img.shape[:2]
    if name == "ShearX":
        inv = ref_inverse_matrix((-w / 2, -h / 2), 0.0, (0, 0), 1.0, (math.degrees(math.atan(magnitude)), 0.0))
    elif name == "ShearY":
        inv = ref_inverse_matrix((-w / 2, -h / 2), 0.0, (0, 0), 1.0, (0.0, math.degrees(math.atan(magnitude))))
    elif name == "TranslateX":
        inv = ref_inverse_matrix((0, 0), 0.0, (int(magnitude), 0), 1.0, (0.0, 0.0))
    elif name == "TranslateY":
        inv = ref_inverse_matrix((0, 0), 0.0, (0, int(magnitude)), 1.0, (0.0, 0.0))
    else:
        inv = ref_inverse_matrix((0, 0), -magnitude, (0, 0), 1.0, (0.0, 0.0))
    ours = policy.apply_op(img, name, magnitude, fill=(9, 9, 9))
    ref = ref_affine_nearest(img, inv, fill=9)
    same = (ours == ref).all(-1).mean()
    assert same > 0.99, f"{name}: only {same:.4f} of pixels agree"  # the rest: rounding ties at .5


def test_translate_moves_content_right_and_down(img):
    out = policy.apply_op(img, "TranslateX", 5.0)
    assert np.array_equal(out[:, 5:], img[:, :-5]) and not out[:, :5].any()
    out = policy.apply_op(img, "TranslateY", -3.0)
    assert np.array_equal(out[:-3], img[3:]) and not out[-3:].any()


def test_rotate_90_is_counter_clockwise():
    sq = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    assert np.array_equal(pixels.rotate(sq, 90.0), np.rot90(sq, 1))


@pytest.mark.parametrize("ksize,sigma", [((3, 3), 0.8), ((5, 9), 1.7), ((23, 23), 2.0)])
def test_gaussian_blur_within_one(img, ksize, sigma):
    within(pixels.gaussian_blur(img, ksize, (sigma, sigma)), ref_blur(img, ksize, sigma), 1)


def test_grayscale_is_exact(img):
    out = colour.RandomGrayscale(p=1.0)(img.copy(), rng=np.random.default_rng(0))
    within(out, np.repeat(ref_gray(img)[..., None], 3, -1), 0)


# ---- random parameters follow torchvision's distributions ---------------------------------------
def ks_uniform(x: np.ndarray, lo: float, hi: float) -> float:
    """Kolmogorov-Smirnov distance between samples and U(lo, hi)."""
    x = np.sort((np.asarray(x) - lo) / (hi - lo))
    n = len(x)
    return float(max((np.arange(1, n + 1) / n - x).max(), (x - np.arange(n) / n).max()))


def counts_uniform(values: list, categories: int, draws: int) -> None:
    """Each category within 5 standard deviations of draws / categories."""
    _, counts = np.unique(values, return_counts=True, axis=0)
    assert len(counts) == categories
    p = 1 / categories
    sd = math.sqrt(draws * p * (1 - p))
    assert np.abs(counts - draws * p).max() < 5 * sd, counts


N = 4000


def test_colorjitter_distributions():
    op = colour.ColorJitter(brightness=0.4, contrast=(0.5, 1.5), saturation=0.2, hue=0.1)
    rng = np.random.default_rng(0)
    draws = [op.params(rng, 10, 10) for _ in range(N)]
    factors = np.array([d[1] for d in draws])
    crit = 1.63 / math.sqrt(N)  # the 1% KS critical value
    for k, (lo, hi) in enumerate([(0.6, 1.4), (0.5, 1.5), (0.8, 1.2), (-0.1, 0.1)]):
        assert ks_uniform(factors[:, k], lo, hi) < crit
    counts_uniform([tuple(d[0]) for d in draws], 24, N)  # torch.randperm(4): every order equally likely
    assert colour.ColorJitter(brightness=0).ranges[0] is None  # 0 disables the component
    assert colour.ColorJitter(brightness=2.0).ranges[0] == (0.0, 3.0)  # clipped at 0
    with pytest.raises(ConfigError, match="hue"):
        colour.ColorJitter(hue=0.6)


def test_colorjitter_applies_in_drawn_order(img):
    op = colour.ColorJitter(brightness=0.5, saturation=0.5)
    params = (np.array([2, 0, 1, 3]), (1.3, None, 0.6, None))
    expect = pixels.adjust_brightness(pixels.adjust_saturation(img, 0.6), 1.3)
    assert np.array_equal(op.apply(img, params), expect)


def test_randaugment_draws_like_torchvision():
    op = policy.RandAugment()  # num_ops=2, magnitude=9, num_magnitude_bins=31
    rng = np.random.default_rng(1)
    space = policy.augmentation_space("randaugment", 31, 224, 224)
    assert list(space) == ["Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness",
                           "Color", "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize"]
    expect = {"ShearX": 0.09, "ShearY": 0.09, "TranslateX": 150 / 331 * 224 * 9 / 30, "Rotate": 9.0,
              "Brightness": 0.27, "Posterize": 7.0, "Solarize": 0.7, "Identity": 0.0, "Equalize": 0.0}  # 178.5 / 255
    draws = [op.params(rng, 224, 224) for _ in range(N)]
    assert all(len(d) == 2 for d in draws)
    flat = [x for d in draws for x in d]
    counts_uniform([name for name, _ in flat], 14, len(flat))
    for name, m in flat:
        if name in expect:
            assert abs(abs(m) - expect[name]) < 1e-4, (name, m)
    signs = [m > 0 for name, m in flat if name == "Rotate"]
    assert abs(np.mean(signs) - 0.5) < 5 * 0.5 / math.sqrt(len(signs))
    assert all(m > 0 for name, m in flat if name in ("Posterize", "Solarize"))  # unsigned


def test_trivialaugment_draws_like_torchvision():
    op = policy.TrivialAugmentWide()
    rng = np.random.default_rng(2)
    draws = [op.params(rng, 100, 100)[0] for _ in range(N * 3)]
    counts_uniform([n for n, _ in draws], 14, len(draws))
    rot = np.abs([m for n, m in draws if n == "Rotate"])
    bins = np.rint(rot / (135.0 / 30)).astype(int)  # 31 bins over [0, 135]
    counts_uniform(list(bins), 31, len(bins))
    post = sorted({int(m) for n, m in draws if n == "Posterize"})
    assert post == [2, 3, 4, 5, 6, 7, 8]
    assert max(abs(m) for n, m in draws if n == "TranslateX") == pytest.approx(32.0)


def test_autoaugment_policy_frequencies():
    op = policy.AutoAugment()
    rng = np.random.default_rng(3)
    n = 20000
    chosen = [op.params(rng, 224, 224) for _ in range(n)]
    # "Invert" appears only in sub-policies 13, 17 (second op) and 22, each at p=0.6 and chosen with
    # probability 1/25: P(Invert applied) = 3 * 0.6 / 25
    p_inv = 3 * 0.6 / 25
    got = np.mean([any(name == "Invert" for name, _ in c) for c in chosen])
    assert abs(got - p_inv) < 5 * math.sqrt(p_inv * (1 - p_inv) / n)
    # Rotate magnitudes: bins 3, 8, 9 of linspace(0, 30, 10), both signs
    rot = {round(m, 4) for c in chosen for name, m in c if name == "Rotate"}
    assert rot == {round(s * v, 4) for s in (-1, 1) for v in (10.0, 80 / 3, 30.0)}
    with pytest.raises(ConfigError, match="imagenet"):
        policy.AutoAugment(policy="cifar10")


def ref_erasing_params(rng: np.random.Generator, h: int, w: int, scale, ratio):
    """RandomErasing.get_params as torchvision writes it."""
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        erase_area = h * w * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        eh, ew = int(round(math.sqrt(erase_area * aspect))), int(round(math.sqrt(erase_area / aspect)))
        if eh < h and ew < w:
            return rng.integers(0, h - eh + 1), rng.integers(0, w - ew + 1), eh, ew
    return None


def ks_two(a: np.ndarray, b: np.ndarray) -> float:
    grid = np.union1d(a, b)
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


def test_random_erasing_distribution_and_pixels(img):
    op = colour.SampleRandomErasing(p=0.5, value=(1, 2, 3))
    rng, ref_rng = np.random.default_rng(4), np.random.default_rng(5)
    ours = [op.params(rng, 61, 83) for _ in range(N)]
    applied = [b for b in ours if b is not None]
    assert abs(len(applied) / N - 0.5) < 5 * 0.5 / math.sqrt(N)
    refs = [r for r in (ref_erasing_params(ref_rng, 61, 83, op.scale, op.ratio) for _ in range(len(applied)))
            if r is not None]
    crit = 1.63 * math.sqrt(2 / len(refs))
    for k in range(4):
        assert ks_two(np.array([b[k] for b in applied]), np.array([r[k] for r in refs])) < crit, k
    out = op.apply(img.copy(), (5, 7, 10, 20))
    assert (out[5:15, 7:27] == (1, 2, 3)).all()
    mask = np.ones(img.shape[:2], bool)
    mask[5:15, 7:27] = False
    assert np.array_equal(out[mask], img[mask])


def test_random_erasing_random_value_is_normal_in_normalized_units():
    op = colour.SampleRandomErasing(p=1.0, scale=(0.3, 0.3), ratio=(1.0, 1.0), value="random")
    out = op(np.zeros((200, 200, 3), np.uint8), rng=np.random.default_rng(6))
    erased = out[(out != 0).any(-1)].astype(np.float64) / 255.0
    z = (erased - np.array(op.mean)) / np.array(op.std)
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1.0) < 0.1  # clipping at 0/255 trims the tails a little


def test_gaussian_blur_sigma_and_grayscale_probability():
    rng = np.random.default_rng(8)
    op = colour.GaussianBlur(5, sigma=(0.1, 2.0))
    assert ks_uniform(np.array([op.params(rng, 9, 9) for _ in range(N)]), 0.1, 2.0) < 1.63 / math.sqrt(N)
    g = np.mean([colour.RandomGrayscale(p=0.1).params(rng, 9, 9) for _ in range(N)])
    assert abs(g - 0.1) < 5 * math.sqrt(0.09 / N)
    with pytest.raises(ConfigError, match="odd"):
        colour.GaussianBlur(4)


def test_same_generator_state_gives_same_pixels(img):
    for op in (colour.ColorJitter(0.4, 0.4, 0.4, 0.1), policy.RandAugment(), policy.TrivialAugmentWide(), policy.AutoAugment(),
               colour.SampleRandomErasing(p=1.0, value="random"), colour.GaussianBlur(7)):
        a = op(img.copy(), rng=np.random.default_rng(11))
        b = op(img.copy(), rng=np.random.default_rng(11))
        assert np.array_equal(a, b), type(op).__name__
