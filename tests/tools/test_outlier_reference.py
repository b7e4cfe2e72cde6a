"""bench/outlier_reference.py puts each step's trainer and engine log-probs beside a float64 reference of the
weights that generated that step, and names the side an outlier comes from.

The expected reference is computed here another way: token by token, each prefix through the model on its
own (no slicing of one forward's logits). The dumps go through the run's own writers; step 1's weights are
a different model from step 0's, so a wrong step -> weights mapping puts every token off."""

import json

import pytest
import torch

from bench.outlier_reference import main
from slime_rl.data import Sample
from slime_rl.trainer.debug_data import train_data
from tools.make_tiny_model import make_tiny_model


def _prefix_logprobs(model_dir, tokens, response_length, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for t in range(len(tokens) - response_length, len(tokens)):
            logits = model(input_ids=torch.tensor([tokens[:t]])).logits[0, -1].double() / temperature
            out.append(torch.log_softmax(logits, -1)[tokens[t]].item())
    return out


def _write(path, step, *samples):
    """One step's train dump through the run's writer; each sample (prompt, response, trainer, engine)."""
    made = [Sample(index=i, group_index=0, prompt="p", prompt_ids=prompt, response_ids=response,
                   rollout_logprobs=engine, loss_mask=[1] * len(response), finish_reason="stop", reward=0.0)
            for i, (prompt, response, _, engine) in enumerate(samples)]
    batch = {"tokens": [s.tokens for s in made], "response_lengths": [s.response_length for s in made],
             "rollout_logprobs": [s.rollout_logprobs for s in made], "loss_masks": [s.loss_mask for s in made],
             "advantages": [0.0] * len(made), "rewards": [0.0] * len(made)}
    torch.save(train_data(step, 0, 1, batch, [trainer for _, _, trainer, _ in samples], None, "fused"),
               path / f"train_{step}_0.pt")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_each_step_against_its_own_weights_and_the_off_side_named(tmp_path, temperature):
    m0 = make_tiny_model(tmp_path / "m0", "llama", seed=0)
    make_tiny_model(tmp_path / "hf_0", "llama", seed=1)
    (tmp_path / "hf_1").mkdir()  # step 2's weights never written: skipped
    prompt, response = [3, 9, 17, 4], [22, 5, 40]
    ref0 = _prefix_logprobs(m0, prompt + response, 3, temperature)
    ref1 = _prefix_logprobs(tmp_path / "hf_0", prompt + response, 3, temperature)
    assert max(abs(a - b) for a, b in zip(ref0, ref1, strict=True)) > 0.05  # the two steps' weights do differ
    short = _prefix_logprobs(tmp_path / "hf_0", prompt + [7], 1, temperature)
    # step 0: the trainer off by 0.2 at position 1; step 1: the engine off by 0.3 at position 2, and a
    # second, 1-token sample exact on both sides (so step 1 has 4 tokens, step 0 3); every other value
    # within 1e-7 of the reference
    _write(tmp_path, 0, (prompt, response, [ref0[0] + 1e-7, ref0[1] - 0.2, ref0[2]],
                         [ref0[0], ref0[1], ref0[2] - 1e-7]))
    _write(tmp_path, 1, (prompt, response, [ref1[0], ref1[1], ref1[2]], [ref1[0], ref1[1] + 1e-7, ref1[2] + 0.3]),
           (prompt, [7], short, short))
    _write(tmp_path, 2, (prompt, response, ref1, ref1))
    out = tmp_path / "r.json"
    main(["--train", str(tmp_path / "train_{rollout_id}_{rank}.pt"), "--model", str(m0),
          "--weights", str(tmp_path / "hf_{rollout_id}"), "--temperature", str(temperature),
          "--device", "cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["steps"] == 2 and s["steps_skipped"] == [2]
    assert (s["outliers"], s["outliers_trainer_off"], s["outliers_engine_off"]) == (2, 1, 1)
    step0, step1 = result["steps"]
    (o0,), (o1,) = step0["outliers"], step1["outliers"]
    assert (o0["position"], o0["off"], o1["position"], o1["off"]) == (1, "trainer", 2, "engine")
    assert o0["trainer_error"] == pytest.approx(-0.2, abs=1e-6) and abs(o0["engine_error"]) < 1e-6
    assert o1["engine_error"] == pytest.approx(0.3, abs=1e-6) and abs(o1["trainer_error"]) < 1e-6
    assert step0["trainer_max"] == pytest.approx(0.2, abs=1e-6) and step0["engine_max"] < 1e-6
    assert step1["engine_max"] == pytest.approx(0.3, abs=1e-6) and step1["trainer_max"] < 1e-6
    assert (s["tokens_trainer_over_threshold"], s["tokens_engine_over_threshold"]) == (1, 1)
    # the run's means are over its 7 trained tokens, not the mean of the two steps' means (0.2/3/2, 0.3/4/2)
    assert s["trained_tokens"] == 7
    assert s["trainer_mean"] == pytest.approx(0.2 / 7, abs=1e-6)
    assert s["engine_mean"] == pytest.approx(0.3 / 7, abs=1e-6)
