"""slime's module paths in user functions (config/slime_imports.py): where slime is not installed, a
module written for slime imports slime's paths and gets this project's counterparts; a name without
one fails naming it; a real slime on sys.path is used instead. The import lines of slime's examples
(at slime commit 624b824, 2026-08-21) are reconstructed here as facts (module paths and names) and each
is checked to resolve. Expected results are worked out by hand from each function's rule."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slime_rl.config import slime_imports
from slime_rl.data import Sample as OurSample
from slime_rl.data.slime_compat import SlimeSample, slime_installed
from slime_rl.rollout.custom import load_filter
from slime_rl.rollout.slime_compat import SlimeFilter

ROOT = Path(__file__).resolve().parents[2]
FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"  # as slime's scripts name it

# a user module that imports every mapped name (test_the_user_module_imports_every_mapped_name checks "every")
USER_MODULE = '''
from slime.utils.types import Sample
from slime.utils.http_utils import post, get
from slime.utils.misc import load_function, SingletonMeta
from slime.utils.async_utils import run, get_async_loop
from slime.utils.processing_utils import load_tokenizer, load_processor
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std_with_fallback
from slime.rollout.sglang_rollout import GenerateState, get_model_url
from slime.rollout.rm_hub import async_rm, batched_async_rm, remote_rm, grade_answer_verl, extract_boxed_answer
from slime.rollout.rm_hub import compute_score_dapo, get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.math_utils import extract_answer, grade_answer_verl as grade_verl
from slime.rollout.rm_hub.math_dapo_utils import compute_score


def keep(args, samples, **kwargs):
    return check_reward_nonzero_std(args, samples, **kwargs)


async def rm(args, sample):
    return 1.0 if grade_answer_verl(sample.response, sample.label) else 0.0


async def group_rm(args, samples):
    return [float(len(s.response)) for s in samples]
'''

# slime's examples: file -> its `from slime ... import ...` lines (including one inside a try block)
EXAMPLES = {
    "examples/search-r1/generate_with_search.py": [
        "from slime.rollout.sglang_rollout import GenerateState", "from slime.utils.http_utils import post",
        "from slime.utils.types import Sample"],
    "examples/retool/generate_with_retool.py": [
        "from slime.rollout.sglang_rollout import GenerateState", "from slime.utils.http_utils import post",
        "from slime.utils.types import Sample",
        "from slime.rollout.rm_hub.math_dapo_utils import compute_score as math_dapo_compute_score"],
    "examples/tau-bench/trainable_agents.py": [
        "from slime.rollout.sglang_rollout import GenerateState", "from slime.utils.http_utils import post"],
    "examples/tau-bench/generate_with_tau.py": ["from slime.utils.types import Sample"],
    "examples/strands_sglang/generate_with_strands.py": [
        "from slime.rollout.rm_hub.math_dapo_utils import compute_score as math_dapo_compute_score",
        "from slime.rollout.sglang_rollout import GenerateState", "from slime.utils.types import Sample"],
    "examples/multi_agent/agent_system.py": [
        "from slime.rollout.rm_hub import batched_async_rm", "from slime.utils.http_utils import post",
        "from slime.utils.types import Sample"],
    "examples/multi_agent/rollout_with_multi_agents.py": [
        "from slime.utils.misc import load_function", "from slime.utils.types import Sample"],
    "examples/geo3k_vlm_multi_turn/env_geo3k.py": [
        "from slime.rollout.rm_hub import grade_answer_verl",
        "from slime.rollout.rm_hub.math_utils import extract_answer as extract_boxed_answer",
        "from slime.utils.types import Sample"],
}
# lines of slime's examples without a counterpart -> (the name the error gives, words of what it says to do)
NO_COUNTERPART = {
    "from slime.utils.processing_utils import build_processor_kwargs, encode_image_for_rollout_engine":
        ("'build_processor_kwargs'", "text tokens only"),  # examples/geo3k_vlm_multi_turn/rollout.py
    "from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter": ("'slime.agent'", "agent harness"),
    "from slime.utils.misc import SingletonMeta, exec_command": ("'exec_command'", "load_function, SingletonMeta"),
    "from slime.backends.megatron_utils.cp_utils import all_gather_with_cp": ("'slime.backends'", "slime_rl.trainer"),
    "from slime.rollout.sft_rollout import generate_rollout": ("'slime.rollout.sft_rollout'",
                                                               "--custom-generate-function-path"),
}


@pytest.fixture
def fresh():
    """No slime module imported and no finder installed; the state before is restored after."""
    saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "slime"}
    meta_path, path = list(sys.meta_path), list(sys.path)
    for name in saved:
        del sys.modules[name]
    slime_imports.uninstall()
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "slime"]:
        del sys.modules[name]
    sys.modules.update(saved)
    sys.meta_path[:], sys.path[:] = meta_path, path


def _user_module(tmp_path: Path) -> Path:
    path = tmp_path / "user_fns.py"
    path.write_text(USER_MODULE)
    return path


def _group(*rewards) -> list[OurSample]:
    return [OurSample(index=i, group_index=0, prompt="p", prompt_ids=[1], response=f"r{i}", response_ids=[2],
                      rollout_logprobs=[-0.1], loss_mask=[1], finish_reason="stop", reward=r)
            for i, r in enumerate(rewards)]


def test_slimes_filter_path_as_the_scripts_name_it(fresh):
    keep = load_filter(FILTER)  # the load installs the stand-ins
    assert isinstance(keep, SlimeFilter)
    assert keep(_group(1.0, 0.0, 1.0, 1.0)) is True
    assert keep(_group(0.5, 0.5, 0.5, 0.5)) is False
    assert keep(_group(1.0)) is False  # one sample: no sample standard deviation, dropped as slime drops it


def test_a_user_module_importing_every_mapped_path_loads_and_works(fresh, tmp_path):
    path = _user_module(tmp_path)
    keep = load_filter(f"{path}:keep")
    assert keep(_group(1.0, 0.0)) is True and keep(_group(1.0, 1.0)) is False
    mod = sys.modules[keep.fn.__module__]
    args = argparse.Namespace(reward_key=None, rm_type="math", custom_rm_path=None, sglang_router_ip="127.0.0.1",
                              sglang_router_port=8123)
    out = mod.check_reward_nonzero_std(args, [SlimeSample(reward=0.5)] * 3)
    assert (out.keep, out.reason) == (False, "zero_std_0.5")
    assert mod.check_reward_nonzero_std_with_fallback(args, [SlimeSample(reward=0.5)] * 3).keep_when_insufficient
    assert mod.Sample is SlimeSample and mod.Sample.Status.COMPLETED.value == "completed"
    assert mod.grade_answer_verl("so \\boxed{\\frac{1}{2}}", "0.5") and mod.grade_verl("\\boxed{4}", "\\boxed{4}")
    assert not mod.grade_answer_verl("\\boxed{3}", "4") and not mod.grade_answer_verl("3", "3")  # no box: False
    assert mod.extract_answer("a \\boxed{x+1} b") == "x+1" and mod.extract_boxed_answer("none") is None
    assert mod.compute_score("Reasoning.\nAnswer: 34", "34") == {"score": 1.0, "acc": True, "pred": "34"}
    assert mod.compute_score_dapo("Answer: 35", "34")["score"] == -1.0
    assert mod.compute_score("so \\boxed{34}", "34", strict_box_verify=True)["acc"] is True
    far = "\\boxed{34}" + " filler" * 20  # the box is more than 100 characters before the end
    assert mod.compute_score(far, "34", strict_box_verify=True) == {"score": -1.0, "acc": False, "pred": None}
    assert mod.get_deepscaler_rule_based_reward("<think>x</think> \\boxed{2}", "2") == 1.0
    assert mod.get_model_url(args, "ref") == "http://127.0.0.1:8123/generate"
    sample = SlimeSample(response="\\boxed{2}", label="2", tokens=[1, 2], response_length=1)
    assert mod.run(mod.async_rm(args, sample)) == 1.0
    assert mod.run(mod.batched_async_rm(args, [sample, SlimeSample(response="\\boxed{3}", label="2")])) == [1.0, 0.0]
    group_args = argparse.Namespace(**vars(args) | {"custom_rm_path": f"{path}:group_rm"})
    assert mod.run(mod.batched_async_rm(group_args, [SlimeSample(response="ab"), SlimeSample(response="c")])) == [
        2.0, 1.0]
    with pytest.raises(NotImplementedError, match="Rule-based RM for nope is not implemented"):
        mod.run(mod.async_rm(argparse.Namespace(**vars(args) | {"rm_type": "nope"}), sample))
    gpqa = argparse.Namespace(**vars(args) | {"rm_type": "gpqa"})  # --rm-type gpqa's rule: the picked letter
    assert mod.run(mod.async_rm(gpqa, SlimeSample(response="The answer is C", label="C"))) == 1.0
    assert mod.get_async_loop() is mod.get_async_loop()

    class One(metaclass=mod.SingletonMeta):
        pass

    assert One() is One()


def test_the_user_module_imports_every_mapped_name():
    imported = {(node.module, a.name) for node in ast.walk(ast.parse(USER_MODULE))
                if isinstance(node, ast.ImportFrom) for a in node.names}
    mapped = {(m, name) for m, spec in slime_imports.MODULES.items() for name in spec.names}
    assert imported == mapped


def test_generate_state_reads_the_checkpoint_and_the_runs_flags(fresh, tiny_qwen2, tmp_path):
    from transformers import AutoTokenizer

    from slime_rl.config import build_config
    from slime_rl.config.slime_args import slime_args

    slime_imports.install()
    from slime.rollout.sglang_rollout import GenerateState

    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    cfg = build_config(["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(tmp_path / "d.jsonl"),
                        "--rollout-batch-size", "1", "--num-rollout", "1", "--rm-type", "digit",
                        "--rollout-max-response-len", "12", "--rollout-temperature", "0.7", "--rollout-stop", "\n",
                        "--sglang-server-concurrency", "5", "--rollout-num-gpus", "2"])
    try:
        state = GenerateState(slime_args(cfg))
        assert GenerateState(None) is state  # one per process, as slime's
        tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
        assert state.tokenizer("a b", add_special_tokens=False)["input_ids"] == tokenizer.encode(
            "a b", add_special_tokens=False)
        assert state.processor is None  # a text model
        assert (state.sampling_params["max_new_tokens"], state.sampling_params["temperature"],
                state.sampling_params["stop"], state.sampling_params["no_stop_trim"]) == (12, 0.7, ["\n"], True)
        assert state.semaphore._value == 5 * 2  # per engine x two one-GPU engines
        with state.dp_rank_context() as rank:
            assert rank == 0 and state.dp_counts == [1]
        assert state.dp_counts == [0]
    finally:
        type(GenerateState).clear_instances(GenerateState)


@pytest.mark.parametrize("line", [line for lines in EXAMPLES.values() for line in lines])
def test_the_import_lines_of_slimes_examples_resolve(fresh, line):
    slime_imports.install()
    scope: dict = {}
    exec(line, scope)
    names = [a.asname or a.name for a in ast.parse(line).body[0].names]
    assert all(scope[n] is not None for n in names)


@pytest.mark.parametrize("line", list(NO_COUNTERPART))
def test_a_name_without_a_counterpart_is_a_named_import_error(fresh, line):
    slime_imports.install()
    name, instead = NO_COUNTERPART[line]
    with pytest.raises(ImportError) as info:
        exec(line, {})
    assert name in str(info.value) and instead in str(info.value) and "docs/migration.md" in str(info.value)


def test_a_real_slime_on_the_path_is_used_instead(fresh, tmp_path):
    real = tmp_path / "site" / "slime"
    (real / "utils").mkdir(parents=True)
    (real / "__init__.py").write_text("")
    (real / "utils" / "__init__.py").write_text("")
    (real / "utils" / "types.py").write_text("Sample = 'the real one'\n")
    sys.path.insert(0, str(tmp_path / "site"))
    assert slime_imports.install() is False and slime_imports.FINDER not in sys.meta_path
    assert slime_installed()
    from slime.utils.types import Sample

    assert Sample == "the real one"
    with pytest.raises(ModuleNotFoundError, match="No module named 'slime.rollout'$"):
        import slime.rollout  # noqa: F401  (the real package has none: Python's own error, not ours)


def test_the_finder_installed_first_still_yields_to_a_real_slime(fresh, tmp_path):
    slime_imports.install()
    (tmp_path / "site" / "slime").mkdir(parents=True)
    (tmp_path / "site" / "slime" / "__init__.py").write_text("REAL = True\n")
    sys.path.insert(0, str(tmp_path / "site"))
    import slime

    assert slime.REAL and slime_installed()


def test_a_fresh_process_gets_the_stand_ins_from_the_load_itself(tmp_path):
    """The RolloutManager actor loads the functions in its own process: the load installs the finder there."""
    code = textwrap.dedent(f"""
        import sys
        from slime_rl.data import Sample
        from slime_rl.rollout.custom import load_filter
        assert "slime" not in sys.modules
        keep = load_filter({FILTER!r})
        group = [Sample(index=i, group_index=0, prompt="p", prompt_ids=[1], reward=r) for i, r in enumerate((1.0, 0.0))]
        print(keep(group), sys.modules["slime"].__slime_rl_shim__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]

