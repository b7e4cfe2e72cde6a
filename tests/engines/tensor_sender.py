"""A separate process that hands tensors to an engine in place (colocated mode), as a trainer rank
would: `python -m tests.engines.tensor_sender MODEL_DIR SCALE N_BUCKETS` prints a JSON list of
serialized_named_tensors entries (one per bucket) and keeps the shared memory alive until a line
arrives on stdin."""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file

from slime_rl.engines.tensor_ipc import serialize_named_tensors, use_file_system_sharing


def perturbed(model_dir: str, scale: float) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (float32), each plus scale * sin(index): deterministic, so the test
    computes the same bits on its side."""
    out = []
    for name, t in sorted(load_file(f"{model_dir}/model.safetensors").items()):
        t = t.float()
        out.append((name, t + scale * torch.sin(torch.arange(t.numel(), dtype=torch.float32)).view(t.shape)))
    return out


def main() -> None:
    model_dir, scale, n_buckets = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    use_file_system_sharing()
    named = [(n, t.share_memory_()) for n, t in perturbed(model_dir, scale)]
    size = -(-len(named) // n_buckets)
    entries = [serialize_named_tensors(named[i:i + size]) for i in range(0, len(named), size)]
    print(json.dumps(entries), flush=True)
    sys.stdin.readline()  # the engine has copied: the storages may go


if __name__ == "__main__":
    main()
