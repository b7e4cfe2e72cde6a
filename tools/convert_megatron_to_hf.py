"""Convert a Megatron distributed checkpoint (torch_dist) to an HF folder.

    python tools/convert_megatron_to_hf.py --load CKPT --save OUT [--hf-config-dir HF]
    torchrun --nproc-per-node 2 tools/convert_megatron_to_hf.py --load CKPT --save OUT

CKPT is a checkpoint root (its latest complete iter_* is taken) or one iter_* folder, written by
the trainer or by tools/convert_hf_to_megatron.py, at any TP: the model is built here at this
run's TP (default: the number of processes) and dist_checkpointing reshards on load.

The architecture comes from an HF config: --hf-config-dir, else the copy saved in the checkpoint
(<iter>/hf/). OUT gets config.json, model.safetensors (or model-0000i-of-0000N.safetensors +
model.safetensors.index.json above --max-shard-size), and the tokenizer / generation config files
of that folder. Vocab padding is removed. The tensors come from the trainer's own
`hf_io.iter_hf_weights` (the registry's maps), so export and weight sync cannot disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from slime_rl.trainer.convert import load_arch
from slime_rl.trainer.parallel import converter_tp_size, launcher_env

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
                   default=None, help="default: the number of processes")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this size (e.g. 2GB)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: the checkpoint's dtype")
    return p.parse_args(argv)


def _hf_dir(args: argparse.Namespace, ckpt: Path) -> Path:
    from slime_rl.trainer.checkpoint import HF_SUBDIR

    hf = Path(args.hf_config_dir) if args.hf_config_dir else ckpt / HF_SUBDIR
    if not (hf / "config.json").is_file():
        raise SystemExit(f"no HF config: {hf}/config.json is missing; pass --hf-config-dir (the original HF "
                         "folder of the model)")
    return hf


class ShardWriter:
    """Streams (name, tensor) into safetensors files of at most `max_bytes` (a bigger tensor gets a
    file of its own), then names them as HF does; one file -> model.safetensors without index."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.files: list[tuple[Path, list[str]]] = []
        self.pending: dict = {}
        self.pending_bytes = self.total_bytes = 0

    def add(self, name: str, tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        # own, contiguous CPU memory: safetensors refuses shared or strided storage
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f"_part{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self.pending:
            self._flush()
        n = len(self.files)
        if n == 1:
            final = self.out / "model.safetensors"
            self.files[0][0].rename(final)
            return [final]
        weight_map, finals = {}, []
        for i, (path, names) in enumerate(self.files):
            final = self.out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(final)
            finals.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return finals


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    # imported here: the checks below need no megatron
    from slime_rl.trainer.checkpoint import copy_hf_metadata, is_megatron_checkpoint, resolve_checkpoint

    if not is_megatron_checkpoint(args.load):
        raise SystemExit(f"--load {args.load}: not a Megatron checkpoint (an HF folder? use it directly)")
    ckpt = resolve_checkpoint(args.load)
    hf = _hf_dir(args, ckpt)
    load_arch(hf)  # unsupported model_type / config: fail before megatron is imported
    rank, world, addr, port = launcher_env()
    tp = converter_tp_size(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)

    import torch
    from tqdm import tqdm

    from slime_rl.trainer import checkpoint, hf_io
    from slime_rl.trainer.model import build_gpt_model
    from slime_rl.trainer.parallel import init_parallel, teardown_parallel

    t0 = time.perf_counter()
    out = Path(args.save)
    init_parallel(rank, world, addr, port, tp_size=tp, pp_size=1)
    try:
        shapes = checkpoint.checkpoint_model_shapes(ckpt)
        emb = shapes.get("embedding.word_embeddings.weight")
        if emb is None:
            raise SystemExit(f"{ckpt}: no embedding.word_embeddings.weight in the checkpoint (not a GPT model?)")
        # the checkpoint's vocab padding, whatever TP it was saved at; it must split over this TP
        arch = load_arch(hf, tp)
        if emb[0] < arch.vocab_size or emb[0] % tp != 0:
            raise SystemExit(f"{ckpt}: padded vocab {emb[0]} vs {hf}/config.json vocab_size {arch.vocab_size} "
                             f"at TP={tp}: the config does not belong to this checkpoint, or choose a TP "
                             f"that divides {emb[0]}")
        arch = dataclasses.replace(arch, padded_vocab_size=emb[0])
        ckpt_bf16 = checkpoint.checkpoint_model_dtype(ckpt) == torch.bfloat16
        gpt = build_gpt_model(arch, bf16=ckpt_bf16, tp_size=tp)
        # names the mismatched tensors when the config does not match the weights
        checkpoint.load_checkpoint(ckpt, [gpt], load_rng=False)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype)
        meta = hf_io.hf_weight_metadata(gpt, arch)
        writer = ShardWriter(out, parse_size(args.max_shard_size)) if rank == 0 else None
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        # every rank runs the TP all-gathers of iter_hf_weights; rank 0 writes
        for name, tensor in tqdm(hf_io.iter_hf_weights(gpt, arch), total=len(meta), desc="megatron->hf",
                                 unit="tensor", disable=rank != 0, file=sys.stderr):
            if writer is not None:
                writer.add(name, tensor if dtype is None else tensor.to(dtype))
        if writer is not None:
            files = writer.close()
            copy_hf_metadata(hf, out)
            config = json.loads((out / "config.json").read_text())
            out_dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype or gpt.config.params_dtype]
            for key in ("dtype", "torch_dtype"):  # transformers 5 writes dtype, 4 torch_dtype
                if key in config:
                    config[key] = out_dtype
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            print(f"wrote {out}: {len(meta)} tensors in {len(files)} file(s), {arch.model_type}, "
                  f"from {ckpt} at TP={tp} in {time.perf_counter() - t0:.1f} s")
    finally:
        teardown_parallel()
    return out


if __name__ == "__main__":
    main()
