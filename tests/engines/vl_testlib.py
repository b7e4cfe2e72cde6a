"""The float64 Qwen2.5-VL reference shared by the VL engine tests."""

from __future__ import annotations

from pathlib import Path

import torch

# three pictures of different sizes (so different patch grids), each with a yellow diagonal
PICTURES = [("a.png", (112, 84), (200, 20, 20)), ("b.png", (60, 150), (20, 20, 200)), ("c.png", (90, 90), (0, 150, 0))]


def write_pictures(folder: Path) -> None:
    """a.png, b.png, c.png (PICTURES) into `folder`."""
    from PIL import Image

    for name, size, colour in PICTURES:
        img = Image.new("RGB", size, colour)
        for k in range(0, min(size), 7):
            img.putpixel((k, k), (255, 255, 0))
        img.save(folder / name)


def reference(vl64, prompt: list[int], output: list[int], images: list, first: int | None = None) -> torch.Tensor:
    """One float64 forward: image features from the HF vision tower put at the prompt's pads (a pad
    id the model sampled in the output stays a text token, as in the engine), 3-D positions from
    the model's get_rope_index over the whole sequence."""
    model, proc = vl64
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        if not images:
            logits = model(input_ids=ids).logits[0]
        else:
            px = proc(images=images, return_tensors="pt")
            types = torch.zeros_like(ids, dtype=torch.int)
            types[0, :len(prompt)] = (ids[0, :len(prompt)] == model.config.image_token_id).int()
            emb = model.get_input_embeddings()(ids).clone()
            feats = model.model.get_image_features(px["pixel_values"].double(), px["image_grid_thw"], return_dict=True)
            emb[types.bool()] = torch.cat(feats.pooler_output)
            pos, _ = model.model.get_rope_index(ids, types, image_grid_thw=px["image_grid_thw"])
            logits = model(inputs_embeds=emb, position_ids=pos).logits[0]
    # log-probs of tokens first.. of prompt + output (default: the output's)
    first = len(prompt) if first is None else first
    seq = prompt + output
    lp = torch.log_softmax(logits, dim=-1)[first - 1: len(seq) - 1]
    return lp.gather(1, torch.tensor(seq[first:])[:, None]).squeeze(1)
