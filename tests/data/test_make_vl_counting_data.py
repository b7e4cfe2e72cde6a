"""tools/make_vl_counting_data.py: the rows load as VL prompts and every answer is the true count.

The count is checked from the picture itself: connected regions of exactly the asked colour
(4-neighbour flood fill over the PNG's pixels), independent of how the tool placed the shapes.
"""

from __future__ import annotations

import json
import re

from PIL import Image
from transformers import AutoTokenizer

from slime_rl.config import DataConfig
from slime_rl.data import PromptDataset
from slime_rl.data.vl_counting import COLOURS
from tests.conftest import _load_tool


def _regions(img: Image.Image, rgb: tuple[int, int, int]) -> int:
    w, h = img.size
    px = img.load()
    seen: set[tuple[int, int]] = set()
    n = 0
    for y in range(h):
        for x in range(w):
            if (x, y) in seen or px[x, y] != rgb:
                continue
            n += 1
            stack = [(x, y)]
            seen.add((x, y))
            while stack:
                cx, cy = stack.pop()
                for nx, ny in ((cx + 1, cy), (cx - 1, cy), (cx, cy + 1), (cx, cy - 1)):
                    if 0 <= nx < w and 0 <= ny < h and (nx, ny) not in seen and px[nx, ny] == rgb:
                        seen.add((nx, ny))
                        stack.append((nx, ny))
    return n


def test_rows_answer_the_true_count_and_load(tmp_path, tiny_qwen2_5_vl):
    tool = _load_tool("make_vl_counting_data")
    out = tool.make_data(tmp_path / "train.jsonl", n=24, seed=3)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 24 and (tmp_path / "train_images").is_dir()
    answers = set()
    for row in rows:
        colour = re.search(r"How many (\w+) shapes", row["problem"]).group(1)
        img = Image.open(tmp_path / row["images"][0]).convert("RGB")
        assert _regions(img, COLOURS[colour]) == int(row["answer"]), row
        answers.add(row["answer"])
    assert answers == {"1", "2", "3", "4"}

    ds = PromptDataset(DataConfig(str(out), "problem", "answer", True), AutoTokenizer.from_pretrained(tiny_qwen2_5_vl))
    assert len(ds) == 24 and all(r.image_grid_thw == [[1, 8, 8]] for r in ds.rows)  # 112 px = 8 patches of 14


def test_same_seed_same_bytes(tmp_path):
    tool = _load_tool("make_vl_counting_data")
    a = tool.make_data(tmp_path / "a" / "d.jsonl", n=5, seed=9)
    b = tool.make_data(tmp_path / "b" / "d.jsonl", n=5, seed=9)
    assert a.read_text() == b.read_text()
    for i in range(5):
        name = f"d_images/{i:05d}.png"
        assert (a.parent / name).read_bytes() == (b.parent / name).read_bytes()
