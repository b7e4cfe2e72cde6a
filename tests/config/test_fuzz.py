"""Fuzzing the two doors bad input comes through, seeded: prompt files (readers + PromptDataset)
and configs (flags + YAML, build_config).

Each data case is a small file of good rows with ONE malformed row at a random position (or a
malformed file/slice): loading must raise `DataError` and nothing else, and the message must name
that row's number (or the file, for file-level faults). Each config case corrupts one flag, one
pair of flags or one YAML key of a valid command line: `build_config` must raise `ConfigError`
and nothing else, naming the flag (or the --config file and key). Random type confusions in YAML
may also be accepted, but never crash with another exception type.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from slime_rl.config import ConfigError, DataConfig, build_config
from slime_rl.data import DataError, PromptDataset

SEED = 20261130
N_DATA_CASES = 1300  # about 1050 malformed rows, the rest malformed files and slices
N_CONFIG_CASES = 500


def good_row(rng: random.Random) -> dict:
    return {"input": "add " + " ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(1, 5))),
            "label": str(rng.randint(0, 40))}


def _msg_list_fault(rng: random.Random) -> list:
    return rng.choice([[1, 2], [{"role": "user"}], [{"content": "x"}], [{"role": 3, "content": "x"}],
                       [{"role": "user", "content": 7}], [{"role": "user", "content": "  "}], ["hello"],
                       [{"role": "user", "content": "fine"}, None]])


# row faults: (name, make(row, rng) -> row or raw line). Every one is an error at load.
ROW_FAULTS = {
    "missing_input": lambda r, g: {k: v for k, v in r.items() if k != "input"},
    "missing_label": lambda r, g: {k: v for k, v in r.items() if k != "label"},
    "input_wrong_type": lambda r, g: r | {"input": g.choice([0, 1.5, None, True, {"a": 1}, -7])},
    "empty_prompt": lambda r, g: r | {"input": g.choice(["", " ", "\n\t", "   \n"])},
    "empty_messages": lambda r, g: r | {"input": []},
    "bad_messages": lambda r, g: r | {"input": _msg_list_fault(g)},
    "messages_without_template": lambda r, g: r | {"input": [{"role": "user", "content": "hi"}]},
    "bad_metadata": lambda r, g: r | {"meta": g.choice([[1], 3, "not json {", "[1, 2]", True])},
    "bad_tools": lambda r, g: r | {"tools": g.choice([{"a": 1}, 3, "nope", '{"a": 1}'])},
    "bad_json_line": lambda r, g: json.dumps(r)[: g.randint(1, len(json.dumps(r)) - 1)],
    "not_an_object": lambda r, g: json.dumps(g.choice([[1, 2], 3, "text", None, True])),
    "bad_utf8": lambda r, g: b'{"input": "\xff\xfe", "label": "1"}',
    "deep_nesting": lambda r, g: '{"input": "x", "label": ' + "[" * 100000 + "]" * 100000 + "}",
}
FILE_FAULTS = ("empty_file", "bad_slice", "empty_slice", "unknown_suffix", "missing_file", "json_not_list",
               "json_bad", "parquet_corrupt", "all_too_long")


def write_jsonl(path: Path, lines: list) -> None:
    data = b"".join((x if isinstance(x, bytes) else (x if isinstance(x, str) else json.dumps(x)).encode()) + b"\n"
                    for x in lines)
    path.write_bytes(data)


def data_config(path: str, **kw) -> DataConfig:
    return DataConfig(prompt_data=path, metadata_key="meta", tool_key="tools", **kw)


def file_case(kind: str, tmp: Path, rng: random.Random) -> tuple[str, dict]:
    rows = [good_row(rng) for _ in range(rng.randint(1, 5))]
    path = tmp / "d.jsonl"
    write_jsonl(path, rows)
    if kind == "empty_file":
        path.write_text(rng.choice(["", "\n\n", "  \n"]))
        return str(path), {}
    if kind == "bad_slice":
        return str(path) + rng.choice(["@[1:2:3]", "@[a:b]", "@[1.5:]", "@[", "@[::]", "@[x]"]), {}
    if kind == "empty_slice":
        return str(path) + rng.choice([f"@[{len(rows)}:]", "@[3:1]", "@[100:200]", "@[:0]"]), {}
    if kind == "unknown_suffix":
        other = tmp / rng.choice(["d.csv", "d.txt", "d", "d.jsonl.gz"])
        other.write_text("x")
        return str(other), {}
    if kind == "missing_file":
        return str(tmp / "nope" / "d.jsonl"), {}
    if kind == "json_not_list":
        p = tmp / "d.json"
        p.write_text(json.dumps(rng.choice([{"rows": rows}, 3, "x", {"data": "x"}])))
        return str(p), {}
    if kind == "json_bad":
        p = tmp / "d.json"
        p.write_text(json.dumps(rows)[:-1])
        return str(p), {}
    if kind == "parquet_corrupt":
        p = tmp / "d.parquet"
        p.write_bytes(rng.randbytes(rng.randint(0, 64)))
        return str(p), {}
    assert kind == "all_too_long"
    write_jsonl(path, [r | {"input": "9 " * 200} for r in rows])
    return str(path), {"rollout_max_prompt_len": 8}


def test_malformed_data_raises_data_error_naming_the_row(tiny_qwen2, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen2))
    rng = random.Random(SEED)
    seen: dict[str, int] = {}
    for case in range(N_DATA_CASES):
        if rng.random() < 0.2:  # file-level faults: the message names the file (or the slice)
            kind = rng.choice(FILE_FAULTS)
            spec, extra = file_case(kind, tmp_path, rng)
            with pytest.raises(DataError) as info:
                PromptDataset(data_config(spec, **extra), tokenizer)
            assert spec.split("@[")[0] in str(info.value) or spec in str(info.value), (kind, str(info.value))
        else:
            kind = rng.choice(sorted(ROW_FAULTS))
            rows: list = [good_row(rng) for _ in range(rng.randint(0, 6))]
            bad = rng.randint(0, len(rows))
            rows.insert(bad, ROW_FAULTS[kind](good_row(rng), rng))
            # sometimes a huge but well-formed prompt too: with the cap it is dropped, not an error
            if rng.random() < 0.3:
                rows.append(good_row(rng) | {"input": "7 " * rng.randint(300, 3000)})
            raw_line = isinstance(rows[bad], (str, bytes))
            suffix = "jsonl" if raw_line else rng.choice(["jsonl", "json"] + ([] if "missing" in kind else ["parquet"]))
            path = tmp_path / f"d.{suffix}"
            if suffix == "jsonl":
                write_jsonl(path, rows)
            elif suffix == "json":
                path.write_text(json.dumps(rows))
            else:
                from slime_rl.data import write_records

                keys = sorted({k for r in rows for k in r})  # pyarrow takes the schema from the first row
                try:
                    write_records([{k: r.get(k) for k in keys} for r in rows], path)
                except Exception:  # pyarrow cannot store mixed column types: use jsonl for this case
                    path = tmp_path / "d.jsonl"
                    write_jsonl(path, rows)
            spec = str(path)
            first = 1
            if rng.random() < 0.2 and bad > 0:  # a slice that keeps the bad row: numbers stay file rows
                first = rng.randint(1, bad + 1)
                spec += f"@[{first - 1}:]"
            with pytest.raises(DataError) as info:
                PromptDataset(data_config(spec, rollout_max_prompt_len=256), tokenizer)
            message = str(info.value)
            where = "line" if path.suffix == ".jsonl" else "row"  # no blank lines: line N holds row N
            assert f"{where} {bad + 1}" in message, (case, kind, message[:300])
        seen[kind] = seen.get(kind, 0) + 1
    assert set(seen) == set(ROW_FAULTS) | set(FILE_FAULTS)  # every fault kind was exercised
    assert sum(seen[k] for k in ROW_FAULTS) >= 1000


def test_huge_prompts_are_dropped_and_counted_not_fatal(tiny_qwen2, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen2))
    rng = random.Random(SEED + 1)
    rows = [good_row(rng) for _ in range(20)]
    huge = sorted(rng.sample(range(20), 7))
    for k in huge:
        rows[k]["input"] = "5 " * 5000
    path = tmp_path / "d.jsonl"
    write_jsonl(path, rows)
    ds = PromptDataset(data_config(str(path), rollout_max_prompt_len=64), tokenizer)
    assert ds.filtered_too_long == 7 and len(ds) == 13


# ---------------------------------------------------------------- configs

INVALID_VALUES = {  # flag -> values that must be refused
    "--rollout-batch-size": ["0", "-3", "abc", "1.5", ""],
    "--n-samples-per-prompt": ["0", "x", "-1"],
    "--micro-batch-size": ["0", "2.0", "nan"],
    "--tensor-model-parallel-size": ["0", "-2", "two"],
    "--rollout-max-response-len": ["0", "-5"],
    "--eps-clip": ["0", "1", "-0.1", "nan", "x"],
    "--lr": ["0", "-1e-5", "nan", "fast"],
    "--rollout-temperature": ["0", "-1", "nan"],
    "--gamma": ["0", "1.5", "nan"],
    "--adam-beta1": ["1", "-0.1", "nan"],
    "--min-lr": ["-1", "1"],
    "--eps-clip-c": ["0.5", "1"],
    "--tis-clip": ["0", "-1"],
    "--reward-failure-value": ["nan", "inf", "-inf", "zero"],
    "--rollout-health-check-interval": ["0", "-1", "inf", "nan"],
    "--rollout-health-check-timeout": ["0", "x"],
    "--advantage-estimator": ["ppo2", "GRPO", ""],
    "--loss-agg-mode": ["mean", "token_mean"],
    "--optimizer": ["lamb"],
    "--rollout-backend": ["vllm"],
    "--kl-loss-type": ["k9"],
    "--overlong-buffer-len": ["-1", "100000"],
    "--rm-max-retries": ["-1", "many"],
}
CONTRADICTIONS = [  # extra argv -> flags the message may name (one of them)
    (["--num-epoch", "2"], ["--num-rollout", "--num-epoch"]),
    (["--save-interval", "2"], ["--save-interval"]),
    (["--keep-last", "2"], ["--keep-last"]),
    (["--mask-offpolicy-in-partial-rollout"], ["--mask-offpolicy-in-partial-rollout"]),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
      "--no-pack-sequences"], ["--sequence-parallel"]),
    (["--use-dynamic-batch-size"], ["--use-dynamic-batch-size"]),
    (["--global-batch-size", "3"], ["--global-batch-size"]),
    (["--micro-batch-size", "3"], ["--global-batch-size", "--micro-batch-size"]),
    (["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size"]),
    (["--kl-coef", "0.1"], ["--kl-coef"]),
    (["--tis-clip", "1", "--tis-clip-low", "2"], ["--tis-clip"]),
    (["--rollout-backend", "embedded", "--sglang-mem-fraction-static", "0.5"], ["--sglang-"]),
    (["--eval-prompt-data", "a"], ["--eval-prompt-data"]),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], ["--rollout-num-gpus"]),
    (["--not-a-flag", "1"], ["--not-a-flag"]),
    (["--rollout-batch"], ["--rollout-batch"]),  # no abbreviations
]
REQUIRED = ["--hf-checkpoint", "--prompt-data", "--rollout-batch-size", "--num-rollout"]
YAML_VALUES = [None, 0, -1, 1.5, "x", "", [1, 2], {"a": 1}, True, False, "nan", [], "1e400", 10**30]


def base_argv(tmp: Path) -> list[str]:
    (tmp / "model").mkdir(exist_ok=True)
    (tmp / "model" / "config.json").write_text("{}")
    (tmp / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    return ["--hf-checkpoint", str(tmp / "model"), "--prompt-data", str(tmp / "d.jsonl"),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--rm-type", "digit"]


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def test_malformed_configs_raise_config_error_naming_the_flag(tmp_path):
    from slime_rl.config.flags import build_parser

    base = base_argv(tmp_path)
    build_config(base)  # the base is valid
    flags = [a for a in build_parser()._actions if a.option_strings and a.dest not in ("help", "config")]
    rng = random.Random(SEED + 2)
    refused = accepted = 0
    for case in range(N_CONFIG_CASES):
        kind = rng.choice(["value", "contradiction", "missing", "yaml_key", "yaml_value", "yaml_file", "yaml_type"])
        names: list[str]
        must_fail = True
        if kind == "value":
            flag = rng.choice(sorted(INVALID_VALUES))
            argv, names = set_flag(base, flag, rng.choice(INVALID_VALUES[flag])), [flag]
        elif kind == "contradiction":
            extra, names = rng.choice(CONTRADICTIONS)
            argv = base + extra
        elif kind == "missing":
            flag = rng.choice(REQUIRED)
            i = base.index(flag)
            argv, names = base[:i] + base[i + 2:], [flag]
        else:
            cfg_file = tmp_path / f"c{case % 7}.yaml"
            argv, names = base + ["--config", str(cfg_file)], ["--config"]
            if kind == "yaml_key":
                cfg_file.write_text(yaml.safe_dump({rng.choice(["lr_x", "rollout-batch", "help", "config", "foo"]): 1}))
            elif kind == "yaml_value":
                flag = rng.choice(sorted(INVALID_VALUES))
                cfg_file.write_text(yaml.safe_dump({flag[2:]: rng.choice(INVALID_VALUES[flag])}))
                argv = argv + ([] if flag in base else [])
                if flag in base:  # the command line would win over the file: drop it there
                    i = argv.index(flag)
                    argv = argv[:i] + argv[i + 2:]
                names = ["--config", flag]
            elif kind == "yaml_file":
                cfg_file.write_text(rng.choice(["[1, 2]", "a: [", "just text", "- x\n- y", "a: {b"]))
            else:  # any flag, any YAML type: accepted or ConfigError, never another exception
                action = rng.choice(flags)
                cfg_file.write_text(yaml.safe_dump({action.option_strings[0][2:]: rng.choice(YAML_VALUES)}))
                names = ["--config", action.option_strings[0]]
                must_fail = False
        try:
            build_config(argv)
        except ConfigError as exc:
            refused += 1
            assert any(n in str(exc) for n in names), (case, kind, argv[-4:], str(exc))
            continue
        assert not must_fail, (case, kind, argv)
        accepted += 1
    assert refused >= 0.8 * N_CONFIG_CASES
