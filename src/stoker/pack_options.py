"""`PackOptions`: how a pack normalizes and writes its samples, frozen and checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import codecs
from ._system import parse_size
from .errors import ConfigError
from .pack_map import PackSample, function_fingerprint

__all__ = ["SAMPLE_KINDS", "PackOptions"]

#: PackOptions.samples: what a source's files are
SAMPLE_KINDS = ("auto", "image", "video")


@dataclass(frozen=True)
class PackOptions:
    """How samples are normalized and written. All but ``workers``, ``engine`` and ``address``
    shape the output: a Ray pack is the same bytes as a local one."""

    max_side: int | None = None      # shrink so the longer side is at most this many pixels
    encoding: str = "keep"           # keep: JPEG bytes kept when possible, else a faithful JPEG or PNG;
                                     # jpeg: every sample re-encoded as JPEG; raw: RGB pixels
    jpeg_quality: int = 90           # 1..100, for re-encoded samples
    raw_below: int = 64 * 64         # samples with <= this many pixels are stored raw (0: never)
    shard_size: int = 256 * 2**20    # bytes of image data per shard (a shard closes once it reaches this);
                                     # a size string ("16MiB", "1G") is turned into bytes
    workers: int | None = None       # threads; None: one per usable CPU; 1: in this thread
    engine: str = "local"            # local: threads here; ray: Ray workers (see stoker.ray_engine)
    address: str | None = None       # with engine="ray": the cluster ("auto", "ray://host:10001"); None: local
    on_error: str = "skip"           # skip: log bad files to skipped.jsonl; fail: stop at the first
    max_pixels: int = codecs.MAX_PIXELS  # decompression-bomb limit, pixels (None: the default)
    samples: str = "auto"            # auto: videos when the source lists video files (or bytes), else images
    video_keyframes: float | None = None  # videos: re-encode (H.264) with a keyframe every this many seconds;
                                     # None: stored byte-for-byte unless max_side shrinks them
    video_crf: int = 23              # quality of re-encoded videos (x264's CRF: lower is better, larger)
    map: Callable[[PackSample], Any] | None = None   # your function per sample (stoker.pack_map): a changed
                                     # PackSample, a list of them, or None to drop it
    map_fingerprint: str | None = None   # names `map`'s version for resume; None: a hash of its code

    def __post_init__(self) -> None:
        if self.max_pixels is None:
            object.__setattr__(self, "max_pixels", codecs.MAX_PIXELS)
        if isinstance(self.shard_size, str):   # "16MiB", as `stoker pack --shard-size` takes it
            object.__setattr__(self, "shard_size", parse_size(self.shard_size))
        def bad(name: str, expected: str) -> ConfigError:
            return ConfigError(f"pack option {name}={getattr(self, name)!r}: expected {expected}")
        if self.max_side is not None and (not isinstance(self.max_side, int) or self.max_side < 1):
            raise bad("max_side", "None or a positive number of pixels")
        if self.encoding not in ("keep", "jpeg", "raw"):
            raise bad("encoding", "'keep', 'jpeg' or 'raw'")
        if not isinstance(self.jpeg_quality, int) or not 1 <= self.jpeg_quality <= 100:
            raise bad("jpeg_quality", "an integer in 1..100")
        if not isinstance(self.raw_below, int) or self.raw_below < 0:
            raise bad("raw_below", "a pixel count >= 0")
        if not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise bad("shard_size", "a positive number of bytes")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 1):
            raise bad("workers", "None or a positive integer")
        if self.engine not in ("local", "ray"):
            raise bad("engine", "'local' or 'ray'")
        if self.address is not None and self.engine != "ray":
            raise bad("address", "None unless engine='ray'")
        if self.on_error not in ("skip", "fail"):
            raise bad("on_error", "'skip' or 'fail'")
        if not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise bad("max_pixels", "a positive pixel count")
        if self.samples not in SAMPLE_KINDS:
            raise bad("samples", f"one of {SAMPLE_KINDS}")
        if self.video_keyframes is not None and not (isinstance(self.video_keyframes, (int, float))
                                                     and 0 < self.video_keyframes <= 60):
            raise bad("video_keyframes", "None or seconds between keyframes in (0, 60]")
        if not isinstance(self.video_crf, int) or not 0 <= self.video_crf <= 51:
            raise bad("video_crf", "an integer in 0..51")
        if self.map is not None and not callable(self.map):
            raise bad("map", "None or a function taking a stoker.PackSample")
        if self.map_fingerprint is not None and (self.map is None or not isinstance(self.map_fingerprint, str)
                                                 or not self.map_fingerprint):
            raise bad("map_fingerprint", "None, or with map= a non-empty string naming the function's version")

    def output_options(self) -> dict[str, Any]:
        """The options that decide the bytes written (not ``workers``, ``engine``, ``address``); the pack
        function by its fingerprint (``map_fingerprint``, else a hash of its code)."""
        opts = {f: getattr(self, f) for f in self.__dataclass_fields__
                if f not in ("workers", "engine", "address", "map", "map_fingerprint")}
        if self.map is not None:   # recorded only when set: packs made without one keep their manifest
            opts["map"] = self.map_fingerprint or function_fingerprint(self.map)
        return opts
