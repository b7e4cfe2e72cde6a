"""--seed through the whole loop on CPU (Ray, a Megatron rank on gloo, the built-in engine): one seed
twice repeats the run bit for bit (prompts, responses, metrics, eval answers), another seed changes
it; --log-eval-generations writes the eval samples it names."""

from __future__ import annotations

import json

import pytest

from slime_rl.config import build_config
from slime_rl.train import preflight, train
from tests.e2e.test_loop import argv
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(64, seed=1)

# wall-clock figures differ between any two runs; so does the engine's log-prob of a token in the last
# bits (~1e-8), as the engine batches requests by their timing: the tokens themselves are seeded
VOLATILE = ("perf/", "time/", "train/rollout_logprob_abs_diff")


def run(model, data, run_dir, seed: int) -> dict:
    eval_data = run_dir.parent / "eval.jsonl"  # the first 4 prompts
    eval_data.write_text("".join(data.read_text().splitlines(keepends=True)[:4]))
    extra = ["--seed", str(seed), "--deterministic-rollout", "--dump-rollouts", "--eval-interval", "1",
             "--eval-prompt-data", "digits", str(eval_data), "--n-samples-per-eval-prompt", "2",
             "--log-eval-generations", "3"]
    # one trainer rank (TP 1): the seed's reach does not depend on the layout, and each of the three runs starts
    # one rank process fewer
    extra += ["--tensor-model-parallel-size", "1", "--actor-num-gpus-per-node", "1"]
    rows = train(*preflight(build_config(argv(model, data, run_dir, steps=2) + extra)))
    return {
        "metrics": [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows],
        "rollouts": [(run_dir / "rollouts" / f"step_{k:06d}.jsonl").read_text() for k in range(2)],
        "generations": [json.loads(x) for x in (run_dir / "eval_generations.jsonl").read_text().splitlines()],
    }


@pytest.mark.slow
def test_a_seed_repeats_its_run_and_another_seed_changes_it(ray_session, tiny_qwen2, digit_data, tmp_path):
    a = run(tiny_qwen2, digit_data, tmp_path / "a", seed=1)
    b = run(tiny_qwen2, digit_data, tmp_path / "b", seed=1)
    c = run(tiny_qwen2, digit_data, tmp_path / "c", seed=2)
    assert a == b
    # another seed: other prompts in another order, other sampling seeds, so other responses
    prompts = [[json.loads(x)["prompt"] for x in r.splitlines()] for r in (a["rollouts"][0], c["rollouts"][0])]
    assert prompts[0] != prompts[1]
    assert a["rollouts"][1] != c["rollouts"][1]
    # --log-eval-generations 3: eval before training (step -1) and after each step, 3 samples each:
    # the first sample of each of the first 3 prompts of the eval set, with its reward
    gens = a["generations"]
    assert [g["step"] for g in gens] == [-1] * 3 + [0] * 3 + [1] * 3
    rows = [json.loads(x) for x in digit_data.read_text().splitlines()][:3]
    assert [g["label"] for g in gens[:3]] == [str(r["label"]) for r in rows]
    assert all(g["dataset"] == "digits" and g["reward"] in (0.0, 1.0) and isinstance(g["response"], str)
               for g in gens)
    assert all(str(r["input"]) in g["prompt"] for r, g in zip(rows, gens[:3], strict=True))
