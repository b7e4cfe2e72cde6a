"""slime's --eval-config YAML (config/eval_config.py): the sets with their own settings, `defaults` for all,
the --eval-* flags under both; what it cannot take is refused naming the file, the set and the key.
The first file is slime's examples/eval_multi_task/multi_task.yaml (slime 624b824) with local paths."""

from __future__ import annotations

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.checks import ConfigNote
from slime_rl.rewards import RewardError
from slime_rl.rollout.eval import eval_samples_per_prompt, eval_sampling_params
from slime_rl.train import preflight

MULTI_TASK = """eval:
  defaults:
    max_response_len: 16384
    top_p: 0.7
  datasets:
    - name: aime
      path: {d}/aime.jsonl
      rm_type: deepscaler
      n_samples_per_eval_prompt: 16
    - name: gpqa    # hf download --repo-type dataset zyzshishui0627/gpqa_diamond --local-dir /root/gpqa
      path: {d}/gpqa.jsonl
      rm_type: gpqa
      n_samples_per_eval_prompt: 2
    - name: ifbench   # hf download --repo-type dataset zyzshishui0627/IFBench --local-dir /root/ifbench
      path: {d}/ifbench.jsonl
      rm_type: ifbench
      n_samples_per_eval_prompt: 1
"""


def _argv(tmp_path, yaml_text: str, *extra: str) -> list[str]:
    for name in ("d", "aime", "gpqa", "ifbench"):
        (tmp_path / f"{name}.jsonl").write_text('{"input": "1", "label": "1"}\n')
    (tmp_path / "eval.yaml").write_text(yaml_text.format(d=tmp_path))
    (tmp_path / "config.json").write_text("{}")
    return ["--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "d.jsonl"), "--rm-type", "digit",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--eval-interval", "20", "--eval-config", str(tmp_path / "eval.yaml"), "--rollout-temperature", "0.9",
            *extra]


def test_slimes_multi_task_file_gives_each_set_its_settings(tmp_path):
    ev = build_config(_argv(tmp_path, MULTI_TASK, "--eval-top-p", "0.5")).eval
    assert ev.datasets == tuple((n, str(tmp_path / f"{n}.jsonl")) for n in ("aime", "gpqa", "ifbench"))
    # by hand: the set's value, else defaults' (top_p 0.7 beats --eval-top-p 0.5), else the flags'
    assert eval_sampling_params(ev, "aime") == {"temperature": 0.9, "top_p": 0.7, "top_k": -1,
                                                "max_new_tokens": 16384}
    assert [eval_samples_per_prompt(ev, n) for n, _ in ev.datasets] == [16, 2, 1]
    assert [ev.settings[n]["rm_type"] for n, _ in ev.datasets] == ["deepscaler", "gpqa", "ifbench"]


def test_ifbench_without_its_package_is_named_with_its_set_and_listed_for_another_cluster(tmp_path, tiny_qwen2,
                                                                                          monkeypatch):
    """gpqa is built (rewards/multiple_choice.py); ifbench needs IFBench's package (rewards/ifbench.py): here,
    where it is not importable, the run refuses naming the set and what to install; planned for another cluster
    (--cluster), the set is listed as not checked here and the plan is made."""
    import sys

    from slime_rl.rewards import ifbench

    ifbench.registry.cache_clear()
    monkeypatch.setitem(sys.modules, "ifbench", None)  # as on a machine without it
    argv = _argv(tmp_path, MULTI_TASK)
    argv[argv.index("--hf-checkpoint") + 1] = str(tiny_qwen2)
    with pytest.raises(RewardError, match=r"--eval-config dataset ifbench: --rm-type 'ifbench': --rm-type ifbench "
                                          r"needs IFBench's instruction checks, the `ifbench` package"):
        preflight(build_config(argv + ["--dry-run"]))
    _, plan = preflight(build_config(argv + ["--dry-run", "--cluster", "1x8"]))
    (note,) = [n for n in plan.notes if "ifbench" in n]
    assert note.startswith("not checked here (--cluster): --eval-config dataset ifbench: ") and \
        "(module 'ifbench' is not importable here; its functions load on the cluster)" in note


def test_mapping_form_stop_strings_and_the_flags_underneath(tmp_path):
    text = """datasets:
  math:
    path: {d}/aime.jsonl
    stop: ["</answer>"]
    temperature: 0.0
  plain:
    path: {d}/gpqa.jsonl
"""
    ev = build_config(_argv(tmp_path, text, "--n-samples-per-eval-prompt", "4", "--eval-max-response-len", "64")).eval
    assert [n for n, _ in ev.datasets] == ["math", "plain"]
    assert eval_sampling_params(ev, "math") == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 64,
                                                "stop": ["</answer>"]}
    assert eval_sampling_params(ev, "plain")["temperature"] == 0.9 and eval_samples_per_prompt(ev, "plain") == 4


@pytest.mark.parametrize("text, message", [
    ("datasets:\n  - name: a\n    path: {d}/aime.jsonl\n    custom_generate_function_path: m.f\n",
     "dataset 'a': 'custom_generate_function_path' is not a setting this trainer takes per eval set"),
    ("datasets:\n  - name: a\n    path: {d}/aime.jsonl\n    top_p: 2\n", "dataset 'a': top_p must be a number in"),
    ("eval:\n  defaults:\n    app_service: http://x\n  datasets:\n    - name: a\n      path: {d}/aime.jsonl\n",
     "defaults: 'app_service' is not a setting"),
    ("datasets:\n  - name: a\n    path: ${{oc.env:HOME}}/a.jsonl\n", "interpolation"),
    ("datasets:\n  - name: a\n", "dataset 'a' needs a `path`"),
    ("datasets:\n  - path: {d}/aime.jsonl\n", r"datasets\[0\] needs a `name`"),
    ("datasets: []\n", "`datasets` must be a non-empty list"),
    ("datasets:\n  - name: a\n    path: {d}/aime.jsonl\n    top_p: 0.5\n    top_p: 0.6\n",
     r"key 'top_p' is given twice \(lines 4 and 5\)"),
    ("datasets:\n  - name: a\n    path: {d}/missing.jsonl\n", "dataset a: file not found"),
])
def test_what_it_cannot_take_is_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        build_config(_argv(tmp_path, text))


def test_it_replaces_eval_prompt_data_with_a_note(tmp_path):
    argv = _argv(tmp_path, MULTI_TASK, "--eval-prompt-data", "other", str(tmp_path / "d.jsonl"))
    with pytest.warns(ConfigNote, match="--eval-prompt-data is not used"):
        ev = build_config(argv).eval
    assert [n for n, _ in ev.datasets] == ["aime", "gpqa", "ifbench"]
