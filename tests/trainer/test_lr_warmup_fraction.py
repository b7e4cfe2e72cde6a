"""--lr-warmup-fraction (Megatron-LM's): warm-up over fraction x the decay steps, through the trainer's
own scheduler (megatron's OptimizerParamScheduler, as worker.MegatronRank builds it). Expected LRs by
hand from Megatron's formulas: warm-up lr = max_lr * step / warmup; then linear decay
lr = max_lr * (1 - (step - warmup) / (decay - warmup))."""

from __future__ import annotations

import pytest
import torch

from slime_rl.config.groups import OptimizerConfig


def test_warmup_fraction_of_the_decay_steps():
    from slime_rl.trainer.mcore import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_warmup_fraction=0.1)
    decay = 30  # warm-up: 0.1 x 30 = 3 steps
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
                                    lr_warmup_steps=cfg.warmup_steps(decay), lr_decay_steps=decay,
                                    lr_decay_style=cfg.lr_decay_style, start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=decay, wd_incr_style="constant")
    got = []
    for _ in range(6):
        got.append(opt.param_groups[0]["lr"])
        sched.step(increment=1)
    want = [0.0, 1 / 3, 2 / 3, 1.0, 1 - 1 / 27, 1 - 2 / 27]
    assert got == pytest.approx(want, abs=1e-12)
