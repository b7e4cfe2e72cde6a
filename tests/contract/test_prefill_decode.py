"""slime's prefill/decode disaggregation (--prefill-num-servers, --sglang-config; config/server_groups.py): the
engines' roles and per-group settings from slime's own GLM-5.2 server groups (tests/migration/sglang_configs, the
YAML its launch script writes), each engine's command parsed by SGLang 0.5.23's own ServerArgs parser and the
router's by sglang-router 0.3.2's own, and the refusals. The KV transfer between a prefill and a decode engine is
SGLang's (mooncake / nixl over RDMA): no engine on this machine runs it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.server_groups import ServerGroupError, from_prefill_num_servers, read_sglang_config
from slime_rl.engines.launch import check_engine_config
from slime_rl.orchestration.engines import engine_command
from slime_rl.orchestration.placement import plan_placement
from slime_rl.orchestration.router import router_launch_command

server_args = pytest.importorskip("sglang.srt.server_args",
                                  reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")
GLM52 = Path(__file__).resolve().parents[1] / "migration" / "sglang_configs" / "glm5.2-744B-A40B.yaml"


def _cfg(model, tmp_path, *extra):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1", "label": "1"}\n')
    return build_config(["--hf-checkpoint", str(model), "--prompt-data", str(data),
                         "--rollout-batch-size", "1", "--num-rollout", "1", "--rm-type", "digit", *extra])


def _sglang_parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    server_args.ServerArgs.add_cli_args(p)
    return p.parse_args(argv[argv.index("sglang.launch_server") + 1:])


def test_slimes_glm52_server_groups():
    """By hand from the file: 64 GPUs of prefill and 192 of decode in engines of 64: 1 prefill, 3 decode engines,
    each group with its own overrides."""
    groups = read_sglang_config(str(GLM52), "/m", num_gpus=256, num_gpus_per_engine=64)
    assert [(g.worker_type, g.num_engines) for g in groups] == [("prefill", 1), ("decode", 3)]
    assert groups[0].overrides["chunked_prefill_size"] == 131072 and groups[0].overrides["deepep_mode"] == "auto"
    assert groups[1].overrides["deepep_mode"] == "low_latency" and groups[1].overrides["disable_overlap_schedule"]
    with pytest.raises(ServerGroupError, match=r"its groups hold 256 GPUs, --rollout-num-gpus is 128"):
        read_sglang_config(str(GLM52), "/m", num_gpus=128, num_gpus_per_engine=64)
    with pytest.raises(ServerGroupError, match=r"server group 0: num_gpus_per_engine 64 differs from "
                                               r"--rollout-num-gpus-per-engine 8"):
        read_sglang_config(str(GLM52), "/m", num_gpus=256, num_gpus_per_engine=8)
    assert [(g.worker_type, g.num_engines) for g in from_prefill_num_servers(1, 4)] == [("prefill", 1), ("decode", 3)]
    with pytest.raises(ServerGroupError, match="--prefill-num-servers 4: the run has 4 engine"):
        from_prefill_num_servers(4, 4)


@pytest.mark.parametrize("text, match", [
    ("sglang: [{name: a, server_groups: [{worker_type: regular, num_gpus: 2}]}, {name: ref, server_groups: []}]",
     r"2 models \(\['a', 'ref'\]\); one is built here"),
    ("sglang: [{name: a, server_groups: [{worker_type: placeholder, num_gpus: 2}]}]",
     r"server group 0: worker_type placeholder \(a GPU reservation without engines\) is not built here"),
    ("sglang: [{name: a, server_groups: [{worker_type: prefill, num_gpus: 1}, {worker_type: regular, num_gpus: 1}]}]",
     r"regular groups beside prefill/decode ones"),
    ("sglang: [{name: a, server_groups: [{worker_type: prefill, num_gpus: 2}]}]", r"no decode group"),
    ("sglang: [{name: a, model_path: /other, server_groups: [{worker_type: regular, num_gpus: 2}]}]",
     r"model_path '/other' is not --hf-checkpoint"),
    ("sglang: [{name: a, server_groups: [{worker_type: regular, num_gpus: 2, colour: red}]}]",
     r"server group 0: unknown keys \['colour'\]"),
    ("- a", r"expected a top key 'sglang' holding a list of models"),
])
def test_server_groups_refused_with_the_reason(tmp_path, text, match):
    f = tmp_path / "s.yaml"
    f.write_text(text)
    with pytest.raises(ServerGroupError, match=match):
        read_sglang_config(str(f), "/m", num_gpus=2, num_gpus_per_engine=1)


def test_prefill_and_decode_engines_launch_as_sglang_and_the_router_reads(tiny_qwen2, tmp_path):
    """--prefill-num-servers 1 of 3 engines: engine 0 prefills with its bootstrap port, 1 and 2 decode (SGLang's
    parser reads each mode); the router in its PD mode pairs them (sglang-router's parser reads the URLs)."""
    from sglang_router.launch_router import parse_router_args

    cfg = _cfg(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--rollout-num-gpus", "3",
               "--prefill-num-servers", "1", "--sglang-disaggregation-transfer-backend", "nixl")
    assert cfg.engine.use_router and cfg.engine.disaggregated  # PD needs the router's pairing
    plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=4)
    ns = [_sglang_parse(engine_command(cfg, s, "10.0.0.3", 30000 + s.engine_id, None, use_gpu=True,
                                       bootstrap_port=8998 if s.engine_id == 0 else None)) for s in plan.engines]
    assert [n.disaggregation_mode for n in ns] == ["prefill", "decode", "decode"]
    assert ns[0].disaggregation_bootstrap_port == 8998 and {n.disaggregation_transfer_backend for n in ns} == {"nixl"}
    urls = [f"http://10.0.0.3:{30000 + k}" for k in range(3)]
    argv = router_launch_command(cfg, "10.0.0.1", 30999, urls, None, bootstrap_ports={0: 8998})
    r = parse_router_args(argv[argv.index("sglang_router.launch_router") + 1:])
    assert r.pd_disaggregation and r.prefill_urls == [(urls[0], 8998)] and r.decode_urls == urls[1:]
    with pytest.raises(ValueError, match="engine 0 prefills: it needs a bootstrap port"):
        engine_command(cfg, plan.engines[0], "h", 1, None, use_gpu=True)


def test_glm52_groups_set_each_engines_overrides(tiny_qwen2, tmp_path):
    """--sglang-config: each engine gets its group's overrides on top of the --sglang-* flags (SGLang's parser
    reads them), checked as --sglang-* flags are (a field SGLang lacks names the group)."""
    text = GLM52.read_text().replace("num_gpus: 192", "num_gpus: 4").replace("64", "2").replace("131072", "4096")
    (tmp_path / "groups.yaml").write_text(text)
    cfg = _cfg(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--rollout-num-gpus", "6",
               "--rollout-num-gpus-per-engine", "2", "--sglang-config", str(tmp_path / "groups.yaml"),
               "--sglang-max-running-requests", "100")
    engine = check_engine_config(cfg.engine)
    assert [engine.role(k)[0] for k in range(3)] == ["prefill", "decode", "decode"]
    cfg = dataclasses.replace(cfg, engine=engine)
    plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=8)
    ns = [_sglang_parse(engine_command(cfg, s, "h", 30000, None, use_gpu=True, bootstrap_port=9000))
          for s in plan.engines]
    assert (ns[0].chunked_prefill_size, ns[0].max_running_requests, ns[0].deepep_mode) == (4096, 512, "auto")
    assert (ns[1].max_running_requests, ns[1].deepep_mode, ns[1].disable_overlap_schedule) == (768, "low_latency",
                                                                                               True)
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("deepep_mode: auto", "no_such_field: 1"))
    cfg = _cfg(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--rollout-num-gpus", "6",
               "--rollout-num-gpus-per-engine", "2", "--sglang-config", str(bad))
    with pytest.raises(ValueError, match=r"--sglang-config .*bad.yaml: server group 0 \(prefill\) overrides: "
                                         r"--sglang-no-such-field: sglang 0.5.23 .* has no flag --no-such-field"):
        check_engine_config(cfg.engine)


@pytest.mark.parametrize("extra, match", [
    (["--prefill-num-servers", "1"], r"--prefill-num-servers: prefill/decode disaggregation moves each request's KV "
                                     r"cache .* give --rollout-backend sglang"),
    (["--rollout-backend", "sglang", "--prefill-num-servers", "1", "--use-fault-tolerance"],
     r"--prefill-num-servers with --use-fault-tolerance: a restarted engine is not put back"),
    (["--rollout-backend", "sglang", "--prefill-num-servers", "1", "--sglang-config", str(GLM52)],
     r"--prefill-num-servers and --sglang-config exclude each other"),
])
def test_prefill_decode_refusals(tiny_qwen2, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tiny_qwen2, tmp_path, "--rollout-num-gpus", "2", *extra)


def test_the_disaggregation_flags_are_the_runs_own(tiny_qwen2, tmp_path):
    """--sglang-disaggregation-mode / -bootstrap-port, on the command line or in a group's overrides, are refused as
    every flag the launcher sets is (before any actor starts: preflight's check_engine_config)."""
    from slime_rl.engines.cli_args import PassthroughError

    cfg = _cfg(tiny_qwen2, tmp_path, "--rollout-num-gpus", "2", "--rollout-backend", "sglang", "--prefill-num-servers",
               "1", "--sglang-disaggregation-mode", "prefill")
    with pytest.raises(PassthroughError, match=r"^--sglang-disaggregation-mode: --disaggregation-mode is set by "
                                               r"slime_rl itself \(--prefill-num-servers / --sglang-config's "
                                               r"worker_type\)"):
        check_engine_config(cfg.engine)
    f = tmp_path / "groups.yaml"
    f.write_text("sglang: [{name: a, server_groups: [{worker_type: prefill, num_gpus: 1, overrides: "
                 "{disaggregation_bootstrap_port: 9}}, {worker_type: decode, num_gpus: 1}]}]")
    cfg = _cfg(tiny_qwen2, tmp_path, "--rollout-num-gpus", "2", "--rollout-backend", "sglang", "--sglang-config",
               str(f))
    with pytest.raises(PassthroughError, match=r"server group 0 \(prefill\) overrides: "
                                               r"--sglang-disaggregation-bootstrap-port: .* is set by slime_rl itself"):
        check_engine_config(cfg.engine)
