"""Runs the peers' own functions on given inputs, in a process of its own (tests/peers.py starts it with the
peers' folder first on sys.path: their pinned dependencies, e.g. omegaconf's antlr4, differ from ours).

    python -m tests.peer_calls IN OUT

IN: a torch.save'd list of calls {"fn": name, ...arguments}; OUT: a list of results, one per call, each a dict
of tensors / floats. The names are the CALLS below; each calls one function of verl 0.9.1 or AReaL 1.0.4
(launch/peers.txt) as its own code and tests call it, nothing re-implemented here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


def _grad(fn: Callable[[torch.Tensor], torch.Tensor], logp: torch.Tensor) -> dict[str, Any]:
    x = logp.clone().requires_grad_(True)
    loss = fn(x)
    loss.backward()
    return {"loss": loss.detach(), "grad": x.grad.detach()}


def verl_is_weights(c: dict) -> dict:
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    w, metrics = compute_rollout_correction_weights(c["log_ratio"], c["mask"], rollout_is=c["level"],
                                                    rollout_is_threshold=c["threshold"],
                                                    rollout_is_batch_normalize=c.get("batch_normalize", False))
    return {"weights": w, **metrics}


def verl_rejection(c: dict) -> dict:
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask
    mask, metrics = compute_rollout_rejection_mask(c["log_ratio"], c["mask"], rollout_rs=c["options"],
                                                   rollout_rs_threshold=c["threshold"])
    return {"mask": mask, **metrics}


def verl_offpolicy_metrics(c: dict) -> dict:
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics
    return compute_offpolicy_metrics(c["old"], c["rollout"], c["mask"])


def _verl_actor_config(**kw: Any) -> Any:
    from verl.workers.config.actor import ActorConfig
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **kw)


def verl_cispo(c: dict) -> dict:
    from verl.trainer.ppo.core_algos import compute_policy_loss_cispo
    cfg = _verl_actor_config(clip_ratio_low=c["eps"], clip_ratio_high=c["eps_high"])
    return _grad(lambda x: compute_policy_loss_cispo(c["old"], x, c["adv"], c["mask"], "token-mean", cfg)[0],
                 c["logp"])


def verl_sapo(c: dict) -> dict:
    from verl.trainer.ppo.core_algos import compute_policy_loss_sapo
    cfg = _verl_actor_config(tau_pos=c["tau_pos"], tau_neg=c["tau_neg"])
    return _grad(lambda x: compute_policy_loss_sapo(c["old"], x, c["adv"], c["mask"], "seq-mean-token-mean", cfg)[0],
                 c["logp"])


def areal_decoupled_ppo(c: dict) -> dict:
    from areal.api.cli_args import RejectionSamplingConfig
    from areal.utils.functional.functional import ppo_actor_loss_fn
    rs = RejectionSamplingConfig(level=c["level"], action=c["action"], metric="ratio", agg="mean",
                                 upper=c["upper"], lower=c["lower"])
    mask = c["mask"].bool()
    return _grad(lambda x: ppo_actor_loss_fn(x, c["proximal"], c["behaviour"], c["adv"], c["eps"], mask,
                                             eps_clip_higher=c["eps_high"], rejection_sampling=rs)[0], c["logp"])


def areal_sapo(c: dict) -> dict:
    from areal.utils.functional.functional import sapo_loss_fn
    return _grad(lambda x: sapo_loss_fn(x, c["old"], c["adv"], c["tau_pos"], c["tau_neg"], c["mask"].bool())[0],
                 c["logp"])


CALLS = {f.__name__: f for f in (verl_is_weights, verl_rejection, verl_offpolicy_metrics, verl_cispo, verl_sapo,
                                  areal_decoupled_ppo, areal_sapo)}


def main(argv: list[str]) -> None:
    calls = torch.load(argv[0])
    torch.save([CALLS[c["fn"]](c) for c in calls], argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
