"""Vision-language prompt rows (Qwen2.5-VL): image forms, vision-token expansion, resizing, errors.

Expected grids and pixels come from transformers' own Qwen2.5-VL image processor run on the
original image files, not from slime_rl's resize code.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from slime_rl.config import DataConfig
from slime_rl.data import DataError, PromptDataset, Sample, write_records
from slime_rl.data.images import pixel_inputs


@pytest.fixture(scope="module")
def vl(tiny_qwen2_5_vl):
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_5_vl)
    return tok, AutoImageProcessor.from_pretrained(tiny_qwen2_5_vl), AutoConfig.from_pretrained(tiny_qwen2_5_vl)


def _png(path: Path, size=(96, 128), colour=(200, 10, 10)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, colour)
    img.putpixel((3, 5), (0, 255, 0))  # not uniform, so a wrong crop or order changes the pixels
    img.save(path)
    return path


def _write(tmp_path: Path, rows: list[dict], name: str = "data.jsonl") -> str:
    return str(write_records(rows, tmp_path / name))


def _dataset(spec: str, tok, chat: bool = True, **kw) -> PromptDataset:
    return PromptDataset(DataConfig(spec, "problem", "answer", chat, **kw), tok)


def test_happy_path_pad_count_grid_and_pixels_match_hf_processor(tmp_path, vl):
    tok, proc, config = vl
    _png(tmp_path / "img" / "a.png", (96, 128))
    _png(tmp_path / "img" / "b.png", (200, 60), (10, 10, 200))
    spec = _write(tmp_path, [{"problem": "<image>left <image>right: how many?", "answer": "2",
                              "images": ["img/a.png", "img/b.png"]},
                             {"problem": "no picture here", "answer": "0"}])
    ds = _dataset(spec, tok)
    row, text_row = ds.rows
    originals = [Image.open(tmp_path / "img" / n).convert("RGB") for n in ("a.png", "b.png")]
    ref = proc(images=originals, return_tensors="pt")
    assert row.image_grid_thw == ref["image_grid_thw"].tolist()
    merge = config.vision_config.spatial_merge_size
    ids = torch.tensor(row.prompt_ids)
    per_image = [t * h * w // merge**2 for t, h, w in row.image_grid_thw]
    assert int((ids == config.image_token_id).sum()) == sum(per_image)
    # each image is one contiguous run of pads between vision_start and vision_end, in row order
    starts = (ids == config.vision_start_token_id).nonzero().flatten().tolist()
    ends = (ids == config.vision_end_token_id).nonzero().flatten().tolist()
    assert [e - s - 1 for s, e in zip(starts, ends, strict=True)] == per_image
    assert all(int((ids[s + 1:e] == config.image_token_id).sum()) == e - s - 1
               for s, e in zip(starts, ends, strict=True))
    # the kept PNGs give the HF processor's pixel_values of the original files, bit for bit
    mine = pixel_inputs(proc, row.images)
    assert torch.equal(mine["pixel_values"], ref["pixel_values"])
    assert "images" not in row.metadata
    assert row.prompt.count("<|image_pad|>") == 2  # the text keeps one pad per image (readable logs)
    # a sample with images survives the JSON of the checkpointed rollout state
    sample = Sample(index=0, group_index=0, prompt=row.prompt, prompt_ids=row.prompt_ids, images=row.images,
                    image_grid_thw=row.image_grid_thw)
    assert Sample(**json.loads(json.dumps(dataclasses.asdict(sample)))) == sample
    assert text_row.images == [] and config.image_token_id not in text_row.prompt_ids


@pytest.mark.parametrize("fmt", ["parquet_binary", "hf_dict", "data_url", "absolute_path"])
def test_embedded_image_forms_give_the_same_row(tmp_path, vl, fmt):
    tok, _, _ = vl
    path = _png(tmp_path / "pics" / "x.png", (150, 90))
    raw = path.read_bytes()
    ref = _dataset(_write(tmp_path, [{"problem": "<image>count", "answer": "1", "images": ["pics/x.png"]}],
                          "ref.jsonl"), tok).rows[0]
    value = {"parquet_binary": raw, "hf_dict": {"bytes": raw, "path": None},
             "data_url": "data:image/png;base64," + base64.b64encode(raw).decode(),
             "absolute_path": str(path)}[fmt]
    name = "data.parquet" if fmt in ("parquet_binary", "hf_dict") else "data.jsonl"
    row = _dataset(_write(tmp_path, [{"problem": "<image>count", "answer": "1", "images": [value]}], name),
                   tok).rows[0]
    assert row.prompt_ids == ref.prompt_ids and row.images == ref.images
    assert row.image_grid_thw == ref.image_grid_thw


def test_min_max_pixels_bound_the_grid(tmp_path, vl):
    tok, proc, _ = vl
    _png(tmp_path / "big.png", (640, 480))
    _png(tmp_path / "small.png", (30, 20))
    spec = _write(tmp_path, [{"problem": "<image>a", "answer": "1", "images": ["big.png"]},
                             {"problem": "<image>b", "answer": "1", "images": ["small.png"]}])
    lo, hi = 8 * 28 * 28, 20 * 28 * 28
    ds = _dataset(spec, tok, min_pixels=lo, max_pixels=hi)
    for row, name in zip(ds.rows, ("big.png", "small.png"), strict=True):
        _, h, w = row.image_grid_thw[0]
        assert lo <= h * w * 14 * 14 <= hi
        from transformers import Qwen2VLImageProcessorPil

        ref = Qwen2VLImageProcessorPil(min_pixels=lo, max_pixels=hi)(
            images=[Image.open(tmp_path / name).convert("RGB")], return_tensors="pt")
        assert row.image_grid_thw == ref["image_grid_thw"].tolist()
        # with torchvision installed (SGLang needs it) transformers picks the torchvision backend, which
        # rescales and normalizes in one fused step: fp32 rounding differs from PIL's by ~1e-7, nothing more
        torch.testing.assert_close(pixel_inputs(proc, row.images)["pixel_values"], ref["pixel_values"],
                                   rtol=0, atol=1e-6)


def test_without_chat_template_placeholder_becomes_vision_tokens(tmp_path, vl):
    tok, _, config = vl
    _png(tmp_path / "a.png")
    row = _dataset(_write(tmp_path, [{"problem": "<image>count", "answer": "1", "images": "a.png"}]), tok,
                   chat=False).rows[0]
    assert row.prompt_ids[0] == config.vision_start_token_id
    assert row.prompt.startswith("<|vision_start|><|image_pad|>") and "<|im_start|>" not in row.prompt


def _error(tmp_path, tok, rows, name="data.jsonl") -> str:
    with pytest.raises(DataError) as exc:
        _dataset(_write(tmp_path, rows, name), tok)
    return str(exc.value)


def test_missing_image_names_file_and_row(tmp_path, vl):
    _png(tmp_path / "ok.png")
    msg = _error(tmp_path, vl[0], [{"problem": "<image>a", "answer": "1", "images": ["ok.png"]},
                                   {"problem": "<image>b", "answer": "1", "images": ["nope/missing.png"]}])
    assert "line 2" in msg and str(tmp_path / "nope" / "missing.png") in msg and "does not exist" in msg
    assert "line 1" not in msg


def test_corrupt_image_names_file_and_row(tmp_path, vl):
    good = _png(tmp_path / "good.png").read_bytes()
    (tmp_path / "bad.png").write_bytes(good[: len(good) // 2])  # truncated PNG
    (tmp_path / "text.png").write_text("not an image")
    msg = _error(tmp_path, vl[0], [{"problem": "<image>a", "answer": "1", "images": ["good.png"]},
                                   {"problem": "<image>b", "answer": "1", "images": ["bad.png"]},
                                   {"problem": "<image>c", "answer": "1", "images": ["text.png"]}])
    assert "2 bad row(s)" in msg
    assert "line 2" in msg and "bad.png" in msg and "line 3" in msg and "text.png" in msg
    assert "not a readable image" in msg


@pytest.mark.parametrize("problem,images,n_tags,n_images", [
    ("<image><image>two tags", ["a.png"], 2, 1),
    ("<image>one tag", ["a.png", "a.png"], 1, 2),
    ("<image>no images", [], 1, 0),
    ("no tag", ["a.png"], 0, 1),
])
def test_tag_image_mismatch_names_row(tmp_path, vl, problem, images, n_tags, n_images):
    _png(tmp_path / "a.png")
    msg = _error(tmp_path, vl[0], [{"problem": "<image>fine", "answer": "1", "images": ["a.png"]},
                                   {"problem": problem, "answer": "1", "images": images}])
    assert f"line 2: the prompt has {n_tags} <image> placeholder(s) but the row has {n_images} image(s)" in msg


def test_url_refused_offline(tmp_path, vl):
    msg = _error(tmp_path, vl[0], [{"problem": "<image>a", "answer": "1", "images": ["https://example.com/x.png"]}])
    assert "line 1" in msg and "URLs are not fetched" in msg


def test_images_with_text_model_is_a_clear_error(tmp_path, tiny_qwen2):
    from transformers import AutoTokenizer

    _png(tmp_path / "a.png")
    with pytest.raises(DataError, match="no image processor"):
        _dataset(_write(tmp_path, [{"problem": "<image>a", "answer": "1", "images": ["a.png"]}]),
                 AutoTokenizer.from_pretrained(tiny_qwen2))


def test_image_key_flag_and_parquet_message_list(tmp_path, vl):
    tok, _, config = vl
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, format="PNG")
    rows = [{"q": json.dumps(None), "problem": [{"role": "user", "content": "<image>what?"}], "answer": "x",
             "pics": [{"bytes": buf.getvalue(), "path": "ignored.png"}]}]
    ds = PromptDataset(DataConfig(_write(tmp_path, rows, "m.parquet"), "problem", "answer", True, image_key="pics"),
                       tok)
    assert ds.rows[0].prompt_ids.count(config.image_token_id) == ds.rows[0].image_grid_thw[0][1] * \
        ds.rows[0].image_grid_thw[0][2] // 4
