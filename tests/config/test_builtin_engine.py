"""The built-in engine's settings (config/builtin_engine.py): one field each, and what is derived from
the fields (its command line, the driver's --config-json, the --sglang-* flags it takes) agrees with
itself and with SGLang's own parser."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.builtin_engine import (
    FIELDS,
    SGLANG_ARGS,
    ServerConfig,
    from_sglang_args,
    parse_server_args,
    server_parser,
    to_argv,
)
from slime_rl.engines.cli_args import sglang_server_table


def _other_value(f: dataclasses.Field):
    """A valid value of field `f` different from its default, chosen from its type and metadata."""
    default, meta = f.default, f.metadata
    if meta["choices"]:
        return next(c for c in meta["choices"] if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, float):
        return default + 1.5
    if isinstance(default, int):
        return default + 3
    if f.name in ("cuda_graph_max_bs", "num_threads"):
        return 7
    return "x-" + f.name


def test_each_field_has_a_flag_that_sets_it_alone():
    base = ["--model-path", "/m"]
    for name, f in FIELDS.items():
        if name in ("model_path", "tp_size"):
            continue
        value = _other_value(f)
        argv = base + ([f.metadata["flags"][0]] if isinstance(value, bool) else [f.metadata["flags"][0], str(value)])
        got = parse_server_args(argv)
        assert getattr(got, name) == value, name
        # nothing else moved
        assert dataclasses.replace(got, **{name: getattr(ServerConfig("/m"), name)}) == ServerConfig("/m"), name


def test_the_whole_config_round_trips_through_the_driver_argv():
    cfg = ServerConfig("/m", **{n: _other_value(f) for n, f in FIELDS.items() if n not in ("model_path", "api_key",
                                                                                          "tp_size")})
    assert parse_server_args(to_argv(cfg)) == cfg
    # a flag given after --config-json overrides the field
    assert parse_server_args(to_argv(cfg) + ["--port", "5"]).port == 5


def test_the_sglang_names_are_sglangs_own_options_of_the_same_shape():
    """Each --sglang-<name> the built-in engine takes is an option of SGLang 0.5.23's server parser (its
    live parser or the checked-in snapshot of it): a switch is a bare flag there, a number one value."""
    table = sglang_server_table()
    assert SGLANG_ARGS  # the flag table reads these
    for name, f in FIELDS.items():
        sglang = f.metadata["sglang"]
        if sglang is None:
            continue
        option = table.options[sglang]
        assert option.kind == ("flag" if isinstance(f.default, bool) else "value"), (sglang, option)
        # and the engine's own command line takes SGLang's spelling
        assert "--" + sglang.replace("_", "-") in f.metadata["flags"], name


def test_sglang_values_convert_or_are_refused_naming_the_flag():
    assert from_sglang_args({"enable_torch_compile": "true", "disable_cuda_graph": True,
                             "torch_compile_max_bs": "16", "mem_fraction_static": 0.5}) == {
        "enable_torch_compile": True, "disable_cuda_graph": True, "torch_compile_max_bs": 16}
    assert from_sglang_args({"disable_overlap_schedule": "off"}) == {"disable_overlap_schedule": False}
    for args, message in [({"torch_compile_max_bs": "0"}, "--sglang-torch-compile-max-bs 0: must be >= 1"),
                          ({"max_running_requests": "many"}, "--sglang-max-running-requests 'many': expected int"),
                          ({"enable_torch_compile": "maybe"}, "--sglang-enable-torch-compile 'maybe': expected bool"),
                          ({"cuda_graph_max_bs_decode": 2.5}, "--sglang-cuda-graph-max-bs-decode 2.5: expected int")]:
        with pytest.raises(ValueError) as info:
            from_sglang_args(args)
        assert str(info.value) == message


def test_bad_engine_values_are_refused_before_anything_starts(tmp_path):
    from tests.config.test_config import base_argv

    with pytest.raises(ConfigError, match="--sglang-max-running-requests 0: must be >= 1"):
        build_config(base_argv(tmp_path) + ["--sglang-max-running-requests", "0"])


@pytest.mark.parametrize("argv, message", [
    (["--model-path", "/m", "--tp-size", "2"], "--tp-size 2: the embedded engine supports only 1"),
    (["--model-path", "/m", "--http-read-timeout", "nan"], "--http-read-timeout nan: expected float"),
    (["--model-path", "/m", "--http-idle-timeout", "-1"], "--http-idle-timeout -1.0: must be > 0"),
    (["--model-path", "/m", "--max-running-requests", "0"], "--max-running-requests 0: must be >= 1"),
    (["--port", "1"], "--model-path is required"),
    (["--config-json", "{"], "--config-json: not JSON"),
    (["--config-json", json.dumps({"model_path": "/m", "prot": 1})], "unknown: prot"),
])
def test_the_engine_command_line_refuses_with_the_flag_named(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_server_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_key_comes_from_the_environment_not_the_command_line(monkeypatch):
    monkeypatch.setenv("SLIME_RL_ENGINE_API_KEY", "secret")
    assert parse_server_args(["--model-path", "/m"]).api_key == "secret"
    assert parse_server_args(["--model-path", "/m", "--api-key", "k"]).api_key == "k"
    with pytest.raises(ValueError, match="SLIME_RL_ENGINE_API_KEY"):
        to_argv(ServerConfig("/m", api_key="k"))


def test_help_lists_every_field():
    text = server_parser().format_help()
    for f in FIELDS.values():
        assert f.metadata["flags"][0] in text
