"""`--sglang-*` / `--router-*` pass-through: names checked against SGLang's and sglang-router's own
flags (checked-in snapshots of SGLang 0.5.23 / sglang-router 0.3.2, or the installed packages), our
own flags refused with the flag that sets them, and values rendered in the shape each program's
argparse reads: the rendered argv is parsed back by a parser rebuilt from the table (always) and by
the program's own parser (when the package imports)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from slime_rl.config import ConfigError, build_config, parse_flags
from slime_rl.engines.cli_args import (
    ROUTER_SNAPSHOT,
    SGLANG_SNAPSHOT,
    CliTable,
    PassthroughError,
    check_passthrough,
    render,
    router_table,
    sglang_server_table,
    table_from_parser,
)
from slime_rl.engines.launch import ROUTER_OWNED, SGLANG_OWNED, check_engine_config

SNAP = CliTable.from_json(json.loads(SGLANG_SNAPSHOT.read_text()), SGLANG_SNAPSHOT.name)
ROUTER_SNAP = CliTable.from_json(json.loads(ROUTER_SNAPSHOT.read_text()), ROUTER_SNAPSHOT.name)


def parser_from_table(table: CliTable) -> argparse.ArgumentParser:
    """An argparse parser with the table's options, one action per kind as argparse spells it."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    by_dest: dict[str, list[tuple[str, str]]] = {}
    for name, opt in table.options.items():
        by_dest.setdefault(opt.dest, []).append(("--" + name.replace("_", "-"), opt.kind))
    for dest, opts in by_dest.items():
        kinds = {k for _, k in opts}
        if "bool" in kinds:  # --x / --no-x: one BooleanOptionalAction
            p.add_argument(*[o for o, k in opts if k == "bool"], dest=dest, action=argparse.BooleanOptionalAction)
            continue
        flags = [o for o, _ in opts]
        kind = opts[0][1]
        if kind == "flag":
            p.add_argument(*flags, dest=dest, action="store_true")
        elif kind == "list":
            p.add_argument(*flags, dest=dest, nargs="+")
        elif kind == "optional":
            p.add_argument(*flags, dest=dest, nargs="?", const=True)
        elif kind == "append":
            p.add_argument(*flags, dest=dest, action="append", nargs="+")
        else:
            p.add_argument(*flags, dest=dest)
    return p


def test_snapshots_name_their_versions_and_hold_known_flags():
    assert SNAP.program.startswith("sglang 0.5.23") and ROUTER_SNAP.program.startswith("sglang-router 0.3.2")
    # facts read in SGLang 0.5.23's arg_groups/fields/*.py and server_args.py, and router_args.py
    expect = {"mem_fraction_static": ("mem_fraction_static", "value"), "model": ("model_path", "value"),
              "tensor_parallel_size": ("tp_size", "value"), "nccl_init_addr": ("dist_init_addr", "value"),
              "enable_torch_compile": ("enable_torch_compile", "flag"),
              "enable_tf32_matmul": ("enable_tf32_matmul", "bool"),
              "no_enable_tf32_matmul": ("enable_tf32_matmul", "flag"),
              "fp8_gemm_backend": ("fp8_gemm_runner_backend", "value"), "lora_paths": ("lora_paths", "list")}
    for name, (dest, kind) in expect.items():
        assert (SNAP.options[name].dest, SNAP.options[name].kind) == (dest, kind), name
    assert (ROUTER_SNAP.options["worker_urls"].kind, ROUTER_SNAP.options["policy"].kind) == ("list", "value")
    assert ROUTER_SNAP.options["prefill"].kind == "append" and ROUTER_SNAP.options["mini_lb"].kind == "flag"
    # every dest we own exists in the program (so the refusal below is about a real flag)
    assert set(SGLANG_OWNED) <= {o.dest for o in SNAP.options.values()}
    assert set(ROUTER_OWNED) <= {o.dest for o in ROUTER_SNAP.options.values()}


@pytest.mark.parametrize("name,ours", [("model_path", "--hf-checkpoint"), ("model", "--hf-checkpoint"),
                                       ("tp_size", "--rollout-num-gpus-per-engine"),
                                       ("tensor_parallel_size", "--rollout-num-gpus-per-engine"),
                                       ("random_seed", "--rollout-seed"), ("api_key", "secret"),
                                       ("host", "node address"), ("port", "free port"), ("nccl_port", "free port"),
                                       ("dist_init_addr", "first node"), ("nccl_init_addr", "first node"),
                                       ("base_gpu_id", "placement"),
                                       ("disaggregation_mode", "worker_type"),
                                       ("disaggregation_bootstrap_port", "free port")])
def test_flags_we_compute_are_refused_naming_ours(name, ours):
    flag = "--sglang-" + name.replace("_", "-")
    with pytest.raises(PassthroughError, match=rf"^{flag}: --{name.replace('_', '-')} is set by slime_rl itself"
                                               rf" \(.*{ours}.*\); drop {flag}$"):
        check_passthrough({name: "x"}, SNAP, "sglang-", SGLANG_OWNED)


def test_unknown_names_suggest_close_matches():
    with pytest.raises(PassthroughError) as info:
        check_passthrough({"mem_fraction_statc": 0.7}, SNAP, "sglang-", SGLANG_OWNED)
    msg = str(info.value)
    assert msg.startswith("--sglang-mem-fraction-statc: sglang 0.5.23 (python -m sglang.launch_server) has no flag "
                          "--mem-fraction-statc; did you mean --sglang-mem-fraction-static")
    assert "snapshot sglang_server_args.json" in msg
    with pytest.raises(PassthroughError, match=r"--router-polcy: .* did you mean --router-policy"):
        check_passthrough({"polcy": "round_robin"}, ROUTER_SNAP, "router-", ROUTER_OWNED)
    with pytest.raises(PassthroughError, match="has no flag --qqqq$|has no flag --qqqq \\(checked"):
        check_passthrough({"qqqq": 1}, SNAP, "sglang-", SGLANG_OWNED)  # nothing close: no suggestion
    # a field SGLang has no command-line flag for
    no_cli = sorted(f for f in SNAP.fields - {o.dest for o in SNAP.options.values()} if not f.startswith("_"))
    assert no_cli
    with pytest.raises(PassthroughError, match=f"'{no_cli[0]}' is a field without a command-line flag"):
        check_passthrough({no_cli[0]: 1}, SNAP, "sglang-", SGLANG_OWNED)
    # an older SGLang's name reaching the check directly (slime-rl train renames it first: config/sglang_changes.py)
    with pytest.raises(PassthroughError, match=r"has no flag --cuda-graph-bs \(SGLang 0.5.20 renamed it "
                                               r"--cuda-graph-bs-decode\)"):
        check_passthrough({"cuda_graph_bs": [1, 2]}, SNAP, "sglang-", SGLANG_OWNED)


def test_value_shapes_are_checked():
    with pytest.raises(PassthroughError, match="--sglang-enable-torch-compile: a switch .* got 'maybe'"):
        check_passthrough({"enable_torch_compile": "maybe"}, SNAP, "sglang-", SGLANG_OWNED)
    with pytest.raises(PassthroughError, match="^--sglang-mem-fraction-static needs a value$"):
        check_passthrough({"mem_fraction_static": True}, SNAP, "sglang-", SGLANG_OWNED)
    with pytest.raises(PassthroughError, match="--sglang-mem-fraction-static takes one value, got 2"):
        check_passthrough({"mem_fraction_static": ["0.5", "0.6"]}, SNAP, "sglang-", SGLANG_OWNED)
    got = check_passthrough({"enable_torch_compile": "true", "disable_radix_cache": "0", "log_level": None,
                             "lora_paths": "a=/x"}, SNAP, "sglang-", SGLANG_OWNED)
    assert got == {"enable_torch_compile": True, "disable_radix_cache": False, "lora_paths": ["a=/x"]}


ARGS = {"mem_fraction_static": "0.7", "enable_torch_compile": "true", "disable_radix_cache": False,
        "enable_tf32_matmul": False, "enable_fused_qk_norm_rope": True, "cuda_graph_bs_decode": ["1", "2", "4"],
        "lora_paths": ["a=/x", "b=/y"], "fp8_gemm_backend": "auto", "tensor_parallel_size": None}


def _check_parsed(ns: argparse.Namespace) -> None:
    assert ns.mem_fraction_static in ("0.7", 0.7) and ns.enable_torch_compile is True
    assert ns.disable_radix_cache is False and ns.enable_tf32_matmul is False and ns.enable_fused_qk_norm_rope is True
    assert [int(x) for x in ns.cuda_graph_bs_decode] == [1, 2, 4] and ns.fp8_gemm_runner_backend == "auto"


def test_rendered_argv_parses_back_with_the_actions_of_the_table():
    argv = render(check_passthrough(ARGS, SNAP, "sglang-", SGLANG_OWNED), SNAP)
    assert "--disable-radix-cache" not in argv and "--no-enable-tf32-matmul" in argv
    assert argv[argv.index("--enable-torch-compile") + 1].startswith("--")  # a switch carries no value
    ns = parser_from_table(SNAP).parse_args(argv)
    _check_parsed(ns)
    assert len(ns.lora_paths) == 2


def test_rendered_argv_parses_with_sglangs_own_parser():
    server_args = pytest.importorskip("sglang.srt.server_args", reason="sglang is not importable here "
                                      "(pip install sglang to check against its own parser)")
    p = argparse.ArgumentParser(add_help=False)
    server_args.ServerArgs.add_cli_args(p)
    args = {k: v for k, v in ARGS.items() if k != "lora_paths"}  # LoRAPathAction parses its own syntax
    ns = p.parse_args(["--model-path", "/m"] + render(check_passthrough(args, SNAP, "sglang-", SGLANG_OWNED), SNAP))
    _check_parsed(ns)


def test_live_tables_match_the_snapshots_of_their_version():
    for table, snap, module in ((sglang_server_table, SNAP, "sglang.srt.server_args"),
                                (router_table, ROUTER_SNAP, "sglang_router.router_args")):
        live = table()
        if live.source != "live":
            assert (live.options, live.fields) == (snap.options, snap.fields)  # not importable: the snapshot
            continue
        if live.program != snap.program:
            pytest.skip(f"{module} is {live.program}, the snapshot {snap.program}: compare by hand")
        assert live.options == snap.options and live.fields == snap.fields


def test_router_args_parse_with_the_routers_own_parser():
    router_args = pytest.importorskip("sglang_router.router_args", reason="sglang-router is not installed "
                                      "(pip install slime_rl[router])")
    p = argparse.ArgumentParser(add_help=False)
    router_args.RouterArgs.add_cli_args(p, use_router_prefix=False)
    live = table_from_parser(p, "router", [])
    args = {"policy": "round_robin", "disable_retries": "yes", "request_id_headers": ["x-a", "x-b"],
            "max_payload_size": 1024}
    argv = render(check_passthrough(args, live, "router-", ROUTER_OWNED), live)
    ns = p.parse_args(argv)
    assert ns.policy == "round_robin" and ns.disable_retries is True and ns.request_id_headers == ["x-a", "x-b"]
    assert int(ns.max_payload_size) == 1024
    # the PD mode's engines are the run's (--prefill-num-servers / --sglang-config), not a pass-through
    with pytest.raises(PassthroughError, match=r"--router-prefill: --prefill is set by slime_rl itself \(the prefill "
                                               r"engines of --prefill-num-servers / --sglang-config\)"):
        check_passthrough({"prefill": [["http://p:1", "9000"]]}, live, "router-", ROUTER_OWNED)


def _argv(tiny_qwen2, tmp_path, *extra):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1", "label": "1"}\n')
    return ["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--rollout-batch-size", "1",
            "--num-rollout", "1", "--rm-type", "digit", *extra]


def test_config_splits_router_flags_and_takes_lists(tiny_qwen2, tmp_path):
    _, passthrough = parse_flags(["--sglang-cuda-graph-bs-decode", "1", "2", "4", "--router-policy", "round_robin",
                                  "--sglang-enable-torch-compile", "--router-request-id-headers", "x-a", "--lr", "1"])
    assert passthrough == {"cuda_graph_bs_decode": ["1", "2", "4"], "router:policy": "round_robin",
                           "enable_torch_compile": True, "router:request_id_headers": "x-a"}
    cfg = build_config(_argv(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--use-sglang-router",
                             "--sglang-router-port", "31000", "--router-policy", "round_robin",
                             "--sglang-mem-fraction-static", "0.6"))
    e = cfg.engine
    assert (e.use_router, e.router_port, e.router_args, e.sglang_args) == (
        True, 31000, {"policy": "round_robin"}, {"mem_fraction_static": "0.6"})
    with pytest.raises(ConfigError, match=r"--router-\* flags given \(policy\) but not --use-sglang-router"):
        build_config(_argv(tiny_qwen2, tmp_path, "--router-policy", "random"))
    yml = tmp_path / "c.yaml"
    yml.write_text("use-sglang-router: true\nrouter-policy: random\nrouter_disable_retries: true\n"
                   "sglang_router_port: 31001\n")
    e = build_config(_argv(tiny_qwen2, tmp_path, "--config", str(yml), "--router-policy", "round_robin")).engine
    assert (e.router_port, e.router_args) == (31001, {"policy": "round_robin", "disable_retries": True})
    # the router works in front of built-in engines too
    cfg = build_config(_argv(tiny_qwen2, tmp_path, "--use-sglang-router", "--router-policy", "random"))
    assert cfg.engine.use_router and cfg.engine.backend == "embedded"


def test_preflight_rejects_a_bad_passthrough_before_any_actor(tiny_qwen2, tmp_path, capsys):
    from slime_rl.train import main

    code = main(_argv(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--sglang-mem-fraction-statc", "0.5",
                      "--dry-run"))
    err = capsys.readouterr().err
    assert code == 2 and "--sglang-mem-fraction-statc" in err and "--sglang-mem-fraction-static" in err
    code = main(_argv(tiny_qwen2, tmp_path, "--use-sglang-router", "--router-worker-urls", "http://x:1", "--dry-run"))
    assert code == 2 and "--router-worker-urls: --worker-urls is set by slime_rl itself" in capsys.readouterr().err
    # slime's external-router flag is not a router flag in disguise
    code = main(_argv(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--sglang-router-ip", "10.0.0.1",
                      "--dry-run"))
    assert code == 2 and "--sglang-router-ip: not a flag of SGLang's server" in capsys.readouterr().err
    cfg = build_config(_argv(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--sglang-disable-radix-cache",
                             "false", "--sglang-enable-tf32-matmul", "false"))
    assert check_engine_config(cfg.engine).sglang_args == {"disable_radix_cache": False, "enable_tf32_matmul": False}


def test_dry_run_prints_router_and_engine_commands(tiny_qwen2, tmp_path, capsys):
    from slime_rl.train import main

    code = main(_argv(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--rollout-num-gpus", "2",
                      "--use-sglang-router", "--router-policy", "round_robin", "--router-disable-retries",
                      "--sglang-enable-tf32-matmul", "false", "--sglang-cuda-graph-bs-decode", "1", "2", "--dry-run"))
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    engines = [line for line in out if line.startswith("engine ")]
    (router,) = [line for line in out if line.startswith("router: ")]
    assert len(engines) == 2 and all("--no-enable-tf32-matmul --cuda-graph-bs-decode 1 2" in e for e in engines)
    argv = router.split()[1:]
    assert argv[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    i = argv.index("--worker-urls")
    assert argv[i + 1:i + 3] == ['"http://${ENGINE_HOST}:30000"', '"http://${ENGINE_HOST}:30010"']
    assert argv[-3:] == ["--policy", "round_robin", "--disable-retries"]
