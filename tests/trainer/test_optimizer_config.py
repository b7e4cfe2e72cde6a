"""The trainer's megatron-core optimizer settings (trainer/rank.megatron_optimizer_config): the distributed
optimizer always; --optimizer-cpu-offload only where the rank has a GPU (megatron-core's HybridDeviceOptimizer
moves shards off a GPU; tests/gpu/test_gpu_optimizer_offload.py trains with it), with precision-aware on as
Megatron-LM requires; --use-precision-aware-optimizer alone changes nothing (it would need TransformerEngine)."""

from __future__ import annotations

import torch

from slime_rl.config import build_config
from slime_rl.trainer.rank import megatron_optimizer_config


def _optim(tmp_path, *flags: str):
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    return build_config(["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "d.jsonl"),
                         "--rm-type", "digit", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                         "--num-rollout", "2", "--lr", "2e-6", *flags]).optimizer


def test_offload_reaches_megatron_only_on_a_gpu(tmp_path):
    optim = _optim(tmp_path, "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
                   "--use-precision-aware-optimizer", "--optimizer-offload-fraction", "0.75")
    gpu = megatron_optimizer_config(optim, True, torch.bfloat16, on_gpu=True)
    assert (gpu.optimizer_cpu_offload, gpu.use_precision_aware_optimizer, gpu.overlap_cpu_optimizer_d2h_h2d,
            gpu.optimizer_offload_fraction) == (True, True, True, 0.75)
    assert gpu.use_distributed_optimizer and gpu.lr == 2e-6 and gpu.bf16
    cpu = megatron_optimizer_config(optim, False, torch.float32, on_gpu=False)
    assert (cpu.optimizer_cpu_offload, cpu.use_precision_aware_optimizer, cpu.overlap_cpu_optimizer_d2h_h2d) == (
        False, False, False)


def test_precision_aware_alone_and_the_default_are_the_same_settings(tmp_path):
    plain = megatron_optimizer_config(_optim(tmp_path), True, torch.bfloat16, on_gpu=True)
    aware = megatron_optimizer_config(_optim(tmp_path, "--use-precision-aware-optimizer"), True, torch.bfloat16,
                                      on_gpu=True)
    assert plain == aware and not aware.use_precision_aware_optimizer and not aware.optimizer_cpu_offload
