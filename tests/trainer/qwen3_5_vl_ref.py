"""Image prompts for the tiny Qwen3.5 checkpoints (tiny_qwen3_5, tiny_qwen3_5_moe) and their float64 reference.

`vl_batch` builds the trainer batch with the data side's own code (PromptDataset: images resized by the checkpoint's
processor, <|image_pad|> expanded per merged patch): a one-image row, a two-image row of different grids, a text-only
row and the one-image row again, with make_batch's response lengths, loss masks and advantages (so hf_policy_grad's
loss is the same written-out formula). `hf_inputs` gives transformers' Qwen3_5(Moe)ForConditionalGeneration each
sample's pixels (the checkpoint's image processor on the decoded PNGs), image grids and token types, so that its own
forward runs the vision tower, puts the features at the pads and computes the 3-D positions with its get_rope_index.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tests.trainer.trainer_ref import ADVANTAGES, LOSS_MASKS, RESPONSE_LENGTHS

ROWS = [{"problem": "<image>How many red shapes?", "answer": "1", "images": ["a.png"]},
        {"problem": "<image>How many <image>blue shapes?", "answer": "2", "images": ["b.png", "c.png"]},
        {"problem": "How many green shapes?", "answer": "0"}]


def vl_batch(ckpt: str | Path, folder: Path) -> dict:
    from transformers import AutoTokenizer

    from slime_rl.config import DataConfig
    from slime_rl.data import PromptDataset, write_records
    from tests.engines.vl_testlib import write_pictures

    write_pictures(folder)
    tok = AutoTokenizer.from_pretrained(ckpt)
    rows = PromptDataset(DataConfig(str(write_records(ROWS, folder / "data.jsonl")), "problem", "answer", True),
                         tok).rows
    picks = [rows[0], rows[1], rows[2], rows[0]]
    g = torch.Generator().manual_seed(0)
    first_special = min(tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>"))
    responses = [torch.randint(0, first_special, (n,), generator=g).tolist() for n in RESPONSE_LENGTHS]
    return {
        "tokens": [r.prompt_ids + resp for r, resp in zip(picks, responses, strict=True)],
        "response_lengths": list(RESPONSE_LENGTHS),
        "loss_masks": [list(m) for m in LOSS_MASKS],
        "advantages": list(ADVANTAGES),
        "rollout_logprobs": [[-1.0 - 0.25 * j for j in range(n)] for n in RESPONSE_LENGTHS],
        "rewards": [1.0, 0.0, 1.0, 0.0],
        "images": [list(r.images) for r in picks],
        "image_grid_thw": [[list(x) for x in r.image_grid_thw] for r in picks],
    }


def hf_vl_model(ckpt: str | Path):
    """transformers' image-text-to-text model of the folder in float64 (experts one by one: grouped_mm takes no
    float64)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32, experts_implementation="eager")
    return model.double()


def hf_inputs(model, ckpt: str | Path, batch: dict) -> Callable[[int], dict]:
    """Sample i's keyword inputs besides its tokens: pixel_values, image_grid_thw and mm_token_type_ids (1 at the
    prompt's image pads), or none for a text-only sample."""
    from transformers import AutoImageProcessor

    from slime_rl.data.images import decode_image, image_bytes

    proc = AutoImageProcessor.from_pretrained(ckpt)
    image_id = model.config.image_token_id

    def inputs(i: int) -> dict:
        urls = batch["images"][i]
        if not urls:
            return {}
        px = proc(images=[decode_image(image_bytes(u, None)[0], "ref") for u in urls], return_tensors="pt")
        toks = torch.tensor([batch["tokens"][i]])
        types = (toks == image_id).int()
        types[0, len(batch["tokens"][i]) - batch["response_lengths"][i]:] = 0
        return {"pixel_values": px["pixel_values"].double(), "image_grid_thw": px["image_grid_thw"],
                "mm_token_type_ids": types}

    return inputs
