"""Convert a Megatron distributed checkpoint (torch_dist) to an HF folder.

    python tools/convert_megatron_to_hf.py --load CKPT --save OUT [--hf-config-dir HF]
    torchrun --nproc-per-node 4 tools/convert_megatron_to_hf.py --load CKPT --save OUT --tp 2 --pp 2

CKPT is a checkpoint root (its latest complete iter_* is taken) or one iter_* folder, written by
the trainer or by tools/convert_hf_to_megatron.py, at any TP/PP: the model is built here at this
run's TP x PP (default TP: the number of processes / PP) and dist_checkpointing reshards on load.
Every stage gathers its tensors over TP; global rank 0 receives the later stages' and writes
(slime_rl.trainer.hf_export, the code --save-hf uses). OUT is written atomically (OUT.tmp, renamed).

The architecture comes from an HF config: --hf-config-dir, else the copy saved in the checkpoint
(<iter>/hf/). OUT gets config.json, model.safetensors (or model-0000i-of-0000N.safetensors +
model.safetensors.index.json above --max-shard-size), and the tokenizer / generation config files
of that folder. Vocab padding is removed. The tensors come from the trainer's own
`hf_io.iter_hf_weights` (the registry's maps), so export and weight sync cannot disagree. Tensors the trainer does
not hold (Qwen3.5's `mtp.*`: `Family.hf_passthrough`; its vision tower only where config.json has no vision_config)
are copied unchanged from
that folder's safetensors, so for such a family --hf-config-dir must be the original HF folder with its weights
(refused in one sentence otherwise). Qwen3.5-MoE's routed experts are written as its published checkpoints hold them,
each layer's fused into mlp.experts.gate_up_proj / down_proj (`Family.fused_experts`).

A LoRA run's checkpoint (--lora-rank) holds the frozen base and the adapters: --merge-lora writes the merged
model (W + B A alpha / r, as weight sync sends it) and the adapters as PEFT's folder in OUT/lora_adapter/.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from slime_rl.trainer.convert import load_arch, with_mtp
from slime_rl.trainer.launch_env import check_expert_parallel, launcher_env

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit, mult in _UNITS.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint root or iter_XXXXXXX folder")
    p.add_argument("--save", "--out", dest="save", required=True, help="output HF folder")
    p.add_argument("--hf-config-dir", default=None,
                   help="HF folder whose config/tokenizer to use (default: <checkpoint>/hf/)")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tensor_model_parallel_size", type=int,
                   default=None, help="default: the number of processes / PP")
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pipeline_model_parallel_size", type=int,
                   default=1, help="pipeline stages (must divide num_hidden_layers)")
    p.add_argument("--expert-model-parallel-size", "--ep", dest="expert_model_parallel_size", type=int, default=1,
                   help="mixture-of-experts checkpoints: expert-parallel ranks (must divide the experts)")
    p.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this size (e.g. 2GB)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: the checkpoint's dtype")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run's checkpoint: write the base with the adapters merged in, and the adapters as "
                        "PEFT's folder in OUT/lora_adapter/")
    return p.parse_args(argv)


def _hf_dir(args: argparse.Namespace, ckpt: Path) -> Path:
    from slime_rl.trainer.checkpoint_layout import HF_SUBDIR

    hf = Path(args.hf_config_dir) if args.hf_config_dir else ckpt / HF_SUBDIR
    if not (hf / "config.json").is_file():
        raise SystemExit(f"no HF config: {hf}/config.json is missing; pass --hf-config-dir (the original HF "
                         "folder of the model)")
    return hf


def _lora_spec(ckpt: Path, shapes: dict, merge: bool):  # noqa: ANN202 - a lora.LoRASpec or None
    """The adapters a LoRA run's checkpoint holds (their spec from its marker), None for a whole model; refuses
    a LoRA checkpoint without --merge-lora, and --merge-lora without adapters."""
    from slime_rl.trainer.checkpoint_layout import read_checkpoint_info
    from slime_rl.trainer.convert.lora_targets import CHECKPOINT_KEY, is_adapter_name, spec_from_record

    has = any(is_adapter_name(k) for k in shapes)
    if has and not merge:
        raise SystemExit(f"--load {ckpt}: a LoRA run's checkpoint (base + adapters); add --merge-lora to write the "
                         "merged model (and the adapters as PEFT's folder in OUT/lora_adapter/)")
    if not has:
        if merge:
            raise SystemExit(f"--merge-lora: {ckpt} holds no LoRA adapters (a whole model: drop the flag)")
        return None
    record = read_checkpoint_info(ckpt).extra.get(CHECKPOINT_KEY)
    if record is None:
        raise SystemExit(f"--load {ckpt}: LoRA adapters without their spec (r, lora_alpha) in the checkpoint's "
                         "marker; it was not written by slime_rl's trainer")
    return spec_from_record(record)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    # imported here: the checks below need no megatron
    from slime_rl.trainer.checkpoint_layout import is_megatron_checkpoint, resolve_checkpoint
    from slime_rl.trainer.launch_env import converter_layout

    if not is_megatron_checkpoint(args.load):
        raise SystemExit(f"--load {args.load}: not a Megatron checkpoint (an HF folder? use it directly)")
    ckpt = resolve_checkpoint(args.load)
    hf = _hf_dir(args, ckpt)
    rank, world, addr, port = launcher_env()
    ep = args.expert_model_parallel_size
    check_expert_parallel(load_arch(hf), ep)
    tp, pp = converter_layout(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, ep)
    arch = load_arch(hf, tp)  # unsupported model_type / config: fail before megatron is imported
    if arch.num_layers % pp != 0:
        raise SystemExit(f"--pipeline-model-parallel-size {pp}: num_hidden_layers={arch.num_layers} of "
                         f"{hf}/config.json is not divisible by it")

    import torch

    from slime_rl.trainer import checkpoint, hf_export
    from slime_rl.trainer.model import MoEOptions, build_gpt_model
    from slime_rl.trainer.parallel import init_parallel, teardown_parallel

    t0 = time.perf_counter()
    init_parallel(rank, world, addr, port, tp_size=tp, pp_size=pp, ep_size=ep)
    try:
        shapes = checkpoint.checkpoint_model_shapes(ckpt)
        emb = shapes.get("embedding.word_embeddings.weight")
        if emb is None:
            raise SystemExit(f"{ckpt}: no embedding.word_embeddings.weight in the checkpoint (not a GPT model?)")
        # the checkpoint's vocab padding, whatever TP it was saved at; it must split over this TP
        if emb[0] < arch.vocab_size or emb[0] % tp != 0:
            raise SystemExit(f"{ckpt}: padded vocab {emb[0]} vs {hf}/config.json vocab_size {arch.vocab_size} "
                             f"at TP={tp}: the config does not belong to this checkpoint, or choose a TP "
                             f"that divides {emb[0]}")
        arch = dataclasses.replace(arch, padded_vocab_size=emb[0])
        # the multi-token-prediction layers the checkpoint holds (a run under --mtp-num-layers saved them)
        mtp = len({k.split(".")[2] for k in shapes if k.startswith("mtp.layers.")})
        try:
            arch = with_mtp(arch, mtp, where=f"{hf}/config.json")
        except ValueError as e:
            raise SystemExit(f"{ckpt}: its {mtp} multi-token-prediction layer(s): {e}") from e
        ckpt_bf16 = checkpoint.checkpoint_model_dtype(ckpt) == torch.bfloat16
        gpt = build_gpt_model(arch, bf16=ckpt_bf16, tp_size=tp, pp_size=pp,
                              moe=MoEOptions(expert_model_parallel_size=ep))
        spec = _lora_spec(ckpt, shapes, args.merge_lora)
        if spec is not None:  # the adapters on the model as the trainer put them, so the checkpoint loads whole
            from slime_rl.trainer import hf_io, lora
            from slime_rl.trainer.mcore import mpu

            lora.attach(gpt, arch, hf_io.rank_param_maps(arch), spec, 0,
                        (mpu.get_tensor_model_parallel_rank(), tp), False)
        # names the mismatched tensors (and both shapes) when the config does not match the weights
        checkpoint.load_checkpoint(ckpt, [gpt], load_rng=False)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype)
        out = hf_export.save_hf_folder(gpt, arch, args.save, hf, dtype=dtype,
                                       max_shard_bytes=parse_size(args.max_shard_size), progress=True)
        if spec is not None:
            hf_export.save_peft_adapter(gpt, spec, Path(out) / "lora_adapter", hf)
        if rank == 0:
            print(f"wrote {out}: {hf_export.hf_tensor_count(arch)} tensors, {arch.model_type}, from {ckpt} "
                  f"at TP={tp} PP={pp} EP={ep} in {time.perf_counter() - t0:.1f} s")
    finally:
        teardown_parallel()
    return out


if __name__ == "__main__":
    from slime_rl.trainer.launch_env import relaunch_per_shard

    _args = parse_args(sys.argv[1:])
    relaunch_per_shard(__file__, sys.argv[1:], _args.tensor_model_parallel_size, _args.pipeline_model_parallel_size,
                       _args.expert_model_parallel_size)
    main()
