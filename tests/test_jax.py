"""docs/jax.md runs as written: its Python blocks, in order, in a child interpreter with two CPU devices
(XLA_FLAGS must be set before jax is imported), on a packed dataset made here; then the page's claims
are checked: batches sharded across both devices, the same losses for the same seed, and a resume that
continues on exactly the batches the checkpointed model had not trained on. Torch-free."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_image_folder
from stoker import pack
from stoker.packing import PackOptions

pytest.importorskip("jax")   # `pip install 'stoker[test-jax]'` (the test extras `make test` installs)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "jax.md"

CHECKS = """
import json
last_images = images
again = stoker.Loader(DATA, 8, **loader_args)
params, again_losses = init_params(), []
for images, labels, state in device_batches(again):
    params, loss = train_step(params, images, labels)
    again_losses.append(float(loss))
print(json.dumps({
    "devices": len(jax.devices()),
    "shard_devices": len(last_images.sharding.device_set),
    "shard_shape": list(last_images.addressable_shards[0].data.shape),
    "losses": losses, "again": again_losses, "resumed": resumed_losses, "step": checkpoint["step"],
    "slots": loader.stats.slots_allocated, "ring": loader.prefetch + 2,
    "torch": sys.modules.get("torch") is not None,
}))
"""


def _blocks() -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S))


def test_the_jax_page_trains_shards_repeats_and_resumes(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "imgs", n_per_class=11, sizes=((40, 48), (36, 52)))   # 33 images: 4 batches of 8
    pack(tmp_path / "imgs", tmp_path / "packed", options=PackOptions(workers=1), progress=False)
    # torch made unimportable, as in an install without it: the JAX input needs none
    script = f"import sys\nsys.modules['torch'] = None\nDATA = {str(tmp_path / 'packed')!r}\n" + _blocks() + CHECKS
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2 and out["shard_devices"] == 2
    assert out["shard_shape"] == [4, 3, 32, 32]   # each device holds half of the batch of 8
    assert len(out["losses"]) == 4 and all(loss == loss for loss in out["losses"])   # finite, not NaN
    assert out["again"] == out["losses"]   # same seed, same batches, same steps
    assert out["resumed"] == out["losses"][out["step"] + 1:] and len(out["resumed"]) == 3
    # device_put's copies let go of the ring's slots: none was kept and replaced
    assert out["slots"] == out["ring"]
    assert not out["torch"]
