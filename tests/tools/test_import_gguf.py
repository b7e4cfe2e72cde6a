"""tools/import_gguf.py on the real SmolLM2-135M-Instruct GGUF: the saved folder is the same model."""

from __future__ import annotations

import json

import pytest
import torch

PROMPT = "What is 12 + 30? Answer with the number only."


def test_config_is_smollm2_135m(smollm2_fp32):
    # the figures of issue #18 / FACTS.md, read from the model card, not from the tool
    cfg = json.loads((smollm2_fp32 / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == 1e5
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5, rel=1e-6)
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"


def test_saved_folder_gives_the_gguf_models_logits(smollm2_gguf_loaded, smollm2_fp32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the reference is transformers' own GGUF loader (its model, fp32), not the tool's copy and save
    ref = smollm2_gguf_loaded[0].eval()
    assert getattr(ref.config, "quantization_config", None) is not None  # the import left it as read
    saved = AutoModelForCausalLM.from_pretrained(str(smollm2_fp32), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(str(smollm2_fp32))(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, b = ref(ids).logits, saved(ids).logits
    assert torch.equal(a, b)
    assert saved.lm_head.weight.data_ptr() == saved.model.embed_tokens.weight.data_ptr()  # still tied


def test_tokenizer_and_chat_template_round_trip(smollm2_gguf_loaded, smollm2_fp32):
    from transformers import AutoTokenizer

    ref = smollm2_gguf_loaded[1]  # transformers' tokenizer read from the GGUF
    tok = AutoTokenizer.from_pretrained(str(smollm2_fp32))
    text = "Héllo, wörld! 123 + 456 = 579\n  tabs\tand <|im_start|> specials"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    chat = [{"role": "user", "content": PROMPT}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n") and PROMPT in rendered
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"  # generation stops at the turn end
