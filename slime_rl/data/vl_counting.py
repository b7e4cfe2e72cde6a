"""The synthetic visual task: count the shapes of one colour in a picture drawn with pillow.

Each picture holds 1-4 shapes of the asked colour among 0-4 distractors of other colours (circles,
squares, triangles at random places, no overlap). The prompt names the colour; the answer is the
count as an integer string (1-4, one digit), so the built-in `--rm-type digit` scores it: 1 when the
first digit of the response is the count.

The text lives here (not in tools/) so that the tiny model's tokenizer can be trained on exactly
the words the task uses (tools/make_tiny_model.py --arch qwen2_5_vl).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
TEMPLATE = "<image>How many {colour} shapes are in the picture? Answer with a number."

CORPUS_EXTRA = (
    "user assistant system You are a helpful assistant. The answer is",
    "How many red shapes are in the picture? Answer with a number. 1 2 3 4",
    "How many blue green yellow shapes? There are 0 1 2 3 4 5 6 7 8 9 shapes.",
)


def _boxes(rng: random.Random, n: int, size: int, cell: int) -> list[tuple[int, int]]:
    """n distinct grid cells (top-left corners), so shapes never overlap."""
    per_row = size // cell
    cells = rng.sample(range(per_row * per_row), n)
    return [((c % per_row) * cell, (c // per_row) * cell) for c in cells]


def draw_picture(rng: random.Random, colour: str, count: int, distractors: int, size: int = 112):
    """A PIL RGB image with `count` shapes of `colour` and `distractors` shapes of other colours."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (245, 245, 245))
    draw = ImageDraw.Draw(img)
    cell = size // 4
    others = [c for c in COLOURS if c != colour]
    fills = [COLOURS[colour]] * count + [COLOURS[rng.choice(others)] for _ in range(distractors)]
    for (x, y), fill in zip(_boxes(rng, len(fills), size, cell), fills, strict=True):
        m = cell // 6
        box = (x + m, y + m, x + cell - m, y + cell - m)
        shape = rng.choice(SHAPES)
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    return img


def make_rows(n: int, seed: int, image_dir: str | Path, size: int = 112) -> list[dict[str, Any]]:
    """n EasyR1-style rows {"problem", "answer", "images": [relative path]}; PNGs written to image_dir."""
    rng = random.Random(seed)
    image_dir = Path(image_dir)
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour = rng.choice(sorted(COLOURS))
        count = rng.randint(1, 4)
        img = draw_picture(rng, colour, count, rng.randint(0, 4), size)
        name = f"{i:05d}.png"
        img.save(image_dir / name)
        rows.append({"problem": TEMPLATE.format(colour=colour), "answer": str(count),
                     "images": [f"{image_dir.name}/{name}"]})
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def corpus_lines(seed: int, n: int = 400) -> list[str]:
    """Text to train the tiny VL tokenizer on: the prompts with their answers, plus CORPUS_EXTRA."""
    rng = random.Random(seed)
    lines = [TEMPLATE.format(colour=rng.choice(sorted(COLOURS))).replace("<image>", "") + " "
             + str(rng.randint(1, 4)) for _ in range(n)]
    return lines + list(CORPUS_EXTRA) * 20
