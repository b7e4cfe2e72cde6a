"""Images in the embedded engine (Qwen2.5-VL): `image_data` parsing, vision tokens, mRoPE positions.

`image_data` takes the forms of SGLang's GenerateReqInput (io_struct.py, SGLang 0.5.23;
`_normalize_image_data` and `utils.load_image`): for one prompt a single image or a list of them,
for a batch a list with one image per prompt or a list of lists. An image is a string (a
`data:image/...;base64,` URL, a local file path, `file://` path, or bare base64) or a dict with a
`url` (SGLang's ImageData); http(s) URLs are refused (the engine runs offline).

`input_ids` mark each image as <|vision_start|> <|image_pad|> <|vision_end|>: one pad per image, which
the engine expands to grid_t*grid_h*grid_w/merge^2 pads from the image's grid. SGLang 0.5.23 does the
same by decoding the ids to text and handing it to the HF processor, which expands each pad and
refuses a prompt whose pad count is not the image count ("Found total N <|image_pad|> tokens and 1
images"): so the already expanded form is refused here with that message too.

Only the prompt's <|image_pad|> ids are image positions; the same id sampled in the output is text
(it matters when a retracted request is prefilled again from prompt + output). So the prefill puts
the vision tower's features into the input embeddings itself, at the prompt's pads, and calls the
model with `inputs_embeds`: HF's forward(pixel_values=...) would fill every pad id of the batch.

Positions: a prompt with images gets Qwen2.5-VL's 3-D (t, h, w) positions from the model's own
`get_rope_index`; every later token is text, whose three position components are equal and one more
than the previous token's maximum. So during decoding a row needs one scalar position,
len(tokens) + rope_delta (delta = max prompt position + 1 - prompt length), which is what HF's
generation does with its cached `rope_deltas`.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

import torch

from slime_rl.data.images import IMAGE_PAD, VISION_START, decode_image
from slime_rl.engines.embedded.sampling import RequestError


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None and hasattr(config, "image_token_id")


def per_request_images(value: Any, n: int, is_batch: bool) -> list[list[Any]]:
    """image_data -> one list of images per prompt (SGLang's normalization)."""
    if value is None or value == []:
        return [[] for _ in range(n)]
    if not is_batch:
        return [value if isinstance(value, list) else [value]]
    if not isinstance(value, list):
        return [[value] for _ in range(n)]
    if len(value) != n:
        raise RequestError(f"image_data: the batch has {n} prompts but {len(value)} entries")
    return [v if isinstance(v, list) else ([] if v is None else [v]) for v in value]


def image_item_bytes(item: Any) -> bytes:
    """Raw bytes of one image_data item; a RequestError names what is wrong."""
    if isinstance(item, dict):
        item = item.get("url")
    if not isinstance(item, str) or not item:
        raise RequestError("image_data: an image must be a data URL, a file path, base64 or {'url': ...}")
    if item.startswith(("http://", "https://")):
        raise RequestError("image_data: http(s) URLs are not fetched by the embedded engine (offline)")
    try:
        if item.startswith("data:"):
            return base64.b64decode(item.split(",", 1)[1], validate=True)
        path = Path(item[len("file://"):] if item.startswith("file://") else item)
        if item.startswith("file://") or path.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp", ".gif"):
            return path.read_bytes()
        return base64.b64decode(item, validate=True)
    except (IndexError, binascii.Error) as exc:
        raise RequestError(f"image_data: not valid base64: {exc}") from exc
    except OSError as exc:
        raise RequestError(f"image_data: cannot read {item!r:.100}: {exc}") from exc


class VisionInputs:
    """Turns a request's images into pixel_values and image_grid_thw and fixes up its input_ids."""

    def __init__(self, config: Any, image_processor: Any, tokenizer: Any) -> None:
        self.image_token_id = config.image_token_id
        self.vision_start_id = config.vision_start_token_id
        self.merge = config.vision_config.spatial_merge_size
        self.processor = image_processor
        if self.image_token_id != tokenizer.convert_tokens_to_ids(IMAGE_PAD) or \
                self.vision_start_id != tokenizer.convert_tokens_to_ids(VISION_START):
            raise ValueError("the model config's image/vision_start token ids do not match the tokenizer's")

    def prepare(self, input_ids: list[int], items: list[Any]) -> tuple[list[int], torch.Tensor | None,
                                                                     torch.Tensor | None]:
        """(input_ids with expanded pads, pixel_values, image_grid_thw) of one request."""
        pads = input_ids.count(self.image_token_id)
        if items and pads != len(items):  # transformers' ProcessorMixin check, as SGLang answers it
            raise RequestError(f"The total number of {IMAGE_PAD} tokens in the prompts should be the same as the "
                               f"number of images passed. Found total {pads} {IMAGE_PAD} tokens and {len(items)} "
                               "images.")
        runs = self._pad_runs(input_ids)
        if sum(n for _, n in runs) != input_ids.count(self.image_token_id):
            raise RequestError("input_ids: an <|image_pad|> outside an image (every run of them must follow "
                               "<|vision_start|>)")
        if len(runs) != len(items):
            raise RequestError(f"image_data: {len(items)} image(s) but the input_ids hold {len(runs)} image "
                               f"placeholder(s) (<|vision_start|> followed by <|image_pad|>)")
        if not items:
            return input_ids, None, None
        try:
            pics = [decode_image(image_item_bytes(it), f"image_data[{i}]") for i, it in enumerate(items)]
        except ValueError as exc:
            raise RequestError(f"image_data: {exc}") from exc
        out = self.processor(images=pics, return_tensors="pt")
        grids = out["image_grid_thw"]
        ids: list[int] = []
        last = 0
        for k, ((start, length), grid) in enumerate(zip(runs, grids.tolist(), strict=True)):
            assert length == 1, f"image_data[{k}]: {length} pads passed the count check"
            n = grid[0] * grid[1] * grid[2] // self.merge ** 2
            ids += input_ids[last:start] + [self.image_token_id] * n
            last = start + length
        return ids + input_ids[last:], out["pixel_values"], grids

    def _pad_runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each run of image pads that follows a vision_start."""
        runs, i = [], 0
        while i < len(ids):
            if ids[i] == self.image_token_id and i > 0 and ids[i - 1] == self.vision_start_id:
                j = i
                while j < len(ids) and ids[j] == self.image_token_id:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        return runs


def prefill_vision_kwargs(model: torch.nn.Module, reqs: list[Any], ids: torch.Tensor,
                          mask: torch.Tensor) -> tuple[dict[str, Any], list[int]]:
    """Forward kwargs for a left-padded prefill batch holding images, and each row's rope delta.

    Rows without images get plain positions from get_rope_index too (all text), so one [3, B, T]
    position tensor serves the whole batch; pixel_values are concatenated in row order, which is the
    order the model scatters image embeddings into the image pad positions.
    """
    with_images = [r for r in reqs if r.pixel_values is not None]
    if not with_images:
        return {}, [0] * len(reqs)
    dev = ids.device
    grids = torch.cat([r.image_grid_thw for r in with_images]).to(dev)
    # only the prompt's pads are images: a generated <|image_pad|> (a random or badly trained policy
    # can sample one) is an ordinary text token, here when a retracted request is prefilled again
    mm_types = torch.zeros_like(ids, dtype=torch.int)
    width = ids.shape[1]
    for i, r in enumerate(reqs):
        start = width - len(r.input_ids) - len(r.output_ids)
        prompt = ids[i, start:start + len(r.input_ids)]
        mm_types[i, start:start + len(r.input_ids)] = (prompt == model.config.image_token_id).int()
    pos, deltas = model.model.get_rope_index(ids, mm_types, image_grid_thw=grids, attention_mask=mask)
    pixels = torch.cat([r.pixel_values for r in with_images]).to(dev, next(model.parameters()).dtype)
    # The image features go into the embeddings here, not through forward(pixel_values=...): HF puts
    # them at every <|image_pad|> id of the batch, output tokens included.
    feats = torch.cat(model.model.get_image_features(pixels, grids, return_dict=True).pooler_output)
    embeds = model.get_input_embeddings()(ids)
    embeds = embeds.masked_scatter(mm_types.bool()[..., None].expand_as(embeds), feats.to(embeds.dtype))
    kwargs = {"inputs_embeds": embeds, "position_ids": pos}
    return kwargs, [int(d) for d in deltas.flatten().tolist()]


def checkpoint_aliases(params: dict[str, torch.nn.Parameter], config: Any) -> dict[str, torch.nn.Parameter]:
    """Qwen2.5-VL parameters under their checkpoint names as well (the HF safetensors layout:
    `visual.*`, `model.layers.*`, `model.embed_tokens.*`, `model.norm.*`), which is what a trainer
    converting to HF names sends; transformers' module tree names them model.visual.* and
    model.language_model.*."""
    if not is_vision_config(config):
        return {}
    out = {}
    for name, p in params.items():
        if name.startswith("model.visual."):
            out[name[len("model."):]] = p
        elif name.startswith("model.language_model."):
            out["model." + name[len("model.language_model."):]] = p
    return out
