"""Qwen2.5-VL requests as SGLang 0.5.23 processes them, with the project's real payloads.

SGLang decodes a request's `input_ids` to text (BaseMultimodalProcessor.load_mm_data) and hands
text + images to the HF processor through its own `process_mm_data`; the processor expands each
<|image_pad|> into grid_t*grid_h*grid_w/merge^2 pads and refuses a text whose pad count is not the
image count. Driven here: SGLang's `QwenVLImageProcessor.process_mm_data` (on an object built with
`object.__new__` and the attributes it reads) over transformers' `Qwen2_5_VLProcessor` built from
the tiny checkpoint, against what the client sends (`one_pad_per_image`), what the trainer holds
(the dataset's expanded prompt ids) and what the built-in engine does (`VisionInputs.prepare`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from slime_rl.config import DataConfig
from slime_rl.data import PromptDataset, write_records
from slime_rl.data.images import IMAGE_PAD, VISION_START, decode_image, image_bytes, load_image_processor
from slime_rl.engines.embedded.sampling import RequestError
from slime_rl.engines.embedded.vision import VisionInputs
from slime_rl.engines.payloads import image_data_of, one_pad_per_image

qwen_vl = pytest.importorskip("sglang.srt.multimodal.processors.qwen_vl",
                              reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


@pytest.fixture(scope="module")
def setup(tiny_qwen2_5_vl, tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    d = tmp_path_factory.mktemp("vl_contract")
    spec = importlib.util.spec_from_file_location("vl_testlib_contract",
                                                  Path(__file__).parents[1] / "engines" / "vl_testlib.py")
    vl_testlib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vl_testlib)
    vl_testlib.write_pictures(d)
    data = [{"problem": "<image>How many red shapes are in the picture?", "answer": "1", "images": ["a.png"]},
            {"problem": "<image>How many <image>blue shapes?", "answer": "2", "images": ["b.png", "c.png"]}]
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_5_vl)
    rows = PromptDataset(DataConfig(str(write_records(data, d / "data.jsonl")), "problem", "answer", True), tok).rows
    image_proc = load_image_processor(tiny_qwen2_5_vl)
    # the checkpoint has no video processor; the HF processor insists on one (unused here)
    hf = Qwen2_5_VLProcessor(image_processor=image_proc, tokenizer=tok, video_processor=Qwen2VLVideoProcessor())
    sgl = object.__new__(qwen_vl.QwenVLImageProcessor)
    for name, value in {"_processor": hf, "_tokenizer": tok, "image_config": None, "video_config": None,
                        "audio_config": None, "disable_fast_image_processor": True,
                        "video_preprocessing_device": None, "_tokenizer_auto_adds_specials": False,
                        "mm_feature_transport": "default", "precompute_hash_before_cpu_transfer": False,
                        "retry_on_cpu_after_gpu_oom": False, "FEATURE_NAMES": ["pixel_values"]}.items():
        setattr(sgl, name, value)
    engine = VisionInputs(AutoConfig.from_pretrained(tiny_qwen2_5_vl), image_proc, tok)
    ids = (tok.convert_tokens_to_ids(IMAGE_PAD), tok.convert_tokens_to_ids(VISION_START))
    return rows, tok, sgl, engine, ids


def _pictures(row) -> list:
    return [decode_image(image_bytes(ref, None)[0], f"image {i}") for i, ref in enumerate(row.images)]


def test_sglang_expands_what_the_client_sends_into_the_trainers_prompt(setup):
    rows, tok, sgl, engine, ids = setup
    for row in rows:
        sent = one_pad_per_image(row.prompt_ids, len(row.prompt_ids), len(row.images), *ids)
        assert sent.count(ids[0]) == len(row.images) < row.prompt_ids.count(ids[0])
        out = sgl.process_mm_data(input_text=tok.decode(sent), images=_pictures(row))
        assert out["input_ids"][0].tolist() == row.prompt_ids  # the engine's prompt is the trainer's
        assert out["image_grid_thw"].tolist() == row.image_grid_thw
        expanded, _, grids = engine.prepare(sent, image_data_of(row.images))
        assert expanded == row.prompt_ids and grids.tolist() == row.image_grid_thw


def test_expanded_pads_are_refused_by_sglang_and_the_built_in_engine_alike(setup):
    rows, tok, sgl, engine, ids = setup
    for row in rows:
        pads = row.prompt_ids.count(ids[0])
        with pytest.raises(ValueError) as hf_error:
            sgl.process_mm_data(input_text=tok.decode(row.prompt_ids), images=_pictures(row))
        assert f"Found total {pads} {IMAGE_PAD} tokens and {len(row.images)} images." in str(hf_error.value)
        with pytest.raises(RequestError) as ours:
            engine.prepare(list(row.prompt_ids), image_data_of(row.images))
        assert str(ours.value) == str(hf_error.value)
