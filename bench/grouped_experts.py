"""--moe-grouped-gemm against megatron's SequentialMLP, side by side on one device: the same local experts (the
same parameters), the same tokens sorted by expert; forward + backward of each, their time and their difference.

    python bench/grouped_experts.py [--experts 64] [--hidden 2048] [--moe-ffn 768] [--tokens 16384] [--topk 8]
    python bench/grouped_experts.py --tiny      # CPU, fp32, small: checks that it runs

The tokens are `--tokens` x `--topk` routed rows spread over the experts by a fixed multinomial draw (uneven, as
a router's), each with a routing probability. Prints the time ratio sequential / grouped and the largest
differences (outputs and each weight's gradient, relative to the largest magnitude); raw JSON to --out
(default bench/results/grouped_experts_<device>_<date>.json). One process, world size 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from slime_rl.trainer.experts import GroupedExperts
    from slime_rl.trainer.mcore import (
        ProcessGroupCollection,
        SequentialMLP,
        TransformerConfig,
        get_gpt_layer_local_spec,
    )

    config = TransformerConfig(num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.moe_ffn,
                               num_attention_heads=8, num_moe_experts=args.experts, moe_ffn_hidden_size=args.moe_ffn,
                               moe_router_topk=args.topk, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=False,
                               bias_activation_fusion=False, gradient_accumulation_fusion=False,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               use_cpu_initialization=device.type == "cpu", perform_initialization=False,
                               moe_token_dispatcher_type="alltoall")
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False, normalization="RMSNorm")
    mlp_submodules = spec.submodules.mlp.keywords["submodules"].experts.keywords["submodules"]
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    seq = SequentialMLP(args.experts, config, mlp_submodules, pg_collection=pgs).to(device)
    grouped = GroupedExperts(args.experts, config, mlp_submodules, pg_collection=pgs).to(device)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
        grouped.load_state_dict(seq.state_dict())
    return seq, grouped


def inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    rows = args.tokens * args.topk
    weights = torch.rand(args.experts, generator=gen) + 0.2  # uneven expert loads, as a router's
    assign = torch.multinomial(weights, rows, replacement=True, generator=gen)
    counts = torch.bincount(assign, minlength=args.experts)
    x = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
    probs = torch.rand(rows, generator=gen).to(device, torch.float32)
    grad = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
    return x, counts, probs, grad


def run(module, x, counts, probs, grad):
    module.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    out, _ = module(xi, counts, probs)
    out.backward(grad)
    return out.detach(), xi.grad.detach(), {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def timed(module, x, counts, probs, grad, repeats: int, device: torch.device) -> float:
    for _ in range(2):
        run(module, x, counts, probs, grad)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        run(module, x, counts, probs, grad)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--moe-ffn", type=int, default=768)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.tiny:
        args.experts, args.hidden, args.moe_ffn, args.tokens, args.topk, args.repeats = 8, 64, 32, 64, 2, 2
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    import socket

    from slime_rl.trainer.parallel import init_parallel

    with socket.socket() as sock:  # a free port for the one-process group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    info = init_parallel(0, 1, "127.0.0.1", port)
    device = info.device
    dtype = torch.bfloat16 if device.type == "cuda" and not args.tiny else torch.float32
    seq, grouped = build(args, device, dtype)
    x, counts, probs, grad = inputs(args, device, dtype)
    out_s, dx_s, g_s = run(seq, x, counts, probs, grad)
    out_g, dx_g, g_g = run(grouped, x, counts, probs, grad)
    diffs = {"out": rel(out_g, out_s), "dx": rel(dx_g, dx_s),
             "grad_max": max(rel(g_g[n], g_s[n]) for n in g_s)}
    t_seq = timed(seq, x, counts, probs, grad, args.repeats, device)
    t_grp = timed(grouped, x, counts, probs, grad, args.repeats, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "dtype": str(dtype), "experts": args.experts, "hidden": args.hidden,
              "moe_ffn": args.moe_ffn, "rows": int(x.shape[0]), "tokens_per_expert": counts.tolist(),
              "sequential_fwd_bwd_s": t_seq, "grouped_fwd_bwd_s": t_grp, "speedup": t_seq / t_grp,
              "relative_diff": diffs, "torch": torch.__version__}
    print(json.dumps({k: v for k, v in result.items() if k != "tokens_per_expert"}), flush=True)
    print(f"grouped experts on {name} ({dtype}): fwd+bwd {t_grp * 1e3:.2f} ms vs SequentialMLP {t_seq * 1e3:.2f} ms: "
          f"{t_seq / t_grp:.2f}x; max relative difference out {diffs['out']:.2e}, dx {diffs['dx']:.2e}, "
          f"weight grads {diffs['grad_max']:.2e}", flush=True)
    out = Path(args.out) if args.out else (ROOT / "bench" / "results" / f"grouped_experts_"
                                           f"{name.replace(' ', '_')}_{datetime.date.today()}.json")
    if not args.tiny or args.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
