"""Hostile COCO instances files (plain JSON, as any downloaded annotation file): RLE sizes that lie,
polygons of a million vertices, boxes of NaN and infinity, images of negative width. Each costs its
image (a skipped.jsonl line), never the pack, the memory or the Loader's time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from stoker.packing import SKIPPED_NAME, PackOptions, pack
from stoker.sources import open_source
from stoker.transforms.targets import polygons_through

from .rhelpers import jpeg_bytes, run_child, smooth_rgb

H, W = 120, 160


def _coco(root: Path, annotations: list[dict], images: list[dict] | None = None) -> Path:
    """Two JPEGs of 160x120: image 1 carries `annotations`, image 2 one plain box."""
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for name in ("a.jpg", "b.jpg"):
        (root / "images" / name).write_bytes(jpeg_bytes(smooth_rgb(rng, H, W)))
    images = images or [{"id": 1, "file_name": "a.jpg", "width": W, "height": H},
                        {"id": 2, "file_name": "b.jpg", "width": W, "height": H}]
    anns = [{**a, "id": 10 + k, "image_id": a.get("image_id", 1), "category_id": 1} for k, a in enumerate(annotations)]
    anns.append({"id": 99, "image_id": 2, "category_id": 1, "bbox": [10, 10, 20, 20], "segmentation": []})
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": [{"id": 1, "name": "x"}]}))
    return path


def _packed_and_skipped(ann: Path, out: Path) -> tuple[int, dict[str, str]]:
    summary = pack(ann, out, root=ann.parent / "images", options=PackOptions(workers=1), progress=False)
    lines = (out / SKIPPED_NAME).read_text().splitlines() if (out / SKIPPED_NAME).exists() else []
    return summary.packed, {json.loads(x)["key"]: json.loads(x)["reason"] for x in lines}


def test_rle_size_must_be_its_images(tmp_path: Path) -> None:
    # one run covering 60000 x 60000 pixels on a 160 x 120 image: 3.6 GB if decoded
    lying = {"bbox": [0, 0, 10, 10], "iscrowd": 1, "segmentation": {"size": [60000, 60000], "counts": [0, 60000 ** 2]}}
    ann = _coco(tmp_path, [lying])
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from stoker.sources import open_source
src = open_source({str(ann)!r}, root={str(tmp_path / "images")!r})
print([i.key for i in src.items], [s["reason"] for s in src.skipped])
"""
    proc = run_child(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "['b.jpg']" in proc.stdout and "an RLE of size 60000x60000 (height x width) on an image listed as " \
        "120x160" in proc.stdout


def test_rle_over_the_pixel_limit_is_refused_before_decoding(tmp_path: Path) -> None:
    big = 20000   # an image entry that claims 20000 x 20000, and an RLE to match: 400 M pixels
    images = [{"id": 1, "file_name": "a.jpg", "width": big, "height": big},
              {"id": 2, "file_name": "b.jpg", "width": W, "height": H}]
    rle = {"bbox": [0, 0, 1, 1], "iscrowd": 1, "segmentation": {"size": [big, big], "counts": [0, big * big]}}
    src = open_source(_coco(tmp_path, [rle], images), root=tmp_path / "images")
    assert [i.key for i in src.items] == ["b.jpg"]
    assert "400,000,000 pixels, above the limit" in src.skipped[0]["reason"]


def test_huge_polygon_is_refused_at_pack_and_its_image_logged(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    poly = (rng.random((10_000, 2)) * [W, H]).ravel().tolist()   # 10k self-crossing vertices
    ann = _coco(tmp_path, [{"bbox": [0, 0, W, H], "segmentation": [poly]}])
    packed, reasons = _packed_and_skipped(ann, tmp_path / "out")
    assert packed == 1 and "a polygon of 10,000 vertices, more than the 4,096" in reasons["a.jpg"]


def test_polygon_fill_time_grows_with_vertices_not_faster() -> None:
    """cv2.fillPoly took 8 s for 10k self-crossing vertices at 480 rows, growing super-linearly: 4x the
    vertices must cost well under 16x the time (a ratio of two fills measured in turn, the fastest of three
    each, so a busy machine slows both alike; linear growth gives about 4)."""
    rng = np.random.default_rng(2)
    n = 8192

    def fastest(k: int) -> tuple[float, np.ndarray]:
        points = rng.random(2 * k)
        best, masks = float("inf"), None
        for _ in range(3):
            started = time.perf_counter()
            masks = polygons_through(points, [k], [0], 1, (480, 640), (0, 0, 480, 640), (480, 640), False)
            best = min(best, time.perf_counter() - started)
        return best, masks

    small, _ = fastest(n // 4)
    took, masks = fastest(n)
    assert took < 60, f"filling {n} self-crossing vertices at 480x640 took {took:.2f} s"   # a hang guard
    assert took / max(small, 1e-3) < 10, f"{n} vertices took {took / max(small, 1e-3):.1f}x the time of {n // 4}"
    assert 0.2 < masks.mean() < 0.8   # even-odd over a scribble: part in, part out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # pycocotools and numpy 2
def test_polygon_fill_matches_pycocotools() -> None:
    mask_api = pytest.importorskip("pycocotools.mask", reason="pip install 'stoker[test-formats]'")
    rng = np.random.default_rng(3)
    differ = area = 0
    for _ in range(100):
        n = int(rng.integers(3, 30))
        ang = np.sort(rng.random(n) * 2 * np.pi)
        r = 5 + rng.random(n) * 25
        xy = np.stack([40 + r * np.cos(ang), 30 + r * np.sin(ang) * 0.9], axis=1)
        ref = mask_api.decode(mask_api.frPyObjects([xy.ravel().tolist()], 60, 80))[..., 0]
        mine = polygons_through((xy / (80, 60)).ravel(), [n], [0], 1, (60, 80), (0, 0, 60, 80), (60, 80), False)[0]
        differ += int((mine != ref).sum())
        area += int(ref.sum())
    assert differ / area < 0.03


@pytest.mark.parametrize("bbox", [[float("nan"), 0, 10, 10], [0, 0, float("inf"), 10], [0, 0, -5, 10],
                                  [0, 0, 10, -1e308 * 10]])
def test_boxes_of_nan_inf_or_negative_size_skip_their_image(tmp_path: Path, bbox: list[float]) -> None:
    ann = _coco(tmp_path, [{"bbox": bbox, "segmentation": []}])   # json writes NaN / Infinity literals
    packed, reasons = _packed_and_skipped(ann, tmp_path / "out")
    assert packed == 1 and list(reasons) == ["a.jpg"] and "annotation id 10 has the box" in reasons["a.jpg"]


@pytest.mark.parametrize("size", [(-160, 120), (160, float("nan")), (0, 120)])
def test_images_of_negative_or_missing_size_are_skipped(tmp_path: Path, size: tuple) -> None:
    images = [{"id": 1, "file_name": "a.jpg", "width": size[0], "height": size[1]},
              {"id": 2, "file_name": "b.jpg", "width": W, "height": H}]
    ann = _coco(tmp_path, [{"bbox": [1, 1, 5, 5], "segmentation": []}], images)
    packed, reasons = _packed_and_skipped(ann, tmp_path / "out")
    assert packed == 1 and "is not a positive size" in reasons["a.jpg"]


def test_nan_polygon_vertex_skips_its_image(tmp_path: Path) -> None:
    ann = _coco(tmp_path, [{"bbox": [0, 0, 10, 10], "segmentation": [[0, 0, 10, float("nan"), 10, 10]]}])
    packed, reasons = _packed_and_skipped(ann, tmp_path / "out")
    assert packed == 1 and "NaN or infinite vertex" in reasons["a.jpg"]
