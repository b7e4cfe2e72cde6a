"""Weight sync into a Qwen2.5-VL engine, vision tower included, under the HF checkpoint names.

This process is the trainer (rank 0); a standalone embedded engine on the tiny Qwen2.5-VL is rank 1.
Every tensor of the checkpoint (visual.*, model.layers.*, ...) gets a fresh random value over gloo;
the engine must then hold exactly those values and generate, from a prompt with an image, the
log-probs of a float64 model loaded with the same tensors.
"""

from __future__ import annotations

import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image
from vl_testlib import reference

from slime_rl.config.builtin_engine import ServerConfig
from slime_rl.data.images import IMAGE_PAD, VISION_START
from slime_rl.engines import dist_group
from slime_rl.engines.client import EngineClient
from slime_rl.engines.launch import embedded_command, wait_healthy
from slime_rl.engines.payloads import image_data_of, one_pad_per_image


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine(tiny_qwen2_5_vl, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("vl_engine") / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(embedded_command(ServerConfig(str(tiny_qwen2_5_vl), "127.0.0.1", port, random_seed=3,
                                                             num_threads=1)),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120, process=proc, log_path=log)
        yield EngineClient(f"http://127.0.0.1:{port}", timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_update_vision_and_language_weights_then_generate(engine, tiny_qwen2_5_vl, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from slime_rl.config import DataConfig
    from slime_rl.data import PromptDataset, write_records

    ckpt = load_file(str(Path(tiny_qwen2_5_vl) / "model.safetensors"))
    assert any(n.startswith("visual.") for n in ckpt) and any(n.startswith("model.layers.") for n in ckpt)
    gen = torch.Generator().manual_seed(0)
    new = [(n, 0.05 * torch.randn(t.shape, generator=gen)) for n, t in sorted(ckpt.items())]

    port = _free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.init_weights_update_group, "127.0.0.1", port, 1, 2, "vl", "gloo")
        pg = dist_group.init_custom_group("127.0.0.1", port, 0, 2, "vl", "gloo")
        assert joined.result()["success"] is True
        assert engine.open_weight_update_session() is True  # SGLang 0.5.23 refuses updates outside one
        fut = pool.submit(engine.update_weights_from_distributed, [n for n, _ in new], [t.dtype for _, t in new],
                          [list(t.shape) for _, t in new], group_name="vl", weight_version="step-1")
        for _, t in new:
            dist_group.broadcast(pg, t, src=0)
        assert fut.result()["success"] is True
        engine.close_weight_update_session()
    for name in ("visual.blocks.0.attn.qkv.weight", "visual.merger.mlp.2.bias", "model.layers.1.mlp.up_proj.weight"):
        got = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**6), dtype=torch.float32)
        assert torch.equal(got, dict(new)[name]), name

    Image.new("RGB", (84, 112), (200, 0, 0)).save(tmp_path / "a.png")
    spec = str(write_records([{"problem": "<image>How many red shapes?", "answer": "1", "images": ["a.png"]}],
                             tmp_path / "d.jsonl"))
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_5_vl)
    row = PromptDataset(DataConfig(spec, "problem", "answer", True), tok).rows[0]
    # SGLang's form: one <|image_pad|> per image (the engine expands it to row.prompt_ids)
    sent = one_pad_per_image(row.prompt_ids, len(row.prompt_ids), 1,
                             *(tok.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VISION_START)))
    res = engine.generate(sent, {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True},
                          image_data=image_data_of(row.images))
    assert res["meta_info"]["prompt_tokens"] == len(row.prompt_ids)
    assert res["meta_info"]["weight_version"] == "step-1"

    # the reference loads the same tensors through transformers' checkpoint-name mapping
    updated = tmp_path / "updated"
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_5_vl, dtype=torch.float32)
    model.save_pretrained(updated)
    from safetensors.torch import save_file
    save_file({n: t.contiguous() for n, t in new}, str(updated / "model.safetensors"))
    model64 = AutoModelForImageTextToText.from_pretrained(updated, dtype=torch.float64).eval()
    assert torch.equal(model64.model.visual.blocks[0].attn.qkv.weight.float(),
                       dict(new)["visual.blocks.0.attn.qkv.weight"])
    want = reference((model64, AutoImageProcessor.from_pretrained(tiny_qwen2_5_vl)), row.prompt_ids,
                     res["output_ids"], [Image.open(tmp_path / "a.png").convert("RGB")])
    got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert engine.destroy_weights_update_group("vl")["success"] is True
