"""EngineClient / AsyncEngineClient: the payloads speak SGLang's field names (checked against a snapshot
read from SGLang's source, and against SGLang's own structs when sglang is importable), and both clients
drive an embedded engine, with errors that name the URL, endpoint, status and server message."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slime_rl.engines import client as C
from slime_rl.engines import payloads

SNAPSHOT = json.loads((Path(__file__).parent / "sglang_fields.json").read_text())

# Each payload builder, called with every optional field set, and the SGLang struct it must fit.
PAYLOADS = {
    "GenerateReqInput": payloads.generate_payload([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                                                       "top_k": 5, "stop_token_ids": [2], "sampling_seed": 1},
                                           return_logprob=True, rid="r0", image_data=["data:image/png;base64,AA"],
                                           logprob_start_len=0, return_text_in_logprobs=True),
    "InitWeightsUpdateGroupReqInput": payloads.init_weights_update_group_payload("10.0.0.1", 29500, 1, 3, "g", "gloo"),
    "UpdateWeightsFromDistributedReqInput": payloads.update_weights_from_distributed_payload(
        ["model.norm.weight"], ["bfloat16"], [[64]], "g", flush_cache=False, weight_version="7",
        abort_all_requests=True, load_format="flattened_bucket"),
    "DestroyWeightsUpdateGroupReqInput": payloads.destroy_weights_update_group_payload("g"),
    "AbortReq": payloads.abort_request_payload("r0", abort_all=True),
    "PauseGenerationReqInput": payloads.pause_generation_payload("retract"),
    "ContinueGenerationReqInput": payloads.continue_generation_payload(),
    "GetWeightsByNameReqInput": payloads.get_weights_by_name_payload("lm_head.weight", 10),
    "UpdateWeightVersionReqInput": payloads.update_weight_version_payload("v2", False),
    "UpdateWeightsFromTensorReqInput": payloads.update_weights_from_tensor_payload(
        ["AAAA"], "direct", False, True, "3"),
    "ReleaseMemoryOccupationReqInput": payloads.memory_occupation_payload(["weights"]),
    "ResumeMemoryOccupationReqInput": payloads.memory_occupation_payload(["kv_cache"]),
    "LoadLoRAAdapterFromTensorsReqInput": payloads.load_lora_adapter_from_tensors_payload(
        "policy_v1", {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, ["QUJD"], True),
    "LoadLoRAAdapterReqInput": payloads.load_lora_adapter_payload("policy_v1", "/runs/x/lora_adapter", True),
    "UnloadLoRAAdapterReqInput": payloads.unload_lora_adapter_payload("policy_v1"),
}
REQUIRED = {"InitWeightsUpdateGroupReqInput": {"master_address", "master_port", "rank_offset", "world_size"},
            "UpdateWeightsFromDistributedReqInput": {"names", "dtypes", "shapes"},
            "UpdateWeightsFromTensorReqInput": {"serialized_named_tensors"},
            "GetWeightsByNameReqInput": {"name"}, "UpdateWeightVersionReqInput": {"new_version"}}


@pytest.mark.parametrize("struct", sorted(PAYLOADS))
def test_payloads_use_only_sglang_field_names(struct):
    payload = PAYLOADS[struct]
    assert set(payload) <= set(SNAPSHOT[struct]), set(payload) - set(SNAPSHOT[struct])
    assert REQUIRED.get(struct, set()) <= set(payload)
    if struct == "GenerateReqInput":
        assert set(payload["sampling_params"]) <= set(SNAPSHOT["SamplingParams"])


def test_payload_details():
    p = payloads.update_weights_from_distributed_payload(["a", "b"], ["torch.float32", "bfloat16"], [(2, 3), []])
    assert p["dtypes"] == ["float32", "bfloat16"] and p["shapes"] == [[2, 3], []]
    assert p["group_name"] == "weight_update_group" and p["flush_cache"] is True and "weight_version" not in p
    assert payloads.generate_payload([[1], [2, 3]], {})["input_ids"] == [[1], [2, 3]]  # batch stays a list of lists
    with pytest.raises(ValueError, match="exactly one"):
        payloads.generate_payload([1], {}, text="x")
    with pytest.raises(ValueError, match="lengths differ"):
        payloads.update_weights_from_distributed_payload(["a"], [], [[1]])
    with pytest.raises(ValueError, match="pause mode"):
        payloads.pause_generation_payload("later")


def test_one_pad_per_image_cuts_each_prompt_image_to_one_pad():
    S, P, E = 90, 91, 92  # vision_start, image_pad, vision_end
    prompt = [1, S, P, P, P, E, 2, S, P, P, E, 3]
    response = [4, P, P, 5]  # pads the model sampled are text: SGLang would count them, they stay as they are
    got = payloads.one_pad_per_image(prompt + response, len(prompt), 2, P, S)
    assert got == [1, S, P, E, 2, S, P, E, 3] + response
    assert payloads.one_pad_per_image([1, S, P, E], 4, 1, P, S) == [1, S, P, E]  # already one pad: unchanged
    with pytest.raises(AssertionError, match="2 image placeholders in the prompt for 1 images"):
        payloads.one_pad_per_image(prompt, len(prompt), 1, P, S)


def test_payloads_construct_sglangs_own_structs():
    io = pytest.importorskip("sglang.srt.managers.io_struct",
                             reason="sglang is not installed (pip install sglang to run the struct check)")
    sp = pytest.importorskip("sglang.srt.sampling.sampling_params")
    for struct, payload in PAYLOADS.items():
        obj = getattr(io, struct)(**payload)
        for key, value in payload.items():
            assert getattr(obj, key) == value or key == "rid", (struct, key)
    sp.SamplingParams(**PAYLOADS["GenerateReqInput"]["sampling_params"])


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    from slime_rl.engines.embedded.server import EmbeddedServer, ServerConfig

    s = EmbeddedServer(ServerConfig(model_path=str(tiny_qwen2), port=0, api_key="k")).start()
    yield s
    s.shutdown()


SYNC_CLIENTS = [C.EngineClient, C.KeepAliveEngineClient]  # httpx, and http.client for weight sync


@pytest.mark.parametrize("client", SYNC_CLIENTS)
def test_sync_client_drives_the_embedded_engine(engine, client):
    with client(engine.url, api_key="k", timeout=60) as c:
        assert c.health() is True
        out = c.generate([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True}, rid="c-1")
        assert out["meta_info"]["id"] == "c-1" and len(out["meta_info"]["output_token_logprobs"]) == 3
        batch = c.generate([[5, 6], [7]], {"max_new_tokens": 2, "temperature": 0})
        assert isinstance(batch, list) and len(batch) == 2
        if client is C.EngineClient:  # the first run on the module's engine (the next one finds "v9")
            assert c.get_model_info()["weight_version"] == "default"
        assert c.flush_cache().startswith("Cache flushed")
        assert c.pause_generation("in_place")["status"] == "ok"
        assert c.continue_generation()["status"] == "ok"
        assert c.abort_request("nothing-running") is None
        assert c.update_weight_version("v9")["new_version"] == "v9"
        assert c.get_model_info()["weight_version"] == "v9"
        with pytest.raises(C.EngineError) as info:
            c.generate([5], {"top_p": 3.0})
        err = info.value
        assert err.status == 400 and err.endpoint == "/generate" and err.url == engine.url
        assert err.message.startswith("sampling_params.top_p") and engine.url in str(err)
        with pytest.raises(C.EngineError, match="no parameter 'nope'"):
            c.get_weights_by_name("nope")
        with pytest.raises(C.EngineError, match="does not exist"):
            c.destroy_weights_update_group("never-made")
    with client(engine.url, timeout=10) as no_key:
        assert no_key.health() is True  # /health needs no key
        with pytest.raises(C.EngineError, match="401: Unauthorized"):
            no_key.get_model_info()


@pytest.mark.parametrize("client", SYNC_CLIENTS)
def test_unreachable_engine_is_an_engine_error(client):
    with client("http://127.0.0.1:1", timeout=2) as c:
        assert c.health() is False
        with pytest.raises(C.EngineError, match="unreachable") as info:
            c.generate([1], {})
        assert info.value.status is None and info.value.endpoint == "/generate"


def test_async_client_sends_concurrently(engine):
    async def main() -> list:
        async with C.AsyncEngineClient(engine.url, api_key="k", timeout=60) as c:
            assert await c.health() is True
            outs = await asyncio.gather(*[c.generate([3 + i] * (i + 1), {"max_new_tokens": 4, "ignore_eos": True,
                                                                          "sampling_seed": i}) for i in range(6)])
            with pytest.raises(C.EngineError, match="stream"):
                await c._call("POST", "/generate", {"input_ids": [1], "stream": True})
            return outs

    outs = asyncio.run(main())
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [4] * 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == list(range(1, 7))


def test_keep_alive_client_reconnects_after_the_server_drops_it(engine):
    """The kept-alive connection closed under it (an idle timeout, a restarted front): the next
    call opens a fresh one instead of failing; one connection per calling thread."""
    from concurrent.futures import ThreadPoolExecutor

    with C.KeepAliveEngineClient(engine.url, api_key="k", timeout=60) as c:
        assert c.get_model_info()["weight_version"]
        first = c._local.conn
        first.sock.shutdown(2)  # as if the server had closed it while idle
        assert c.continue_generation()["status"] == "ok"
        assert c._local.conn is not first
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(c.continue_generation).result()["status"] == "ok"
        assert len(c._conns) == 2  # this thread's and the pool thread's


def test_group_payload_splits_per_sample_in_sglangs_own_struct():
    """The rollout client's group request (rollout/routing.py: lists of input_ids, sampling_params,
    rid and image_data) as SGLang 0.5.23 reads it: GenerateReqInput.normalize_batch_and_arguments
    makes a batch whose item i (what the tokenizer manager sends to the scheduler, in order) carries
    sample i's prompt, its own sampling_seed and budget, its rid and its images."""
    io = pytest.importorskip("sglang.srt.managers.io_struct",
                             reason="sglang is not installed (pip install sglang to run the struct check)")
    url = "data:image/png;base64,AAAA"
    payload = payloads.generate_payload([[1, 2], [1, 2, 7]], [{"max_new_tokens": 4, "sampling_seed": 11},
                                                       {"max_new_tokens": 3, "sampling_seed": 12}],
                                 return_logprob=True, rid=["g-s0", "g-s1"], image_data=[[url], [url]])
    obj = io.GenerateReqInput(**payload)
    obj.normalize_batch_and_arguments()
    assert not obj.is_single and obj.batch_size == 2
    items = [obj[i] for i in range(2)]
    assert [x.input_ids for x in items] == [[1, 2], [1, 2, 7]]
    assert [x.rid for x in items] == ["g-s0", "g-s1"]
    assert [x.sampling_params["sampling_seed"] for x in items] == [11, 12]
    assert [x.sampling_params["max_new_tokens"] for x in items] == [4, 3]
    assert [x.return_logprob for x in items] == [True, True]
    assert [x.image_data for x in items] == [[url], [url]]
    text_only = io.GenerateReqInput(**payloads.generate_payload([[1], [2]], [{}, {}], rid=["a", "b"]))
    text_only.normalize_batch_and_arguments()
    assert [text_only[i].image_data for i in range(2)] == [None, None]
