"""The embedded engine on a tiny Qwen2.5-VL: `image_data` in /generate, mRoPE positions, log-probs.

The reference is a float64 copy of the checkpoint run through transformers' own path in one
forward over prompt + output: pixel_values and image_grid_thw from transformers' image processor on
the original image files, positions computed by the model itself (no position_ids passed). The
engine instead prefills left-padded batches with positions from get_rope_index and decodes one
token at a time from a KV cache with scalar positions shifted by the rope delta; the two agree only
if the image tokens, their embeddings and every position match.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from engine_testlib import start_server
from PIL import Image
from vl_testlib import reference, write_pictures

from slime_rl.config import DataConfig
from slime_rl.data import PromptDataset, write_records
from slime_rl.data.images import IMAGE_PAD, VISION_START
from slime_rl.engines.payloads import image_data_of, one_pad_per_image

ATOL = 1e-5


@pytest.fixture(scope="module")
def vl_server(tiny_qwen2_5_vl) -> Iterator:
    s = start_server(tiny_qwen2_5_vl, random_seed=7, max_running_requests=8, enable_deterministic_inference=True)
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def vl_http(vl_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vl_server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def vl64(tiny_qwen2_5_vl):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_5_vl, dtype=torch.float64).eval()
    # the reference resizes the original images as the data side does (PIL); with torchvision installed
    # AutoImageProcessor would pick its torchvision backend, whose resize differs from PIL's by ~1e-3
    # in pixels (the engine gets the data side's images, already at their final size)
    return model, AutoImageProcessor.from_pretrained(tiny_qwen2_5_vl, backend="pil")


@pytest.fixture(scope="module")
def rows(tiny_qwen2_5_vl, tmp_path_factory):
    """Three prompt rows made by the data side: one image, two images of other sizes, no image."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("vl_rows")
    write_pictures(d)
    data = [{"problem": "<image>How many red shapes are in the picture?", "answer": "1", "images": ["a.png"]},
            {"problem": "<image>How many <image>blue shapes?", "answer": "2", "images": ["b.png", "c.png"]},
            {"problem": "How many green shapes are in the picture?", "answer": "0"}]
    spec = str(write_records(data, d / "data.jsonl"))
    ds = PromptDataset(DataConfig(spec, "problem", "answer", True),
                       AutoTokenizer.from_pretrained(tiny_qwen2_5_vl))
    originals = [[Image.open(d / p).convert("RGB") for p in row.get("images", [])] for row in data]
    return ds.rows, originals


@pytest.fixture(scope="module")
def wire(tiny_qwen2_5_vl):
    """A row's prompt ids as SGLang takes them with image_data: one <|image_pad|> per image."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_5_vl)
    ids = [tok.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VISION_START)]
    return lambda row: one_pad_per_image(row.prompt_ids, len(row.prompt_ids), len(row.images), *ids)


def _check(out: dict, vl64, prompt: list[int], images: list) -> None:
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    assert len(out["output_ids"]) == 12
    want = reference(vl64, prompt, out["output_ids"], images)
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()


SP = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}


def test_single_request_logprobs_match_float64_reference(vl_http, vl64, rows, wire):
    rows_, originals = rows
    row = rows_[0]
    r = vl_http.post("/generate", json={"input_ids": wire(row), "image_data": image_data_of(row.images),
                                        "sampling_params": SP, "return_logprob": True})
    assert r.status_code == 200, r.text
    _check(r.json(), vl64, row.prompt_ids, originals[0])


def test_input_logprobs_over_the_image_prompt(vl_http, vl64, rows, wire):
    rows_, originals = rows
    row = rows_[1]
    r = vl_http.post("/generate", json={"input_ids": wire(row), "image_data": image_data_of(row.images),
                                        "sampling_params": dict(SP, max_new_tokens=1), "return_logprob": True,
                                        "logprob_start_len": 0})
    entries = r.json()["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and [e[1] for e in entries] == row.prompt_ids
    got = torch.tensor([e[0] for e in entries[1:]], dtype=torch.float64)
    want = reference(vl64, row.prompt_ids, [], originals[1], first=1)
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()


def test_batch_of_image_and_text_prompts(vl_http, vl64, rows, wire):
    """Rows of different lengths share one left-padded prefill and one decode batch; the text-only row
    uses the same 3-D position tensor (all three components equal)."""
    rows_, originals = rows
    body = {"input_ids": [wire(r) for r in rows_], "image_data": [image_data_of(r.images) or [] for r in rows_],
            "sampling_params": SP, "return_logprob": True}
    r = vl_http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    for out, row, imgs in zip(r.json(), rows_, originals, strict=True):
        _check(out, vl64, row.prompt_ids, imgs)


def test_one_pad_per_image_is_expanded_and_the_expanded_form_refused(vl_server, vl_http, vl64, rows, wire):
    """As SGLang (the HF processor expands each pad): one <|image_pad|> per image is expanded to the
    image's grid, the same prompt the data side built; N pads for one image are refused."""
    row = rows[0][1]
    sent = wire(row)
    assert len(sent) < len(row.prompt_ids)
    out = vl_http.post("/generate", json={"input_ids": sent, "image_data": image_data_of(row.images),
                                          "sampling_params": SP, "return_logprob": True}).json()
    assert out["meta_info"]["prompt_tokens"] == len(row.prompt_ids)
    _check(out, vl64, row.prompt_ids, rows[1][1])
    r = vl_http.post("/generate", json={"input_ids": row.prompt_ids, "image_data": image_data_of(row.images),
                                        "sampling_params": SP})
    pads = row.prompt_ids.count(vl_server.model.config.image_token_id)
    assert pads > 2
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].endswith(f"Found total {pads} <|image_pad|> tokens and 2 images."), r.text


def test_image_forms_file_path_and_base64(vl_http, rows, wire, tmp_path):
    row = rows[0][0]
    path = tmp_path / "img.png"
    path.write_bytes(base64.b64decode(row.images[0].split(",", 1)[1]))
    sp = dict(SP, sampling_seed=5)
    url = image_data_of(row.images)[0]
    forms = [url, str(path), "file://" + str(path), url.split(",", 1)[1], {"url": url}]
    outs = [vl_http.post("/generate", json={"input_ids": wire(row), "image_data": form, "sampling_params": sp})
            for form in forms]
    assert all(o.status_code == 200 for o in outs), [o.text for o in outs]
    assert len({tuple(o.json()["output_ids"]) for o in outs}) == 1


@pytest.mark.parametrize("image_data,match", [
    (None, "0 image"),
    (["https://example.com/a.png"], "not fetched"),
    (["data:image/png;base64,AAAA"], "not a readable image"),
])
def test_bad_image_requests_are_400(vl_http, rows, wire, image_data, match):
    row = rows[0][0]
    r = vl_http.post("/generate", json={"input_ids": wire(row), "image_data": image_data, "sampling_params": SP})
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text


def test_wrong_pad_count_is_400(vl_server, vl_http, rows, wire):
    row = rows[0][0]
    pad, start = vl_server.model.config.image_token_id, vl_server.model.config.vision_start_token_id
    sent = wire(row)
    # a pad the prompt holds beyond the image's own one: the HF processor counts every pad
    r = vl_http.post("/generate", json={"input_ids": sent + [pad], "image_data": image_data_of(row.images),
                                        "sampling_params": SP})
    assert r.status_code == 400, r.text
    assert "Found total 2 <|image_pad|> tokens and 1 images." in r.json()["error"]["message"]
    k = sent.index(pad)
    assert sent[k - 1] == start
    r = vl_http.post("/generate", json={"input_ids": sent[:k - 1] + sent[k:], "image_data": image_data_of(row.images),
                                        "sampling_params": SP})
    assert r.status_code == 400 and "outside an image" in r.json()["error"]["message"], r.text


def test_text_model_refuses_image_data(tiny_qwen2):
    s = start_server(tiny_qwen2)
    try:
        r = httpx.post(s.url + "/generate", json={"input_ids": [1, 2, 3], "image_data": ["x.png"]}, timeout=60)
        assert r.status_code == 400 and "no vision tower" in r.json()["error"]["message"]
    finally:
        s.shutdown()


def test_model_info_and_checkpoint_names(vl_server, tiny_qwen2_5_vl):
    from safetensors import safe_open

    assert vl_server.model_info()["has_image_understanding"] is True
    with safe_open(str(Path(tiny_qwen2_5_vl) / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        # every checkpoint name (vision tower included) addresses the engine's tensor with that value
        for name in names:
            assert torch.equal(vl_server.weights.params[name].detach(), f.get_tensor(name)), name
    assert any(n.startswith("visual.") for n in names)


def test_rollout_sends_image_data(vl_server, vl64, rows):
    """The rollout path end to end: PromptDataset rows -> generate_groups -> the engine, whose
    log-probs match the reference only if the client sent each sample's images."""
    import asyncio

    from slime_rl.config import RolloutConfig
    from slime_rl.engines.client import AsyncEngineClient
    from slime_rl.rollout.generate import generate_groups

    rows_, originals = rows
    cfg = RolloutConfig(n_samples_per_prompt=2, max_response_len=6)

    async def main():
        client = AsyncEngineClient(vl_server.url, timeout=120)
        try:
            return await generate_groups([client], rows_, cfg, lambda s: 0.0, vl_server.tokenizer, progress=False)
        finally:
            await client.aclose()

    groups = asyncio.run(main())
    for group, row, imgs in zip(groups, rows_, originals, strict=True):
        for s in group:
            assert s.images == row.images and s.image_grid_thw == row.image_grid_thw
            want = reference(vl64, s.prompt_ids, s.response_ids, imgs)
            assert torch.allclose(torch.tensor(s.rollout_logprobs, dtype=torch.float64), want, atol=ATOL, rtol=0)


def test_retract_reprefills_images_and_positions(vl_server, vl_http, vl64, rows, wire):
    """pause(retract) drops the KV cache; the request is prefilled again from prompt + output so far
    (images again, 3-D positions from get_rope_index, a sampled <|image_pad|> in the output staying
    text) and must continue exactly as without the retraction."""
    import threading
    import time

    row, imgs = rows[0][0], rows[1][0]
    body = {"input_ids": wire(row), "image_data": image_data_of(row.images), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 100, "ignore_eos": True, "sampling_seed": 6}}
    plain = vl_http.post("/generate", json=body).json()
    pad = vl_server.model.config.image_token_id
    assert plain["output_ids"].index(pad) == 7  # seed 6 samples a pad early: retracted after it
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", vl_http.post("/generate", json=body)))
    before = vl_server.engine.load()["decode_forwards"]
    t.start()
    deadline = time.monotonic() + 60
    while vl_server.engine.load()["decode_forwards"] < before + 10:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert vl_http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    assert vl_http.post("/continue_generation", json={}).status_code == 200
    t.join()
    out = box["r"].json()
    assert out["meta_info"]["num_retractions"] == 1
    assert out["output_ids"] == plain["output_ids"]
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    assert torch.allclose(got, reference(vl64, row.prompt_ids, out["output_ids"], imgs), atol=ATOL, rtol=0)
