"""Convert an HF checkpoint folder to a Megatron distributed checkpoint (torch_dist, model only).

    python tools/convert_hf_to_megatron.py --hf-checkpoint DIR --save OUT
    torchrun --nproc-per-node 4 tools/convert_hf_to_megatron.py --hf-checkpoint DIR --save OUT \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Why a converter at all: the trainer can start from the HF folder directly, but a torch_dist
checkpoint loads in parallel, at any TP/PP (dist_checkpointing reshards: its keys are global, with
global layer numbers), and is what Megatron-LM tools read. The TP x PP used here does not
constrain the layout of the run that loads it; it only decides how many processes share the work
(one per shard: TP x PP processes; each stage reads only its own layers from the safetensors).

Writes OUT/iter_0000000/ (+ latest_checkpointed_iteration.txt), with the HF config, tokenizer and
generation config copied into OUT/iter_0000000/hf/ for the reverse conversion. Model building, the
HF<->Megatron name maps and the checks (unsupported model_type, config vs weights) are the
trainer's own (slime_rl.trainer.model, .convert, .hf_io): nothing is duplicated here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from slime_rl.trainer.convert import load_arch
from slime_rl.trainer.hf_files import check_hf_weights
from slime_rl.trainer.launch_env import check_expert_parallel, launcher_env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-checkpoint", "--hf-dir", dest="hf_checkpoint", required=True,
                   help="HF folder: config.json + *.safetensors")
    p.add_argument("--save", "--out", dest="save", required=True, help="output checkpoint root")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tensor_model_parallel_size", type=int,
                   default=None, help="default: the number of processes / PP")
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pipeline_model_parallel_size", type=int,
                   default=1, help="pipeline stages (must divide num_hidden_layers)")
    p.add_argument("--expert-model-parallel-size", "--ep", dest="expert_model_parallel_size", type=int, default=1,
                   help="mixture-of-experts checkpoints: expert-parallel ranks (must divide the experts)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=1,
                   help="pad the vocab to a multiple of this x TP (the trainer's pad_vocab_multiple; "
                        "the run that loads the checkpoint must pad to the same size)")
    p.add_argument("--mtp-num-layers", type=int, default=None,
                   help="the checkpoint's multi-token-prediction layers to convert too (at most config.json's "
                        "num_nextn_predict_layers), as slime's converter takes them; the trainer's --mtp-num-layers "
                        "needs a checkpoint that holds them")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: bf16 if the safetensors are bf16, else fp32 (fp16 is upcast, losslessly)")
    return p.parse_args(argv)


def stored_dtype_is_bf16(hf_dir: str | Path) -> bool:
    from safetensors import safe_open

    from slime_rl.trainer.hf_files import safetensors_index

    where = safetensors_index(hf_dir)
    name, file = next(iter(where.items()))
    with safe_open(file, framework="pt") as f:
        return f.get_slice(name).get_dtype() == "BF16"


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    hf = Path(args.hf_checkpoint)
    rank, world, addr, port = launcher_env()
    from slime_rl.trainer.launch_env import converter_layout

    ep = args.expert_model_parallel_size
    check_expert_parallel(load_arch(hf), ep)
    tp, pp = converter_layout(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, ep)
    # fail on an unsupported model_type, a layout the config cannot split into, or weights of
    # another config, before paying for megatron and process groups
    arch = load_arch(hf, tp, args.make_vocab_size_divisible_by)
    if arch.num_layers % pp != 0:
        raise SystemExit(f"--pipeline-model-parallel-size {pp}: num_hidden_layers={arch.num_layers} of "
                         f"{hf}/config.json is not divisible by it")
    check_hf_weights(hf, arch)
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and stored_dtype_is_bf16(hf))

    from tqdm import tqdm

    from slime_rl.trainer import checkpoint, hf_io
    from slime_rl.trainer.model import MoEOptions, build_from_checkpoint
    from slime_rl.trainer.parallel import init_parallel, teardown_parallel

    t0 = time.perf_counter()
    init_parallel(rank, world, addr, port, tp_size=tp, pp_size=pp, ep_size=ep)
    try:
        with tqdm(total=3, desc="hf->megatron", unit="stage", disable=rank != 0, file=sys.stderr) as bar:
            arch, gpt = build_from_checkpoint(hf, bf16=bf16, tp_size=tp, pp_size=pp,
                                              moe=MoEOptions(expert_model_parallel_size=ep),
                                              pad_vocab_multiple=args.make_vocab_size_divisible_by,
                                              mtp_num_layers=args.mtp_num_layers)
            bar.update(1)
            # strict both ways: every parameter written, every registry tensor present, shapes checked
            hf_io.load_hf_weights(gpt, hf, arch)
            bar.update(1)
            extra = {"source_hf_checkpoint": str(hf.resolve()), "model_type": arch.model_type,
                     "padded_vocab_size": arch.padded_vocab_size, "vocab_size": arch.vocab_size,
                     "dtype": "bf16" if bf16 else "fp32", "converted_at_tp": tp, "converted_at_pp": pp,
                     "converted_at_ep": ep}
            out = checkpoint.save_checkpoint(args.save, 0, [gpt], None, None, extra, save_rng=False, hf_dir=hf)
            bar.update(1)
    finally:
        teardown_parallel()
    if rank == 0:
        print(f"wrote {out} ({arch.model_type}, TP={tp} PP={pp} EP={ep}, padded vocab {arch.padded_vocab_size}) "
              f"in {time.perf_counter() - t0:.1f} s")
    return out


if __name__ == "__main__":
    from slime_rl.trainer.launch_env import relaunch_per_shard

    _args = parse_args(sys.argv[1:])
    relaunch_per_shard(__file__, sys.argv[1:], _args.tensor_model_parallel_size, _args.pipeline_model_parallel_size,
                       _args.expert_model_parallel_size)
    main()
