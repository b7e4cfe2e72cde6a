"""Vision-language rows of a prompt dataset: EasyR1's problem/answer/images layout for Qwen2.5-VL and Qwen3.5.

`PromptDataset` hands each row to `VisionRows`, which
1. reads the row's `--image-key` column (one reference or a list; see `images.image_bytes` for the
   accepted forms) and checks that the prompt has exactly one `<image>` placeholder per image;
2. decodes and resizes every image (`--min-pixels/--max-pixels`, else the checkpoint's processor
   bounds), so a missing, corrupt or mismatched image fails the load, naming the row;
3. turns each `<image>` into Qwen2.5-VL's vision tokens: with `--apply-chat-template` the prompt
   becomes content parts ({"type": "image"}, {"type": "text"}) and the chat template renders them
   (<|vision_start|><|image_pad|><|vision_end|>), without it the placeholder is replaced by the same
   three tokens; then each <|image_pad|> is repeated once per merged patch and the text tokenized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slime_rl.config import DataConfig
from slime_rl.data.images import (
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    VISION_END,
    VISION_START,
    VisionSpec,
    decode_image,
    expand_image_pads,
    image_bytes,
    load_image_processor,
    split_placeholders,
)
from slime_rl.data.readers import DataError


def _count_placeholders(raw: Any) -> int:
    if isinstance(raw, str):
        return raw.count(IMAGE_PLACEHOLDER)
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in raw if isinstance(m.get("content"), str))


class VisionRows:
    """Per-dataset image handling; the image processor is looked up only when a row has images."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, base_dir: Path, image_processor: Any = None) -> None:
        self.cfg, self.tokenizer, self.base_dir = cfg, tokenizer, base_dir
        self._processor = image_processor
        self._spec: VisionSpec | None = None
        if cfg.min_pixels and cfg.max_pixels and cfg.min_pixels > cfg.max_pixels:
            raise DataError(f"--min-pixels {cfg.min_pixels} is above --max-pixels {cfg.max_pixels}")

    @property
    def spec(self) -> VisionSpec:
        if self._spec is None:
            if self._processor is None:
                path = getattr(self.tokenizer, "name_or_path", "")
                self._processor = load_image_processor(path) if path else None
                if self._processor is None:
                    raise DataError(f"{self.cfg.prompt_data}: rows have images ('{self.cfg.image_key}', --image-key) "
                                    f"but the checkpoint {path!r} has no image processor (preprocessor_config.json); "
                                    "use a vision-language checkpoint")
            pad_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            if pad_id is None or pad_id == self.tokenizer.unk_token_id:
                raise DataError(f"the tokenizer has no {IMAGE_PAD} token; images need a vision-language tokenizer "
                                "(Qwen2.5-VL, Qwen3.5)")
            self.image_pad_id = pad_id
            self._spec = VisionSpec.from_image_processor(self._processor, self.cfg.min_pixels, self.cfg.max_pixels)
        return self._spec

    def images_of(self, record: dict[str, Any], raw: Any) -> list[tuple[str, list[int]]]:
        """(PNG data URL, grid [t, h, w]) of each image of a row; a ValueError names what is wrong."""
        key = self.cfg.image_key
        refs = record.get(key) if key else None
        if refs is None or (isinstance(refs, list) and not refs):
            refs = []
        elif not isinstance(refs, list):
            refs = [refs]
        if refs:
            _refuse_text_only_family(self.cfg.prompt_data, key, getattr(self.tokenizer, "name_or_path", ""))
        n_tags = _count_placeholders(raw)
        if n_tags != len(refs):
            raise ValueError(f"the prompt has {n_tags} {IMAGE_PLACEHOLDER} placeholder(s) but the row has "
                             f"{len(refs)} image(s) in '{key}' (--image-key); give one {IMAGE_PLACEHOLDER} per image")
        out = []
        for i, ref in enumerate(refs):
            try:
                data, name = image_bytes(ref, self.base_dir)
                out.append(self.spec.prepare(decode_image(data, name)))
            except ValueError as exc:
                raise ValueError(f"'{key}'[{i}]: {exc}") from exc
        return out

    def with_image_parts(self, raw: Any, apply_chat_template: bool) -> Any:
        """The prompt with each <image> as a chat content part (template) or as the vision tokens (no template)."""
        if not apply_chat_template:
            return raw.replace(IMAGE_PLACEHOLDER, VISION_START + IMAGE_PAD + VISION_END)
        if isinstance(raw, str):
            return [{"role": "user", "content": split_placeholders(raw)}]
        return [dict(m, content=split_placeholders(m["content"]))
                if isinstance(m["content"], str) and IMAGE_PLACEHOLDER in m["content"] else m for m in raw]

    def expand(self, text: str, images: list[tuple[str, list[int]]]) -> list[int]:
        """Token ids of the text with every <|image_pad|> repeated per merged patch, checked. The
        text itself stays short (one pad per image, as the chat template renders it) for logs."""
        counts = [self.spec.num_tokens(grid) for _, grid in images]
        ids = list(self.tokenizer(expand_image_pads(text, counts), add_special_tokens=False)["input_ids"])
        found = sum(1 for t in ids if t == self.image_pad_id)
        if found != sum(counts):
            raise ValueError(f"the prompt tokenizes to {found} {IMAGE_PAD} ids, expected {sum(counts)} "
                             f"(grids {[g for _, g in images]}); does the prompt text itself contain {IMAGE_PAD}?")
        return ids


def _refuse_text_only_family(prompt_data: str, image_key: str | None, checkpoint: str) -> None:
    """DataError when the checkpoint is of a vision-language family (Qwen3.5, `Family.text_config`) whose config.json
    has no vision_config: the trainer builds its text decoder alone then, so its forward would have no features of the
    images. (A text model's folder has no image processor: `VisionRows.spec` says so.)"""
    import json

    from slime_rl.config.families import FAMILIES

    config = Path(checkpoint) / "config.json" if checkpoint else None
    if config is None or not config.is_file():
        return
    cfg = json.loads(config.read_text())
    family = FAMILIES.get(cfg.get("model_type", ""))
    if family is not None and family.vision and not family.builds_vision(cfg):
        raise DataError(f"{prompt_data}: rows have images ('{image_key}', --image-key) but {checkpoint}'s config.json "
                        f"(model_type {cfg['model_type']!r}) has no vision_config: the trainer builds its text decoder "
                        "alone; give text-only rows or a checkpoint with its vision tower")
