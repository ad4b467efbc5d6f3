"""Boxes and masks follow the image: a box drawn into the image as a filled rectangle and sent through
the same plan lands where the transformed box says (crop, resize, flip, CenterCrop padding, and their
combinations), within the one pixel the image's whole-pixel crop window allows."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.transforms import (CenterCrop, Pipeline, RandomHorizontalFlip, RandomResizedCrop, Resize,
                               crop_resize_into)
from stoker.transforms.targets import boxes_through, mask_through, pad_batch, polygons_through, visible, xywh_to_xyxy

PIPELINES = [
    [RandomResizedCrop(48)],
    [RandomResizedCrop((40, 64), scale=(0.3, 1.0)), RandomHorizontalFlip(p=1.0)],
    [Resize(60), CenterCrop(48)],
    [Resize((50, 70)), RandomHorizontalFlip(p=1.0)],
    [CenterCrop(160)],  # larger than the image: zero padding
    [RandomHorizontalFlip(p=1.0), Resize(40), CenterCrop((30, 36))],
]


@st.composite
def scenes(draw):
    h, w = draw(st.integers(40, 150)), draw(st.integers(40, 150))
    x0, y0 = draw(st.integers(0, w - 12)), draw(st.integers(0, h - 12))
    x1, y1 = draw(st.integers(x0 + 12, w)), draw(st.integers(y0 + 12, h))
    pipe = draw(st.sampled_from(range(len(PIPELINES))))
    seed = draw(st.integers(0, 2**32 - 1))
    return h, w, (x0, y0, x1, y1), pipe, seed


def render(h, w, rect, pipe_id, seed):
    img = np.zeros((h, w, 3), np.uint8)
    x0, y0, x1, y1 = rect
    img[y0:y1, x0:x1] = 255
    pipe = Pipeline(PIPELINES[pipe_id])
    u = np.random.default_rng(seed).random((1, max(pipe.draws, 1)))
    plan = pipe.plan(np.array([h]), np.array([w]), u)
    out = np.empty((int(plan.size[0, 0]), int(plan.size[0, 1]), 3), np.uint8)
    crop_resize_into(img, plan.box[0], out, bool(plan.flip[0]), h, w)
    return img, out, plan


@settings(max_examples=300, deadline=None)
@given(scenes())
def test_a_drawn_box_lands_where_the_transformed_box_says(scene):
    h, w, rect, pipe_id, seed = scene
    img, out, plan = render(h, w, rect, pipe_id, seed)
    b = boxes_through(np.array([rect], np.float32), plan.box[0], plan.size[0], bool(plan.flip[0]))[0]
    lit = out[..., 0] > 127
    if b[2] - b[0] < 2 or b[3] - b[1] < 2:  # (almost) cropped away: nothing clearly lit
        assert lit.sum() <= 2 * max(out.shape[:2])
        return
    ys, xs = np.nonzero(lit)
    assert len(xs), (rect, b)
    drawn = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float32)
    assert np.abs(drawn - b).max() <= 1.5, (drawn, b, plan.box[0], plan.size[0], plan.flip[0])


@settings(max_examples=200, deadline=None)
@given(scenes())
def test_a_mask_follows_the_image(scene):
    h, w, rect, pipe_id, seed = scene
    img, out, plan = render(h, w, rect, pipe_id, seed)
    mask = np.zeros((h, w), np.uint8)
    x0, y0, x1, y1 = rect
    mask[y0:y1, x0:x1] = 7
    m = mask_through(mask, plan.box[0], plan.size[0], bool(plan.flip[0]))
    assert m.shape == out.shape[:2] and set(np.unique(m)) <= {0, 7}
    disagree = (m == 7) != (out[..., 0] > 127)
    # they may differ only along the rectangle's edges: at most one pixel deep
    assert disagree.sum() <= 2 * (out.shape[0] + out.shape[1]) + 4


def test_flip_mirrors_and_boxes_outside_are_kept_empty():
    b = boxes_through(np.array([[10, 5, 30, 25], [200, 0, 220, 10]]), (0, 0, 100, 100), (50, 50), True)
    assert np.allclose(b[0], [35, 2.5, 45, 12.5])
    assert visible(b).tolist() == [True, False] and b.shape == (2, 4)
    assert np.allclose(xywh_to_xyxy([1, 2, 3, 4]), [[1, 2, 4, 6]])
    bools = mask_through(np.eye(8, dtype=bool), (0, 0, 8, 8), (16, 16), False)
    assert bools.dtype == np.bool_ and bools.sum() == 32


@settings(max_examples=200, deadline=None)
@given(scenes())
def test_a_polygon_filled_after_the_plan_covers_the_drawn_pixels(scene):
    """A rectangle given as a polygon (fractions of the image) and filled at the output size lands on the
    pixels the image's own transform lit, except along the outline (one pixel deep)."""
    h, w, rect, pipe_id, seed = scene
    img, out, plan = render(h, w, rect, pipe_id, seed)
    x0, y0, x1, y1 = rect
    poly = np.array([x0, y0, x1, y0, x1, y1, x0, y1], np.float64) / np.tile([w, h], 4)
    masks = polygons_through(poly, [4], [0], 2, (h, w), plan.box[0], plan.size[0], bool(plan.flip[0]))
    assert masks.shape == (2, *out.shape[:2]) and masks.dtype == np.uint8
    assert not masks[1].any()  # an instance without polygons stays empty
    disagree = (masks[0] == 1) != (out[..., 0] > 127)
    assert disagree.sum() <= 2 * (out.shape[0] + out.shape[1]) + 4
    b = boxes_through(np.array([rect], np.float32), plan.box[0], plan.size[0], bool(plan.flip[0]))[0]
    ys, xs = np.nonzero(masks[0])
    if len(xs):  # and the filled pixels lie inside the transformed box (within 1, plus the 1/16-pixel vertex grid)
        assert xs.min() >= b[0] - 1 and xs.max() + 1 <= b[2] + 1.1 and ys.min() >= b[1] - 1 \
            and ys.max() + 1 <= b[3] + 1.1, ((xs.min(), ys.min(), xs.max(), ys.max()), b)


def test_polygon_holes_and_several_instances():
    outer = [0.1, 0.1, 0.9, 0.1, 0.9, 0.9, 0.1, 0.9]
    hole = [0.4, 0.4, 0.6, 0.4, 0.6, 0.6, 0.4, 0.6]
    tri = [0.0, 0.0, 0.3, 0.0, 0.0, 0.3]
    m = polygons_through(outer + hole + tri, [4, 4, 3], [0, 0, 1], 2, (100, 100), (0, 0, 100, 100), (50, 50), False)
    assert m[0, 25, 25] == 0 and m[0, 10, 10] == 1 and m[0, 2, 2] == 0   # the hole is empty (even-odd)
    assert m[1, 2, 2] == 1 and m[1, 40, 40] == 0
    flipped = polygons_through(tri, [3], [0], 1, (100, 100), (0, 0, 100, 100), (50, 50), True)
    # mirrored, up to the rounding of the outline (whole pixels are rounded half up, not mirrored)
    assert (flipped[0] != m[1][:, ::-1]).sum() <= 50 and flipped[0][2, 47] == 1 and flipped[0][2, 2] == 0


def test_pad_batch_gives_padded_rows_and_sizes():
    rows = [np.ones((2, 4), np.float32), np.zeros((0, 4), np.float32), 2 * np.ones((3, 4), np.float32)]
    padded, sizes = pad_batch(rows, fill=-1)
    assert padded.shape == (3, 3, 4) and sizes.tolist() == [2, 0, 3]
    assert (padded[0, :2] == 1).all() and (padded[0, 2] == -1).all() and (padded[1] == -1).all()
    assert (padded[2] == 2).all()
    empty, sizes = pad_batch([np.zeros((0, 5, 5), np.uint8)] * 2)
    assert empty.shape == (2, 1, 5, 5) and sizes.tolist() == [0, 0]
    import pytest
    with pytest.raises(ValueError, match="row 1"):
        pad_batch([np.zeros((1, 4)), np.zeros((1, 5))])
