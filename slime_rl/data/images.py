"""Images of vision-language prompts (Qwen2.5-VL): loading, resizing, vision-token expansion.

An image reference in a data row may be
- a file path, relative to the data file's folder (EasyR1's layout) or absolute, or `file://...`;
- embedded bytes: a parquet binary cell, a `data:image/...;base64,` URL, or a dict as HF `datasets`
  writes an Image feature (`{"bytes": b"...", "path": ...}`; bytes may be None, then the path);
- never an http(s) URL: runs are offline, so a URL is refused with the row named.

Every image is decoded at load (a missing or corrupt file fails there, naming file and row), then
resized exactly as Qwen2.5-VL's processor would (`smart_resize`: both sides a multiple of
patch * merge = 28, area within [min_pixels, max_pixels], aspect kept) and kept as a PNG in a
`data:image/png;base64,` URL: a string survives JSON (checkpointed rollout state) and is one of
the forms SGLang's `image_data` takes, so it goes to any engine as it is. The
kept picture is already at its final size, so the engine's processor (SGLang's or ours) and the
trainer's recompute the same grid from it: PIL's resize to the current size is a copy, and PNG is
lossless. Each image then stands for grid_t * grid_h * grid_w / merge^2 `<|image_pad|>` tokens in
the prompt ids, between <|vision_start|> and <|vision_end|>, which is what the HF processor does.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
# Qwen2.5-VL's vision tokens (tokenizer_config.json of Qwen/Qwen2.5-VL-*-Instruct)
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2.5-VL's target size: sides multiples of `factor`, area in [min_pixels, max_pixels].

    Written from the rule the Qwen2-VL processor documents (round each side to the factor; if the
    area is too large scale both sides down by sqrt(area / max) and floor, if too small scale up by
    sqrt(min / area) and ceil); the tests compare it with transformers' processor output.
    """
    if min(height, width) < 1 or max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {width}x{height}: the aspect ratio must be below 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def image_bytes(ref: Any, base_dir: Path | None) -> tuple[bytes, str]:
    """(raw bytes, a name for errors) of one image reference as a data row holds it."""
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return image_bytes(ref["bytes"], base_dir)
        if ref.get("path"):
            return image_bytes(ref["path"], base_dir)
        raise ValueError(f"image dict without 'bytes' or 'path' (keys {sorted(ref)})")
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return bytes(ref), "<embedded bytes>"
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"an image must be a path, bytes, a data URL or a {{'bytes': ...}} dict; "
                         f"got {type(ref).__name__}")
    if ref.startswith(("http://", "https://")):
        raise ValueError(f"image {ref!r:.80}: URLs are not fetched (runs are offline); download the "
                         "images and give paths relative to the data file")
    if ref.startswith("data:"):
        try:
            return base64.b64decode(ref.split(",", 1)[1], validate=True), "<data URL>"
        except (IndexError, binascii.Error) as exc:
            raise ValueError(f"image data URL {ref[:40]!r}...: not valid base64: {exc}") from exc
    path = Path(ref[len("file://"):] if ref.startswith("file://") else ref)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return path.read_bytes(), str(path)
    except FileNotFoundError as exc:
        raise ValueError(f"image file {path} does not exist") from exc
    except OSError as exc:
        raise ValueError(f"image file {path} cannot be read: {exc}") from exc


def decode_image(data: bytes, name: str):
    """A fully decoded RGB PIL image; a corrupt or truncated file raises naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"image {name} is not a readable image: {type(exc).__name__}: {exc}") from exc
    return img.convert("RGB")


def to_data_url(img) -> str:
    """A lossless `data:image/png;base64,...` URL of a PIL image."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass
class VisionSpec:
    """What the data side needs of a Qwen2.5-VL checkpoint: patch/merge sizes and pixel bounds.

    Built from the checkpoint's image processor (`from_image_processor`); `--min-pixels` and
    `--max-pixels` override its bounds.
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_image_processor(cls, proc: Any, min_pixels: int | None = None,
                             max_pixels: int | None = None) -> VisionSpec:
        size = getattr(proc, "size", None) or {}
        get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
        return cls(patch_size=int(proc.patch_size), merge_size=int(proc.merge_size),
                   temporal_patch_size=int(proc.temporal_patch_size),
                   min_pixels=int(min_pixels or get("shortest_edge") or cls.min_pixels),
                   max_pixels=int(max_pixels or get("longest_edge") or cls.max_pixels))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def prepare(self, img) -> tuple[str, list[int]]:
        """(PNG data URL at the final size, [grid_t, grid_h, grid_w]) of one decoded image."""
        from PIL import Image

        h, w = smart_resize(img.height, img.width, self.factor, self.min_pixels, self.max_pixels)
        if (w, h) != img.size:
            img = img.resize((w, h), resample=Image.Resampling.BICUBIC)
        # a still image is one temporal patch (the processor repeats the frame temporal_patch_size times)
        return to_data_url(img), [1, h // self.patch_size, w // self.patch_size]

    def num_tokens(self, grid: list[int]) -> int:
        return grid[0] * grid[1] * grid[2] // (self.merge_size ** 2)


def load_image_processor(model_path: str | Path) -> Any:
    """The checkpoint's image processor (PIL backend when torchvision is absent), or None if it has none."""
    from transformers import AutoImageProcessor

    if not (Path(model_path) / "preprocessor_config.json").is_file():
        return None
    return AutoImageProcessor.from_pretrained(str(model_path))


def pixel_inputs(image_processor: Any, images: list[str | bytes]) -> dict[str, Any]:
    """pixel_values [sum(t*h*w), C*T*P*P] and image_grid_thw [n, 3] for prepared images (engine, trainer).

    The images are already at their final size, so the processor's own resize leaves them as they are.
    """
    pics = [decode_image(image_bytes(ref, None)[0], f"image {i}") for i, ref in enumerate(images)]
    out = image_processor(images=pics, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def split_placeholders(text: str) -> list[dict[str, str]]:
    """'<image>How many?' -> [{"type": "image"}, {"type": "text", "text": "How many?"}] (chat content parts)."""
    parts: list[dict[str, str]] = []
    for i, chunk in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i > 0:
            parts.append({"type": "image"})
        if chunk:
            parts.append({"type": "text", "text": chunk})
    return parts


def expand_image_pads(text: str, counts: list[int]) -> str:
    """Repeat the k-th <|image_pad|> counts[k] times (what the HF processor does before tokenizing)."""
    chunks = text.split(IMAGE_PAD)
    if len(chunks) - 1 != len(counts):
        raise ValueError(f"the rendered prompt has {len(chunks) - 1} {IMAGE_PAD} tokens for {len(counts)} images")
    out = [chunks[0]]
    for n, chunk in zip(counts, chunks[1:], strict=True):
        out.append(IMAGE_PAD * n + chunk)
    return "".join(out)
