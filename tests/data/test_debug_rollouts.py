"""--load-debug-rollout-data's reader without a cluster: a rollout written by the run's own writer
(debug_rollout_data + save_debug_data, as --save-debug-rollout-data writes it) reads back as the same
Samples and the same trainer batch; a file that does not fit the flags, is missing or holds a bad
sample fails naming the file, the step, the sample and the field. The whole loop:
tests/e2e/test_replay_rollouts.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime_rl.config import AlgoConfig
from slime_rl.data import DataError, Sample
from slime_rl.data.debug_rollouts import read_debug_rollout
from slime_rl.observability.debug_data import save_debug_data
from slime_rl.orchestration.rollout_manager import debug_rollout_data, samples_to_batch
from slime_rl.train import check_replay_files
from tests.config.test_config import base_argv

FLAG = "--load-debug-rollout-data"


def _sample(index: int, group: int, response: list[int], reward: float) -> Sample:
    return Sample(
        index=index,
        group_index=group,
        prompt=f"prompt {group}",
        prompt_ids=[100 + group, 7],
        label={"answer": str(group)},
        metadata={"source": "test", "n": index},
        response=f"resp {index}",
        response_ids=response,
        rollout_logprobs=[-0.125 * (k + 1) - index for k in range(len(response))],
        loss_mask=[1] * (len(response) - 1) + [0],
        finish_reason="length" if index % 2 else "stop",
        reward=reward,
        reward_metrics={"acc": reward},
        weight_version=str(index // 3),
    )


def _groups() -> list[list[Sample]]:
    """2 groups of 3 (group numbers 4 and 9: not their positions), rewards differing within each."""
    return [
        [_sample(0, 4, [1, 2, 3], 1.0), _sample(1, 4, [4, 5], 0.0), _sample(2, 4, [6], 0.5)],
        [_sample(3, 9, [7, 8], 0.0), _sample(4, 9, [9, 10, 11, 12], 2.0), _sample(5, 9, [13, 14], 0.0)],
    ]


def _write(tmp_path, payload, step: int = 3):
    return save_debug_data(tmp_path / f"rollout_{step}.pt", payload)


def test_a_saved_rollout_reads_back_as_the_same_samples_and_batch(tmp_path):
    groups = _groups()
    for s in (s for g in groups for s in g):  # MoE routing (an int32 array per sample): saved as lists
        s.rollout_routed_experts = np.arange(2 * len(s.tokens) - 2, dtype=np.int32).reshape(-1, 2) + s.index
    path = _write(tmp_path, debug_rollout_data(3, groups))
    back = read_debug_rollout(path, 3, rollout_batch_size=2, n_samples_per_prompt=3)
    assert [[s.index for s in g] for g in back] == [[0, 1, 2], [3, 4, 5]]
    assert back[0][2].rollout_routed_experts == [[2, 3], [4, 5]]  # 3 tokens: 2 rows, + index 2
    for s in (s for g in groups for s in g):
        s.rollout_routed_experts = s.rollout_routed_experts.tolist()
    assert back == groups  # every field, dataclass equality
    algo = AlgoConfig(overlong_buffer_len=2)  # the rollout side's shaping is applied again, from the flags
    assert samples_to_batch(back, algo, 4) == samples_to_batch(groups, algo, 4)
    batch = samples_to_batch(back)
    # what the trainer gets, written out by hand: rewards as saved, groups contiguous in file order
    assert batch["rewards"] == [1.0, 0.0, 0.5, 0.0, 2.0, 0.0]
    assert batch["tokens"][4] == [109, 7, 9, 10, 11, 12] and batch["response_lengths"] == [3, 2, 1, 2, 4, 2]
    assert batch["loss_masks"][0] == [1, 1, 0] and batch["rollout_logprobs"][1] == [-1.125, -1.25]
    # GRPO: (r - mean) / (std + eps) within the group; group 2: mean 2/3, std (unbiased) sqrt(4/3)
    assert batch["advantages"][4] == pytest.approx((2.0 - 2 / 3) / (4 / 3) ** 0.5, rel=1e-5)


def test_a_file_of_other_flags_is_refused_naming_the_flag(tmp_path):
    path = _write(tmp_path, debug_rollout_data(3, _groups()))
    with pytest.raises(DataError) as err:
        read_debug_rollout(path, 3, rollout_batch_size=4, n_samples_per_prompt=3)
    assert str(err.value) == (f"{FLAG} {path} (step 3): 2 groups, but --rollout-batch-size is 4 (replay with the "
                              "flags of the run that saved it)")
    with pytest.raises(DataError) as err:
        read_debug_rollout(path, 3, rollout_batch_size=2, n_samples_per_prompt=4)
    assert str(err.value).startswith(f"{FLAG} {path} (step 3): group 4 has 3 samples, but --n-samples-per-prompt is 4")
    uneven = _groups()
    uneven[1].pop()
    path = _write(tmp_path, debug_rollout_data(3, uneven))
    with pytest.raises(DataError, match="group 9 has 2 samples, but --n-samples-per-prompt is 3"):
        read_debug_rollout(path, 3, rollout_batch_size=2, n_samples_per_prompt=3)


def test_a_missing_file_names_the_file_and_the_step(tmp_path):
    with pytest.raises(DataError) as err:
        read_debug_rollout(tmp_path / "rollout_7.pt", 7, 2, 3)
    assert str(err.value) == f"{FLAG}: no file {tmp_path / 'rollout_7.pt'} for step 7 (the template formatted with " \
                             "rollout_id=7)"


def _set(field, value):
    return lambda d: d.__setitem__(field, value)


# (what is done to sample 4's dict, the field named, words of the reason)
MALFORMED = [
    (_set("reward", None), "reward", "expected a number, got NoneType None"),
    (_set("reward", True), "reward", "expected a number"),
    (_set("loss_mask", [1, 1, 0]), "loss_mask", "3 values for 4 response tokens"),
    (_set("loss_mask", [1, 2, 0, 1]), "loss_mask", "expected a list of 0 and 1"),
    (_set("rollout_logprobs", [-0.1]), "rollout_logprobs", "1 values for 4 response tokens"),
    (_set("rollout_logprobs", ["x"] * 4), "rollout_logprobs", "expected a list of numbers"),
    (_set("response_ids", [9, "10", 11, 12]), "response_ids", "expected a list of ints, got a list holding str '10'"),
    (_set("prompt_ids", []), "prompt_ids", "empty"),
    (_set("group_index", "9"), "group_index", "expected an int"),
    (_set("metadata", "x"), "metadata", "expected a dict"),
    (_set("tokens", [1, 2]), "tokens", "not prompt_ids + response_ids"),
    (_set("response_length", 3), "response_length", "3, but response_ids holds 4 tokens"),
    (_set("log_probs", [0.0]), "log_probs", "not a field of slime_rl's Sample"),
    (lambda d: d.pop("prompt_ids"), "prompt_ids", "missing"),
    (lambda d: d.pop("rollout_logprobs"), "rollout_logprobs", "missing"),
]


@pytest.mark.parametrize("change, field, words", MALFORMED, ids=[f"{m[1]}-{k}" for k, m in enumerate(MALFORMED)])
def test_a_malformed_sample_names_the_file_the_sample_and_the_field(tmp_path, change, field, words):
    payload = debug_rollout_data(3, _groups())
    change(payload["samples"][4])
    path = _write(tmp_path, payload)
    with pytest.raises(DataError) as err:
        read_debug_rollout(path, 3, 2, 3)
    message = str(err.value)
    assert message.startswith(f"{FLAG} {path} (step 3): sample 4, field {field!r}: ") and words in message, message


def test_routing_replay_needs_the_saved_routing_of_every_sample(tmp_path):
    groups = _groups()
    path = _write(tmp_path, debug_rollout_data(3, groups))
    assert read_debug_rollout(path, 3, 2, 3) == groups  # not asked for: a dense run's file is fine
    with pytest.raises(DataError) as err:
        read_debug_rollout(path, 3, 2, 3, routed_experts=True)
    assert str(err.value) == (f"{FLAG} {path} (step 3): sample 0, field 'rollout_routed_experts': missing, and "
                              "--use-rollout-routing-replay replays it (saved by a run without that flag?)")
    for s in (s for g in groups for s in g):
        s.rollout_routed_experts = [[0, 1]] * (len(s.tokens) - 1)
    path = _write(tmp_path, debug_rollout_data(3, groups))
    assert read_debug_rollout(path, 3, 2, 3, routed_experts=True) == groups


def test_a_group_split_in_two_is_refused(tmp_path):
    payload = debug_rollout_data(3, _groups())
    s = payload["samples"]
    s[2], s[3] = s[3], s[2]  # group 4, 4, 9, 4, ...: group 4 again after group 9
    path = _write(tmp_path, payload)
    with pytest.raises(DataError, match=r"sample 3, field 'group_index': group 4 again after other groups \(it began "
                                        r"at sample 0\)"):
        read_debug_rollout(path, 3, 2, 3)


def test_not_a_debug_rollout_file(tmp_path):
    text = tmp_path / "rollout_3.pt"
    text.write_text("not a torch file")
    with pytest.raises(DataError, match=r"rollout_3.pt \(step 3\): not a file torch.load\(weights_only=True\) reads"):
        read_debug_rollout(text, 3, 2, 3)
    torch.save({"rollout_id": 3, "samples": [np.zeros(2)]}, text)  # a numpy array: weights_only refuses it
    with pytest.raises(DataError, match="not a file torch.load"):
        read_debug_rollout(text, 3, 2, 3)
    path = _write(tmp_path, {"rollout_id": 3, "rows": []})
    with pytest.raises(DataError, match=r"expected \{'rollout_id', 'samples': \[...\]\} as --save-debug-rollout-data "
                                        r"writes, got \['rollout_id', 'rows'\]"):
        read_debug_rollout(path, 3, 2, 3)


def test_preflight_reads_the_first_file_and_finds_every_steps_file(tmp_path):
    from slime_rl.config import build_config

    argv = base_argv(tmp_path) + ["--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--num-rollout", "3",
                                  FLAG, str(tmp_path / "dump" / "rollout_{rollout_id}.pt")]
    cfg = build_config(argv)
    for step in (0, 2):
        save_debug_data(tmp_path / "dump" / f"rollout_{step}.pt", debug_rollout_data(step, _groups()))
    with pytest.raises(DataError) as err:
        check_replay_files(cfg)
    assert str(err.value) == (f"{FLAG} {tmp_path / 'dump' / 'rollout_{rollout_id}.pt'}: no file for step 1 "
                              f"({tmp_path / 'dump' / 'rollout_1.pt'}); 1 of the 3 steps' files are missing "
                              "(fewer --num-rollout?)")
    save_debug_data(tmp_path / "dump" / "rollout_1.pt", debug_rollout_data(1, _groups()))
    check_replay_files(cfg)
    wrong = build_config(argv + ["--rollout-batch-size", "4", "--global-batch-size", "12"])
    with pytest.raises(DataError, match=r"rollout_0.pt \(step 0\): 2 groups, but --rollout-batch-size is 4"):
        check_replay_files(wrong)


def test_the_command_line_stops_before_anything_starts_on_a_missing_file(tiny_qwen2, tmp_path, capsys):
    from slime_rl.data.digits import make_rows, write_jsonl
    from slime_rl.train import main

    data = write_jsonl(make_rows(8, seed=0), tmp_path / "digits.jsonl")
    argv = ["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "3", "--num-rollout", "2", "--rm-type", "digit", "--rollout-max-response-len",
            "4", "--run-dir", str(tmp_path / "run"), FLAG, str(tmp_path / "dump" / "rollout_{rollout_id}.pt")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{FLAG}: no file {tmp_path / 'dump' / 'rollout_0.pt'} for step 0" in err, err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


# --- files written by slime's own --save-debug-rollout-data ---------------------------------------
# The payload is slime/observability/rollout_data_utils.py save_debug_rollout_data's
# {"rollout_id", "samples": [sample.to_dict() ...]} (torch.save); the keys below are those of
# slime/utils/types.py Sample.to_dict (THUDM/slime 624b824a): the dataclass's __dict__, with `status` as
# its string value and spec_info / prefix_cache_info as dicts. Written out literally, not by our code.


def _slime_dict(index, group, prompt, tokens, response_length, log_probs, loss_mask, reward, status,
                weight_versions=(), remove_sample=False, routed=None):
    return {
        "group_index": group, "index": index, "rollout_id": None, "prompt": prompt, "tokens": tokens,
        "multimodal_inputs": None, "multimodal_train_inputs": None, "multimodal_train_input_id": None,
        "apply_chat_template_kwargs": {}, "response": f"text {index}", "response_length": response_length,
        "label": f"label {group}", "reward": reward, "loss_mask": loss_mask, "weight_versions": list(weight_versions),
        "rollout_log_probs": log_probs, "rollout_top_p_token_ids": None, "rollout_top_p_token_offsets": None,
        "rollout_routed_experts": routed, "remove_sample": remove_sample, "teacher_log_probs": None,
        "status": status, "metadata": {"source": "slime", "n": index}, "generate_function_path": None,
        "custom_rm_path": None, "train_metadata": None, "session_id": None, "non_generation_time": 0.0,
        "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                      "completion_token_num": 0},
        "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
    }


def _slime_payload():
    """2 groups of 2 (group numbers 5 and 8), as slime's save_debug_rollout_data writes them."""
    return {"rollout_id": 3, "samples": [
        _slime_dict(10, 5, "What is 1+1?", [11, 12, 13, 21, 22], 2, [-0.5, -0.25], None, 1.0, "completed",
                    weight_versions=["3", "4"]),
        _slime_dict(11, 5, [{"role": "user", "content": "hi"}], [11, 12, 13, 31, 32, 33], 3, [-1.0, -2.0, 0.0],
                    [1, 1, 0], 0, "truncated"),
        _slime_dict(12, 8, "p", [40, 41, 42], 1, [-0.75], [1], -1.0, "aborted", remove_sample=True),
        _slime_dict(13, 8, "p", [40, 50, 51, 52], 3, [-0.125, -0.375, -0.625], [1, 1, 1], 0.5, "failed",
                    routed=torch.tensor([[[1], [2]], [[3], [4]], [[5], [6]]], dtype=torch.int32)),
    ]}


def _save_slime(tmp_path, payload, step: int = 3):
    path = tmp_path / f"{step}.pt"
    torch.save(payload, path)  # as slime does
    return path


def test_a_rollout_saved_by_slime_reads_back_as_our_samples(tmp_path):
    path = _save_slime(tmp_path, _slime_payload())
    back = read_debug_rollout(path, 3, rollout_batch_size=2, n_samples_per_prompt=2)
    meta = lambda i: {"source": "slime", "n": i}  # noqa: E731
    assert back == [
        [Sample(index=10, group_index=5, prompt="What is 1+1?", prompt_ids=[11, 12, 13], label="label 5",
                metadata=meta(10), response="text 10", response_ids=[21, 22], rollout_logprobs=[-0.5, -0.25],
                loss_mask=[1, 1], finish_reason="stop", reward=1.0, weight_version="4"),
         Sample(index=11, group_index=5, prompt='[{"role": "user", "content": "hi"}]', prompt_ids=[11, 12, 13],
                label="label 5", metadata=meta(11), response="text 11", response_ids=[31, 32, 33],
                rollout_logprobs=[-1.0, -2.0, 0.0], loss_mask=[1, 1, 0], finish_reason="length", reward=0)],
        [Sample(index=12, group_index=8, prompt="p", prompt_ids=[40, 41], label="label 8", metadata=meta(12),
                response="text 12", response_ids=[42], rollout_logprobs=[-0.75], loss_mask=[0],  # remove_sample
                finish_reason="abort", reward=-1.0),
         Sample(index=13, group_index=8, prompt="p", prompt_ids=[40], label="label 8", metadata=meta(13),
                response="text 13", response_ids=[50, 51, 52], rollout_logprobs=[-0.125, -0.375, -0.625],
                loss_mask=[1, 1, 1], finish_reason="failed", reward=0.5,
                rollout_routed_experts=[[1, 2], [3, 4], [5, 6]])],
    ]
    back[1][1].rollout_routed_experts = None  # the batch wants all samples' routing or none
    batch = samples_to_batch(back)
    assert batch["tokens"] == [[11, 12, 13, 21, 22], [11, 12, 13, 31, 32, 33], [40, 41, 42], [40, 50, 51, 52]]
    assert batch["response_lengths"] == [2, 3, 1, 3] and batch["rewards"] == [1.0, 0.0, -1.0, 0.5]
    # GRPO, group 5: rewards 1 and 0, mean 1/2, unbiased std sqrt(1/2): advantages +-sqrt(1/2)
    assert batch["advantages"][:2] == pytest.approx([0.5 ** 0.5, -(0.5 ** 0.5)], rel=1e-5)


# (what is done to sample 1's dict, the field named, words of the reason)
SLIME_MALFORMED = [
    (_set("reward", {"score": 1.0, "acc": 1}), "reward", "without the --reward-key None entry"),
    (_set("reward", None), "reward", "expected a number, got NoneType None"),
    (_set("rollout_log_probs", None), "rollout_log_probs", "None: the run that saved it kept no engine log-probs"),
    (lambda d: d.pop("rollout_log_probs"), "rollout_log_probs", "missing"),
    (_set("rollout_log_probs", [-1.0, -2.0]), "rollout_log_probs", "2 values for response_length 3"),
    (_set("response_length", 4), "rollout_log_probs", "3 values for response_length 4"),
    (_set("response_length", 6), "response_length", "6, but tokens holds 6 ids"),
    (_set("response_length", 0), "response_length", "0, but tokens holds 6 ids"),
    (_set("tokens", []), "response_length", "3, but tokens holds 0 ids"),
    (_set("loss_mask", [1, 1]), "loss_mask", "2 values for response_length 3"),
    (_set("status", "pending"), "status", "'pending': expected one of completed, truncated, aborted, failed"),
    (_set("multimodal_inputs", {"images": ["x"]}), "multimodal_inputs", "not supported"),
    (_set("group_index", None), "group_index", "expected an int"),
]


@pytest.mark.parametrize("change, field, words", SLIME_MALFORMED,
                         ids=[f"{m[1]}-{k}" for k, m in enumerate(SLIME_MALFORMED)])
def test_a_bad_slime_sample_names_the_file_the_sample_and_the_field(tmp_path, change, field, words):
    payload = _slime_payload()
    change(payload["samples"][1])
    path = _save_slime(tmp_path, payload)
    with pytest.raises(DataError) as err:
        read_debug_rollout(path, 3, 2, 2)
    message = str(err.value)
    assert message.startswith(f"{FLAG} {path} (step 3): sample 1, field {field!r}: ") and words in message, message


def test_a_slime_dict_reward_gives_its_reward_key_entry(tmp_path):
    """slime trains reward[--reward-key] when a reward function returns a dict (Sample.get_reward_value):
    the replay takes the run's --reward-key entry, and refuses a dict without it or with a non-number."""
    payload = _slime_payload()
    payload["samples"][1]["reward"] = {"score": 0.25, "acc": 1}
    path = _save_slime(tmp_path, payload)
    back = read_debug_rollout(path, 3, 2, 2, reward_key="score")
    assert [s.reward for g in back for s in g] == [1.0, 0.25, -1.0, 0.5]
    assert read_debug_rollout(path, 3, 2, 2, reward_key="acc")[0][1].reward == 1
    with pytest.raises(DataError, match=r"sample 1, field 'reward': a dict \(keys \['acc', 'score'\]\) without the "
                                        r"--reward-key 'correct' entry"):
        read_debug_rollout(path, 3, 2, 2, reward_key="correct")
    payload["samples"][1]["reward"] = {"score": "high"}
    path = _save_slime(tmp_path, payload)
    with pytest.raises(DataError, match=r"sample 1, field 'reward': reward\['score'\] \(--reward-key\): expected a "
                                        r"number, got str 'high'"):
        read_debug_rollout(path, 3, 2, 2, reward_key="score")


def test_a_file_mixing_slime_and_our_samples_is_refused(tmp_path):
    payload = _slime_payload()
    payload["samples"][2] = debug_rollout_data(3, _groups())["samples"][0]
    path = _save_slime(tmp_path, payload)
    with pytest.raises(DataError, match=r"\(step 3\): sample 2: written by this project's writer .*, but sample 0 by "
                                        r"slime's Sample.to_dict .*mixed formats are refused"):
        read_debug_rollout(path, 3, 2, 2)
    ours = debug_rollout_data(3, _groups())
    ours["samples"][4] = _slime_payload()["samples"][0]
    path = _write(tmp_path, ours)
    with pytest.raises(DataError, match=r"sample 4: written by slime's Sample.to_dict .*, but sample 0 by this "
                                        r"project's writer"):
        read_debug_rollout(path, 3, 2, 3)
