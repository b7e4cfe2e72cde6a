"""PromptDataset: chat templates (message lists, tools, template kwargs), metadata, filtering, bad rows."""

from __future__ import annotations

import pytest

from slime_rl.config import DataConfig
from slime_rl.data import DataError, PromptDataset, num_rollout_for_epochs, parse_chat_template_kwargs, write_records

CHATML_SYS_USER = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                   "<|im_start|>assistant\n")
# the tiny template with two additions, so the test can see what reached the template
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ '\n' }}{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}NO_THINK{{ '\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CALC_TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


class CharTokenizer:
    """One token per character, so prompt lengths can be counted by hand."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2)


@pytest.fixture()
def tools_tok(tiny_qwen2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def test_message_list_gets_the_chatml_template(tmp_path, qwen_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    f = write_records([{"prompt": msgs, "label": "4"}], tmp_path / "d.parquet")
    cfg = DataConfig(prompt_data=str(f), input_key="prompt", apply_chat_template=True)
    row = PromptDataset(cfg, qwen_tok).rows[0]
    assert row.prompt == CHATML_SYS_USER
    assert row.prompt_ids == qwen_tok(CHATML_SYS_USER, add_special_tokens=False)["input_ids"]
    assert row.label == "4" and row.metadata == {}


def test_string_prompt_becomes_one_user_message(tmp_path, qwen_tok):
    f = write_records([{"input": "hi", "label": 1}], tmp_path / "d.jsonl")
    row = PromptDataset(DataConfig(prompt_data=str(f), apply_chat_template=True), qwen_tok).rows[0]
    assert row.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tools_and_template_kwargs_reach_the_template(tmp_path, tools_tok):
    rows = [{"input": "add", "label": "3", "tools": [CALC_TOOL]},
            {"input": "plain", "label": "0", "tools": None}]
    f = write_records(rows, tmp_path / "d.jsonl")
    cfg = DataConfig(prompt_data=str(f), apply_chat_template=True)
    ds = PromptDataset(cfg, tools_tok, tool_key="tools", chat_template_kwargs='{"enable_thinking": false}')
    assert ds.rows[0].prompt == "TOOLS:calculator;\nNO_THINK\n<|im_start|>user\nadd<|im_end|>\n<|im_start|>assistant\n"
    assert ds.rows[0].metadata == {"tools": [CALC_TOOL]}
    assert ds.rows[1].prompt == "NO_THINK\n<|im_start|>user\nplain<|im_end|>\n<|im_start|>assistant\n"
    assert ds.rows[1].metadata == {}
    plain = PromptDataset(cfg, tools_tok)  # without the kwargs the template thinks and sees no tools
    assert plain.rows[0].prompt == "<|im_start|>user\nadd<|im_end|>\n<|im_start|>assistant\n"
    assert plain.rows[0].metadata == {"tools": [CALC_TOOL]}  # an unnamed column stays metadata


def test_metadata_key_merges_a_dict_column_into_the_other_columns(tmp_path):
    rows = [{"input": "a", "label": "1", "source": "s1", "extra": {"rm_type": "f1", "level": 2}},
            {"input": "b", "label": "2", "source": "s2", "extra": '{"rm_type": "math"}'},
            {"input": "c", "label": "3", "source": "s3"}]
    f = write_records(rows, tmp_path / "d.jsonl")
    ds = PromptDataset(DataConfig(prompt_data=str(f)), CharTokenizer(), metadata_key="extra")
    assert [r.metadata for r in ds.rows] == [{"source": "s1", "rm_type": "f1", "level": 2},
                                             {"source": "s2", "rm_type": "math"}, {"source": "s3"}]


def test_length_filter_counts_dropped_prompts(tmp_path):
    # lengths by hand: "ab" 2, "abcd" 4, "abcdef" 6, "abc" 3
    f = write_records([{"input": s, "label": i} for i, s in enumerate(["ab", "abcd", "abcdef", "abc"])],
                      tmp_path / "d.jsonl")
    ds = PromptDataset(DataConfig(prompt_data=str(f), rollout_max_prompt_len=3), CharTokenizer())
    assert [r.label for r in ds.rows] == [0, 3] and ds.filtered_too_long == 2
    ds = PromptDataset(DataConfig(prompt_data=str(f), rollout_max_prompt_len=4), CharTokenizer())
    assert [r.label for r in ds.rows] == [0, 1, 3] and ds.filtered_too_long == 1
    with pytest.raises(DataError, match="every row is longer than --rollout-max-prompt-len"):
        PromptDataset(DataConfig(prompt_data=str(f), rollout_max_prompt_len=1), CharTokenizer())


def test_slice_spec_in_prompt_data(tmp_path):
    f = write_records([{"input": str(i), "label": i} for i in range(10)], tmp_path / "d.json")
    ds = PromptDataset(DataConfig(prompt_data=f"{f}@[-3:]"), CharTokenizer())
    assert [r.label for r in ds.rows] == [7, 8, 9]


def test_every_bad_row_is_reported_with_its_line(tmp_path, qwen_tok):
    rows = [
        {"input": "fine", "label": "0"},                          # 1
        {"input": "no label"},                                    # 2
        {"input": "   ", "label": "1"},                           # 3 empty prompt
        {"input": 42, "label": "1"},                              # 4 wrong type
        {"input": [], "label": "1"},                              # 5 empty message list
        {"input": [{"role": "user"}], "label": "1"},              # 6 message without content
        {"input": [{"role": "user", "content": ""}], "label": 1},  # 7 all contents empty
        {"label": "1"},                                           # 8 no input
    ]
    f = write_records(rows, tmp_path / "bad.jsonl")
    with pytest.raises(DataError) as err:
        PromptDataset(DataConfig(prompt_data=str(f), apply_chat_template=True), qwen_tok)
    msg = str(err.value)
    assert "bad.jsonl: 7 bad row(s) of 8" in msg
    assert "line 1:" not in msg
    assert "line 2: missing key 'label' (--label-key)" in msg
    assert "line 3: 'input' is an empty prompt" in msg
    assert "line 4: 'input' must be a string or a message list, got int" in msg
    assert "line 5: 'input' is an empty message list" in msg
    assert "line 6: 'input': message 0 must be an object with 'role' and 'content'" in msg
    assert "line 7: 'input': every message has empty content" in msg
    assert "line 8: missing key 'input' (--input-key)" in msg


def test_message_list_without_chat_template_and_bad_metadata_are_row_errors(tmp_path):
    f = write_records([{"input": [{"role": "user", "content": "x"}], "label": 1}], tmp_path / "m.jsonl")
    with pytest.raises(DataError, match=r"line 1: 'input' is a message list, which needs --apply-chat-template"):
        PromptDataset(DataConfig(prompt_data=str(f)), CharTokenizer())
    f = write_records([{"input": "x", "label": 1, "meta": [1, 2]}], tmp_path / "b.jsonl")
    with pytest.raises(DataError, match=r"line 1: 'meta' \(--metadata-key\) must be a dict, got list"):
        PromptDataset(DataConfig(prompt_data=str(f)), CharTokenizer(), metadata_key="meta")


def test_many_bad_rows_are_summarised(tmp_path):
    f = write_records([{"input": "", "label": i} for i in range(25)], tmp_path / "d.jsonl")
    with pytest.raises(DataError, match=r"25 bad row\(s\) of 25(.|\n)*line 10: (.|\n)*and 15 more") as err:
        PromptDataset(DataConfig(prompt_data=str(f)), CharTokenizer())
    assert "line 11:" not in str(err.value)


def test_shuffle_is_a_new_permutation_each_epoch(tmp_path):
    f = write_records([{"input": str(i), "label": i} for i in range(8)], tmp_path / "d.jsonl")
    ds = PromptDataset(DataConfig(prompt_data=str(f), rollout_shuffle=True, seed=5), CharTokenizer())
    epochs = [[r.label for r in ds.next_batch(8)] for _ in range(3)]
    assert all(sorted(e) == list(range(8)) for e in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    unshuffled = PromptDataset(DataConfig(prompt_data=str(f)), CharTokenizer())
    assert [r.label for r in unshuffled.next_batch(10)] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]


def test_num_rollout_for_epochs():
    assert num_rollout_for_epochs(100, 32, 1) == 3  # the partial 4th batch is left out
    assert num_rollout_for_epochs(100, 32, 2) == 6
    assert num_rollout_for_epochs(96, 32, 3) == 9
    with pytest.raises(ValueError, match="--rollout-batch-size 32"):
        num_rollout_for_epochs(10, 32, 1)
    with pytest.raises(ValueError, match="--num-epoch"):
        num_rollout_for_epochs(10, 2, 0)


def test_chat_template_kwargs_parsing():
    assert parse_chat_template_kwargs('{"enable_thinking": true}') == {"enable_thinking": True}
    assert parse_chat_template_kwargs(None) == {} and parse_chat_template_kwargs({"a": 1}) == {"a": 1}
    with pytest.raises(DataError, match="--apply-chat-template-kwargs"):
        parse_chat_template_kwargs("[1]")
    with pytest.raises(DataError, match="not valid JSON"):
        parse_chat_template_kwargs("{enable_thinking}")


def test_format_prompt_renders_each_prompt_before_the_template(tmp_path, qwen_tok):
    tpl = tmp_path / "fmt.jinja"
    tpl.write_text("{{ content | trim }} Put the answer in \\boxed{}.")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " What is 2+2? "}]
    f = write_records([{"input": "  hi ", "label": 1}, {"input": msgs, "label": 4}], tmp_path / "d.jsonl")
    rows = PromptDataset(DataConfig(prompt_data=str(f), apply_chat_template=True, format_prompt=str(tpl)),
                         qwen_tok).rows
    assert rows[0].prompt == "<|im_start|>user\nhi Put the answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    assert rows[1].prompt == CHATML_SYS_USER.replace("What is 2+2?", "What is 2+2? Put the answer in \\boxed{}.")


def test_format_prompt_errors_name_the_flag_or_the_row(tmp_path, qwen_tok):
    f = write_records([{"input": "hi", "label": 1}], tmp_path / "d.jsonl")
    with pytest.raises(DataError, match="--format-prompt .*missing.jinja"):
        PromptDataset(DataConfig(prompt_data=str(f), format_prompt=str(tmp_path / "missing.jinja")), qwen_tok)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ content ")
    with pytest.raises(DataError, match="not a valid jinja2 template"):
        PromptDataset(DataConfig(prompt_data=str(f), format_prompt=str(bad)), qwen_tok)
    undefined = tmp_path / "undefined.jinja"
    undefined.write_text("{{ content }} {{ question }}")
    with pytest.raises(DataError, match="line 1: --format-prompt failed.*question"):
        PromptDataset(DataConfig(prompt_data=str(f), format_prompt=str(undefined)), qwen_tok)


def test_prompts_the_engine_would_refuse_are_bad_rows(tmp_path):
    from slime_rl.data import TokenLimit

    # one token per character: "abcdef" is 6 tokens. Context 10, 4 left for the response: a prompt may
    # have 6 tokens (6 + 4 = 10, SGLang's limit is inclusive), not 7
    rows = [{"input": "abcdef", "label": 1}, {"input": "abcdefg", "label": 2}, {"input": "x" * 30, "label": 3}]
    f = write_records(rows, tmp_path / "long.jsonl")
    limit = TokenLimit(context_len=10, reserve=4, source="max_position_embeddings of m")
    with pytest.raises(DataError) as err:
        PromptDataset(DataConfig(prompt_data=str(f)), CharTokenizer(), token_limit=limit)
    msg = str(err.value)
    assert "2 bad row(s) of 3" in msg and "line 1:" not in msg
    assert "line 2: the prompt has 7 tokens" in msg and "context of 10 (max_position_embeddings of m)" in msg
    assert "--rollout-max-prompt-len 6" in msg  # the flag that drops them instead
    # dropping them by --rollout-max-prompt-len is what the message says: then the rest load
    ds = PromptDataset(DataConfig(prompt_data=str(f), rollout_max_prompt_len=6), CharTokenizer(), token_limit=limit)
    assert [r.label for r in ds.rows] == [1] and ds.filtered_too_long == 2
    # a response cap (--rollout-max-context-len) leaves the prompt all but one token
    ds = PromptDataset(DataConfig(prompt_data=f"{f}@[:2]"), CharTokenizer(), token_limit=TokenLimit(10, 1, "c"))
    assert [r.label for r in ds.rows] == [1, 2]
