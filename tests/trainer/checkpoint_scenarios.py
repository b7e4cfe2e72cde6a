"""Multi-rank checkpoint scenarios, one process per rank (run by test_checkpoint.py).

    python -m tests.trainer.checkpoint_scenarios SCENARIO RANK WORLD PORT OUT_DIR ARGS_JSON

Each scenario writes what the tests assert on into OUT_DIR/<scenario>_rank<RANK>.pt. A resume
must happen in fresh processes (nothing may survive in memory), hence one scenario per phase.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig
from tests.procs import run_processes
from tests.trainer.trainer_ref import make_batch

ROOT = Path(__file__).resolve().parents[2]
# warmup + cosine decay + weight decay: a resumed run that lost the schedule or the Adam moments
# would not reproduce the reference steps
OPTIM = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=1, lr_decay_style="cosine", weight_decay=0.01,
                        clip_grad=1.0)


def make_worker(rank: int, world: int, port: int, ckpt: str, tp: int, bf16: bool = False, pp: int = 1,
                pad: int = 1):
    from slime_rl.trainer.worker import TrainerWorker

    return TrainerWorker(rank, world, "127.0.0.1", port,
                         ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                        actor_num_gpus_per_node=world),
                         BatchConfig(micro_batch_size=2, global_batch_size=2), OPTIM,
                         ModelConfig(hf_checkpoint=ckpt, bf16=bf16), AlgoConfig(), train_iters=10,
                         pad_vocab_multiple=pad)


def weights(w) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in w.iter_hf_weights()}


def train(w, steps: int) -> list[dict[str, float]]:
    # gbs 2 over 4 samples: 2 optimizer steps per train_step, so the Adam state matters
    return [w.train_step(make_batch()) for _ in range(steps)]


def adam_state(w) -> list[dict[str, torch.Tensor]]:
    """This rank's Adam state (step, moments) in the inner torch optimizer's order."""
    out = []
    for opt in w.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                out.append({k: torch.as_tensor(v).detach().clone() for k, v in opt.optimizer.state[p].items()})
    return out


def handles(w) -> tuple[list[torch.nn.Module], Any, Any]:
    """(model chunks, optimizer, scheduler) of a TrainerWorker."""
    return [w.model], w.optimizer, w.scheduler


def scenario_save(rank: int, world: int, port: int, args: dict) -> dict:
    """TP=2: train 2, save at step 2, train 2 more (the reference)."""
    from slime_rl.trainer import checkpoint as ck

    w = make_worker(rank, world, port, args["hf"], tp=world, bf16=args.get("bf16", False))
    res: dict[str, Any] = {"first": train(w, 2)}
    extra = {"rollout_id": 2, "data": {"epoch": 0, "offset": 8}}
    res["path"] = str(ck.save_checkpoint(args["root"], 2, *handles(w), extra=extra))
    res["rng_after_save"] = torch.rand(4)
    res["adam_at_save"] = adam_state(w)
    res["at_save"] = weights(w)
    res["logp_at_save"] = w.compute_logprobs(make_batch())
    res["second"] = train(w, 2)
    res["after"] = weights(w)
    res["crash"] = crash_mid_save(w, args["root"])
    w.shutdown()
    return res


def crash_mid_save(w, root: str) -> str:
    """Save step 4 with a writer that dies right after dist_checkpointing wrote every shard: the
    folder then looks like a finished dist checkpoint but never gets the marker or its final name."""
    import megatron.core.dist_checkpointing as dc

    from slime_rl.trainer import checkpoint as ck

    real_save = dc.save

    def dying_save(*a, **kw):
        real_save(*a, **kw)
        raise RuntimeError("simulated crash")

    dc.save = dying_save
    try:
        ck.save_checkpoint(root, 4, *handles(w), extra={"rollout_id": 4})
        return "no crash"
    except RuntimeError as e:
        return str(e)
    finally:
        dc.save = real_save


def scenario_resume(rank: int, world: int, port: int, args: dict) -> dict:
    """Fresh processes at the same TP: load the latest, train the same 2 steps."""
    from slime_rl.trainer import checkpoint as ck

    w = make_worker(rank, world, port, args["hf"], tp=world, bf16=args.get("bf16", False))
    path = ck.latest_checkpoint(args["root"])
    res: dict[str, Any] = {"latest": str(path)}
    res["extra"] = ck.load_checkpoint(path, *handles(w))
    res["rng_after_load"] = torch.rand(4)
    res["adam_loaded"] = adam_state(w)
    res["loaded"] = weights(w)
    res["second"] = train(w, 2)
    res["after"] = weights(w)
    w.shutdown()
    return res


def scenario_tp1(rank: int, world: int, port: int, args: dict) -> dict:
    """World 1, TP=1: the TP=2 checkpoint's weights, resharded by dist_checkpointing."""
    from slime_rl.trainer import checkpoint as ck

    w = make_worker(rank, world, port, args["hf"], tp=1)
    # the optimizer state was saved dp_reshardable at TP=2: loading it at TP=1 must refuse clearly
    try:
        ck.load_checkpoint(args["root"], *handles(w), load_optim=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    extra = ck.load_checkpoint(args["root"], *handles(w), load_optim=False)
    res = {"refused": refused, "extra": extra, "loaded": weights(w), "logp": w.compute_logprobs(make_batch())}
    w.shutdown()
    return res


def scenario_converted(rank: int, world: int, port: int, args: dict) -> dict:
    """World 1: weights and log-probs of the HF folder, then of each converted checkpoint loaded
    into the same TP=1 worker (model only)."""
    from slime_rl.trainer import checkpoint as ck

    w = make_worker(rank, world, port, args["hf"], tp=1, pad=args["pad"])
    res: dict[str, Any] = {"hf": {"weights": weights(w), "logp": w.compute_logprobs(make_batch())}, "ckpts": []}
    for path in args["ckpts"]:
        ck.load_checkpoint(path, *handles(w), load_optim=False)
        res["ckpts"].append({"weights": weights(w), "logp": w.compute_logprobs(make_batch())})
    w.shutdown()
    return res


def scenario_save_hf(rank: int, world: int, port: int, args: dict) -> dict:
    """TP x PP from args: train a step, write --save-hf's folder (twice: the second replaces the
    first, as a re-save after a resume does); every rank records its stage's HF tensors."""
    w = make_worker(rank, world, port, args["hf"], tp=args["tp"], pp=args["pp"], pad=args.get("pad", 1))
    train(w, 1)
    stale = Path(args["out"] + ".tmp")
    if rank == 0:  # an interrupted earlier write left its temporary folder
        stale.mkdir(parents=True)
        (stale / "junk").write_text("x")
    w.save_hf(args["out"])
    train(w, 1)
    res = {"path": w.save_hf(args["out"]), "stage": weights(w), "pp_rank": w.pp_rank, "tp_rank": w.tp_rank}
    w.shutdown()
    return res


def scenario_disk_full(rank: int, world: int, port: int, args: dict) -> dict:
    """A save that fits, then the disk filled to its last 128 KiB, then the next save (--save on a small
    tmpfs): the error names the disk; the first checkpoint stays whole."""
    import shutil

    from slime_rl.trainer import checkpoint as ck
    from slime_rl.trainer.checkpoint_layout import remove_partial_saves

    root = Path(args["small"]) / "ckpt"
    w = make_worker(rank, world, port, args["hf"], tp=1)
    train(w, 1)
    first = ck.save_checkpoint(root, 5, *handles(w), extra={"rollout_id": 5})
    free = shutil.disk_usage(root).free
    (Path(args["small"]) / "filler").write_bytes(b"\0" * (free - 128 * 1024))
    res: dict[str, Any] = {"first": str(first), "free_before": free}
    try:
        ck.save_checkpoint(root, 6, *handles(w), extra={"rollout_id": 6})
        res["error"] = None
    except BaseException as e:  # noqa: BLE001  (the test asserts on what it is)
        res["error"] = f"{type(e).__name__}: {e}"
        res["disk_error"] = isinstance(e, ck.CheckpointDiskError)
    res["tmp_left"] = (root / "iter_0000006.tmp").exists()
    res["removed"] = [p.name for p in remove_partial_saves(root)]
    res["latest"] = str(ck.latest_checkpoint(root))
    res["shapes"] = ck.checkpoint_model_shapes(first)
    w.shutdown()
    return res


SCENARIOS = {"save": scenario_save, "disk_full": scenario_disk_full, "resume": scenario_resume, "tp1": scenario_tp1,
             "converted": scenario_converted, "save_hf": scenario_save_hf}


def run_scenario(name: str, world: int, port: int, out: Path, args: dict, timeout: float = 300) -> list[dict]:
    """Run a scenario in `world` processes; returns each rank's record (raises with the logs)."""
    run_processes([[sys.executable, "-m", "tests.trainer.checkpoint_scenarios", name, str(r), str(world), str(port),
                    str(out), json.dumps(args)] for r in range(world)], f"scenario {name}", timeout)
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(world)]


def main() -> None:
    name, rank, world, port, out, args = sys.argv[1:7]
    res = SCENARIOS[name](int(rank), int(world), int(port), json.loads(args))
    torch.save(res, Path(out) / f"{name}_rank{rank}.pt")


if __name__ == "__main__":
    main()
