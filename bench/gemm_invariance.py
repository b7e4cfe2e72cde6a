"""Is a row of a bf16 GEMM the same whatever the number of rows it is computed with? (#18's bf16 gap)

The engine's one-pass forward (prefill) equals the trainer's packed forward to 3.6e-6 in bf16, but
its one-token decode steps differ from both by 2e-2 in mean |Δ log p| (BENCHMARKS.md): a decode
GEMM has 1-512 rows, the trainer's tens of thousands, and cuBLAS picks another kernel (tile, split-K)
for another row count, which sums a row's products in another order; after the bf16 rounding of
the output a few elements differ by one unit, and 30 layers carry it to the log-probs.

This bench measures it directly on the GEMM shapes of SmolLM2-135M (the separate projections the
engine runs and the fused ones the trainer runs): for each shape and row count M, the first M rows
of one random bf16 input are multiplied alone and compared bit for bit with the same rows inside
the `--ref-rows` product. Per setting:

- `default`: torch's defaults;
- `no_reduced_reduction`: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction False;
- `cublaslt`: torch.backends.cuda.preferred_blas_library("cublaslt");
- `pad_to_ref`: the M rows padded with zeros to the reference's row count (an upper bound on what
  padding costs: if even this differs, no padding makes decode rows equal to the trainer's);
- `pad_256`: padded to a multiple of 256 rows;
- `fp32_accumulate_out`: torch.mm with out_dtype=float32 on the bf16 operands, rounded to bf16
  afterwards (where this torch has out_dtype).

And `fused_vs_split`: the trainer runs q, k, v as one 576x960 GEMM and gate, up as one 576x3072; the
engine runs them apart. Per M: the fused product's first columns against the separate product
(the same M rows both sides), and the fp32 output layer (576 x 49152 in fp32) at M rows against
the reference rows.

Printed per setting and shape: the fraction of output elements of the M rows that differ from the
reference rows, and the largest difference; JSON with `--out`.

    python bench/gemm_invariance.py [--rows 1,8,64,128,512,2048] [--ref-rows 49152] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

# (K, N) of SmolLM2-135M's linear layers: hidden 576, 9 x 64 query, 3 x 64 key/value, MLP 1536
SHAPES = {
    "q/o 576x576": (576, 576),
    "k/v 576x192": (576, 192),
    "qkv fused 576x960": (576, 960),
    "gate/up 576x1536": (576, 1536),
    "fc1 fused 576x3072": (576, 3072),
    "down 1536x576": (1536, 576),
}


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if rows > x.shape[0] else x


def settings(ref_rows: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """name -> (x [M, K], w [N, K]) -> [M, N] bf16."""
    out: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "default": lambda x, w: x @ w.t(),
        "pad_to_ref": lambda x, w: (_padded(x, ref_rows) @ w.t())[: x.shape[0]],
        "pad_256": lambda x, w: (_padded(x, -(-x.shape[0] // 256) * 256) @ w.t())[: x.shape[0]],
    }
    try:
        torch.mm(torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16),
                 out_dtype=torch.float32)
        out["fp32_accumulate_out"] = lambda x, w: torch.mm(x, w.t(), out_dtype=torch.float32).to(x.dtype)
    except (TypeError, RuntimeError):
        pass
    return out


def compare(fn: Callable, x: torch.Tensor, w: torch.Tensor, rows: list[int]) -> dict[str, dict[str, float]]:
    """For each M: fraction of differing elements of fn(x[:M]) vs fn(x)[:M], and the largest |diff|."""
    ref = fn(x, w)
    res = {}
    for m in rows:
        got = fn(x[:m].contiguous(), w)
        diff = (got.float() - ref[:m].float()).abs()
        res[str(m)] = {"frac_differ": float((diff > 0).float().mean()), "max_abs": float(diff.max())}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,64,128,512,2048")
    ap.add_argument("--ref-rows", type=int, default=49152)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [int(r) for r in a.rows.split(",")]
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    results: dict[str, dict] = {}
    modes = [("default", {}), ("no_reduced_reduction", {"reduced": False}), ("cublaslt", {"lt": True})]
    for mode, opts in modes:
        before_red = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        before_lib = torch.backends.cuda.preferred_blas_library() if dev == "cuda" else None
        if "reduced" in opts:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = opts["reduced"]
        if opts.get("lt") and dev == "cuda":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            for sname, fn in settings(a.ref_rows).items():
                if mode != "default" and sname != "default":
                    continue  # the library switches on the plain product only
                key = sname if mode == "default" else mode
                results[key] = {}
                for shape, (k, n) in SHAPES.items():
                    x = torch.randn(a.ref_rows, k, generator=g).to(dev, torch.bfloat16)
                    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dev, torch.bfloat16)
                    results[key][shape] = compare(fn, x, w, rows)
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before_red
            if before_lib is not None:
                torch.backends.cuda.preferred_blas_library(before_lib)
    results["fused_vs_split"] = {}
    for fused, part in (("qkv fused 576x960", 576), ("fc1 fused 576x3072", 1536)):
        k, n = SHAPES[fused]
        x = torch.randn(max(rows), k, generator=g).to(dev, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dev, torch.bfloat16)
        per_m = {}
        for m in rows:
            diff = ((x[:m] @ w.t())[:, :part].float() - (x[:m] @ w[:part].t()).float()).abs()
            per_m[str(m)] = {"frac_differ": float((diff > 0).float().mean()), "max_abs": float(diff.max())}
        results["fused_vs_split"][f"{fused} vs first {part} columns"] = per_m
    x = torch.randn(a.ref_rows // 8, 576, generator=g).to(dev)
    w = (torch.randn(49152, 576, generator=g) * 576 ** -0.5).to(dev)
    results["fused_vs_split"]["fp32 output layer 576x49152"] = compare(lambda x, w: x @ w.t(), x, w, rows)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}: fraction of output elements of the first M rows that differ "
          f"from the same rows in a {a.ref_rows}-row product (max |diff|)")
    for key, per_shape in results.items():
        print(f"{key}:")
        for shape, per_m in per_shape.items():
            cells = "  ".join(f"M={m}: {v['frac_differ']:.3f} ({v['max_abs']:.2g})" for m, v in per_m.items())
            print(f"  {shape:20s} {cells}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "ref_rows": a.ref_rows, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
