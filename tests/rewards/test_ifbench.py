"""--rm-type ifbench (rewards/ifbench.py) against a stand-in of IFBench's `ifbench` package
(tests/rewards/ifbench_fake: two instructions with IFBench's interface; IFBench itself is installed from GitHub,
which CI cannot reach). Expected rewards are worked out by hand from the stand-in's two rules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slime_rl.data import Sample
from slime_rl.rewards import RewardError, make_reward_fn
from slime_rl.rewards import ifbench as ifb
from slime_rl.rewards.builtin import BUILTIN
from slime_rl.rewards.slime_rm_hub import async_rm

FAKE = Path(__file__).parent / "ifbench_fake"
NONE_KWARGS = {"keyword": None, "times": None, "N": None, "prompt_to_repeat": None}  # IFBench rows name every key


def _drop_ifbench() -> None:
    ifb.registry.cache_clear()
    for name in [m for m in sys.modules if m == "ifbench" or m.startswith("ifbench.")]:
        del sys.modules[name]


@pytest.fixture
def fake_ifbench(monkeypatch):
    _drop_ifbench()
    monkeypatch.syspath_prepend(str(FAKE))
    yield
    _drop_ifbench()


@pytest.fixture
def no_ifbench(monkeypatch):
    _drop_ifbench()
    monkeypatch.setitem(sys.modules, "ifbench", None)  # import ifbench raises ImportError
    yield
    _drop_ifbench()


def _sample(response: str, **meta) -> Sample:
    return Sample(index=0, group_index=0, prompt="p", prompt_ids=[1], response=response, label=None, metadata=meta)


def test_every_instruction_followed_scores_one_else_zero(fake_ifbench):
    ids = ["test:keyword_times", "test:repeat_prompt"]
    kwargs = [{**NONE_KWARGS, "keyword": "owl", "times": 2}, NONE_KWARGS]  # None values dropped, as IFBench does
    meta = {"instruction_id_list": ids, "kwargs": kwargs, "prompt_text": "Name a bird.", "record_id": 3}
    fn = BUILTIN["ifbench"]
    assert fn(_sample("Name a bird. owl and owl", **meta)) == 1.0  # starts with the prompt, 'owl' twice
    assert fn(_sample("Name a bird. owl", **meta)) == 0.0  # 'owl' once
    assert fn(_sample("owl owl", **meta)) == 0.0  # does not repeat the prompt
    assert fn(_sample("   ", **{**meta, "instruction_id_list": ["test:keyword_times"],
                                "kwargs": [{"keyword": "owl", "times": 0}]})) == 0.0  # blank: never followed
    assert fn(_sample("Name a bird.", instruction_id_list=[])) == 0.0  # no instructions: 0, as slime


def test_kwargs_forms(fake_ifbench):
    """One dict for every instruction; a short list padded with its last entry; none: empty arguments."""
    assert ifb.instruction_kwargs({"keyword": "a", "times": None}, 2) == [{"keyword": "a"}, {"keyword": "a"}]
    assert ifb.instruction_kwargs([{"keyword": "a"}, "junk"], 3) == [{"keyword": "a"}, {}, {}]
    assert ifb.instruction_kwargs([{"times": 2}], 2) == [{"times": 2}, {"times": 2}]
    assert ifb.instruction_kwargs([{"times": 2}, {"times": 3}], 1) == [{"times": 2}]
    assert ifb.instruction_kwargs(None, 2) == [{}, {}]
    # a single dict for two keyword instructions: 'x' once each
    meta = {"instruction_id_list": ["test:keyword_times", " test:keyword_times "], "kwargs": {"keyword": "x"}}
    assert BUILTIN["ifbench"](_sample("x y", **meta)) == 1.0


def test_rows_are_checked_up_front(fake_ifbench):
    ifb.check_rows([{"instruction_id_list": ["test:repeat_prompt"]}], [None])
    with pytest.raises(ValueError, match=r"row 1: metadata\['instruction_id_list'\] is missing or empty"):
        ifb.check_rows([{"instruction_id_list": ["test:repeat_prompt"]}, {}], [None, None])
    with pytest.raises(ValueError, match=r"row 0: instruction ids \['count:nope'\] are not in IFBench's registry "
                                         r"\(the installed ifbench package has 2\)"):
        ifb.check_rows([{"instruction_id_list": ["count:nope"]}], [None])


def test_slimes_rm_hub_dispatches_to_it(fake_ifbench):
    """A slime function calling rm_hub's async_rm with rm_type ifbench gets IFBench's 1.0 / 0.0."""
    import argparse
    import asyncio

    from slime_rl.data.slime_compat import slime_sample_class

    cls = slime_sample_class()
    meta = {"instruction_id_list": ["test:keyword_times"], "kwargs": [{"keyword": "ok"}]}
    args = argparse.Namespace(custom_rm_path=None, rm_type="ifbench")
    assert asyncio.run(async_rm(args, cls(response="ok fine", metadata=meta))) == 1.0
    assert asyncio.run(async_rm(args, cls(response="fine", metadata=meta))) == 0.0


def test_without_the_package_the_reward_refuses_naming_what_to_install(no_ifbench):
    with pytest.raises(RewardError, match=r"--rm-type 'ifbench': --rm-type ifbench needs IFBench's instruction "
                                          r"checks, the `ifbench` package.*pip install 'git\+https://github.com/"
                                          r"allenai/IFBench'"):
        make_reward_fn("ifbench", None)
