"""SGLang's LoRA endpoints on the built-in engine (engines/embedded/adapters.py): an adapter loaded from
tensors (by value, as --lora-sync adapter sends it) or from a PEFT folder is merged into the weights it adapts
(checked against a float64 merge of the base), the newest loaded one serves, unloading restores the one
before and then the base bit for bit, a full weight update of an adapted weight keeps its adapter, requests
naming no adapter or an unknown one are refused by name, and a bad adapter fails alone."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from engine_testlib import prompt_of, start_server
from safetensors.torch import save_file

from slime_rl.engines.tensor_ipc import serialize_by_value

ALPHA, R = 16.0, 4
ADAPTED = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=3)
    yield s
    s.shutdown()


@pytest.fixture()
def http(engine):
    with httpx.Client(base_url=engine.url, timeout=120) as c:
        yield c


def adapter(engine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module in ADAPTED:
        n_out, n_in = engine.weights.params[f"{module}.weight"].shape
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(R, n_in, generator=g)
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(n_out, R, generator=g)
    return out


CONFIG = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj", "down_proj"]}


def load(http, name: str, tensors: dict) -> httpx.Response:
    return http.post("/load_lora_adapter_from_tensors", json={
        "lora_name": name, "config_dict": CONFIG, "serialized_named_tensors": [serialize_by_value(tensors)]})


def merged64(base: dict, tensors: dict) -> dict[str, torch.Tensor]:
    return {f"{m}.weight": base[f"{m}.weight"].double() + tensors[f"base_model.model.{m}.lora_B.weight"].double()
            @ tensors[f"base_model.model.{m}.lora_A.weight"].double() * (ALPHA / R) for m in ADAPTED}


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.weights.params.items()}


def generate(http, lora_path=None) -> httpx.Response:
    body = {"input_ids": prompt_of(5), "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    if lora_path is not None:
        body["lora_path"] = lora_path
    return http.post("/generate", json=body)


def test_adapters_merge_serve_and_unload(engine, http, tmp_path):
    base = weights(engine)
    plain = generate(http)
    assert plain.status_code == 200
    assert generate(http, "a1").status_code == 400  # nothing loaded: the name is unknown

    a1, a2 = adapter(engine, 1), adapter(engine, 2)
    r = load(http, "a1", a1)
    assert r.status_code == 200 and r.json()["success"] and set(r.json()["loaded_adapters"]) == {"a1"}
    after1 = weights(engine)
    for n, want in merged64(base, a1).items():
        assert torch.allclose(after1[n].double(), want, rtol=0, atol=1e-5), n
    assert all(torch.equal(after1[n], base[n]) for n in base if n not in merged64(base, a1))

    refused = generate(http)
    assert refused.status_code == 400 and "a1" in refused.text and "lora_path" in refused.text
    assert generate(http, "a1").status_code == 200
    assert generate(http, "nope").status_code == 400

    # a PEFT folder, as /load_lora_adapter reads it: the newest serves, the older name is still accepted
    folder = tmp_path / "a2"
    folder.mkdir()
    save_file(a2, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(CONFIG))
    r = http.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(folder)})
    assert r.status_code == 200, r.text
    after2 = weights(engine)
    for n, want in merged64(base, a2).items():
        assert torch.allclose(after2[n].double(), want, rtol=0, atol=1e-5), n
    assert generate(http, "a1").status_code == 200 and generate(http, ["a2"]).status_code == 200

    assert load(http, "a1", a1).status_code == 400  # already loaded
    assert http.post("/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    assert all(torch.equal(engine.weights.params[n], after1[n]) for n in base)  # a1 again, as merged before
    assert http.post("/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
    assert all(torch.equal(engine.weights.params[n], base[n]) for n in base)  # the base, bit for bit
    assert http.post("/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 400
    assert generate(http).json()["output_ids"] == plain.json()["output_ids"]


def test_a_full_update_of_an_adapted_weight_keeps_its_adapter(engine, http):
    base = weights(engine)
    a1 = adapter(engine, 3)
    assert load(http, "b1", a1).status_code == 200
    name = f"{ADAPTED[0]}.weight"
    new_base = base[name] + 0.5
    assert http.post("/begin_weight_update", json={}).status_code == 200
    try:
        r = http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_by_value({name: new_base})], "weight_version": "7"})
        assert r.status_code == 200, r.text
    finally:
        assert http.post("/end_weight_update", json={}).status_code == 200
    want = merged64({**base, name: new_base}, a1)[name]
    assert torch.allclose(engine.weights.params[name].double(), want, rtol=0, atol=1e-5)
    assert http.post("/unload_lora_adapter", json={"lora_name": "b1"}).status_code == 200
    assert torch.equal(engine.weights.params[name], new_base)  # the new base, not the loaded one
    restore = {name: base[name]}
    assert http.post("/begin_weight_update", json={}).status_code == 200
    try:
        assert http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_by_value(restore)]}).status_code == 200
    finally:
        assert http.post("/end_weight_update", json={}).status_code == 200


@pytest.mark.parametrize("bad, says", [
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(R, 3)}, "lora_B"),
    ({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}, "PEFT's names"),
    ({"base_model.model.model.layers.0.self_attn.nope.lora_A.weight": torch.zeros(R, 3),
      "base_model.model.model.layers.0.self_attn.nope.lora_B.weight": torch.zeros(3, R)}, "no weight"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(R, 3),
      "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(3, R)}, "does not make"),
])
def test_a_bad_adapter_fails_alone(engine, http, bad, says):
    before = weights(engine)
    r = load(http, "bad", bad)
    assert r.status_code == 400 and says in r.json()["error_message"], r.text
    assert r.json()["loaded_adapters"] == {}
    assert all(torch.equal(engine.weights.params[n], before[n]) for n in before)
    assert generate(http).status_code == 200


def test_the_sender_keeps_the_newest_two_versions(engine, tiny_qwen2):
    """weight_sync/adapter.py against this engine: each send loads its version and the version before stays
    (a running rollout still names it until the sync ends); older ones are unloaded; the answers report the
    weight version; the metrics count the adapters' bytes and what the requests carried."""
    from slime_rl.weight_sync.adapter import AdapterSender
    from slime_rl.weight_sync.broadcast import EngineTarget

    sender = AdapterSender([EngineTarget(engine.url, 0, None)], copies=2)
    try:
        for v, held in ((1, ["policy_v1"]), (2, ["policy_v1", "policy_v2"]), (3, ["policy_v2", "policy_v3"])):
            m = sender.send(adapter(engine, 10 + v), CONFIG, str(v))
            sender.wait_unloads()  # the background unloads this send started
            assert list(engine.adapters.loaded) == held
            assert engine.weights.weight_version == str(v)
            assert m["weight_sync/adapter_bytes"] == sum(t.nbytes for t in adapter(engine, 0).values())
            assert m["weight_sync/bytes"] > 2 * m["weight_sync/adapter_bytes"]  # two copies, base64
    finally:
        sender.close()
        for name in list(engine.adapters.loaded):
            engine.adapters.unload({"lora_name": name})


def test_by_value_entries_carry_one_storage_per_dtype():
    """serialize_by_value in a process where megatron-core replaced torch's storage loader (as in a trainer
    rank): every tensor comes back equal (dtype, shape, values; a transposed one too), the bytes of each dtype
    travel once (the tensors are views of one buffer), the pickle names torch's loader, and the process's own
    loader is left as it was."""
    import base64

    import megatron.core  # noqa: F401
    import torch.storage

    from slime_rl.engines.tensor_ipc import deserialize_named_tensors

    before = torch.storage._load_from_bytes
    g = torch.Generator().manual_seed(0)
    sent = {f"w{i}": torch.randn(3 + i, 4, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(6)} | {"t": torch.randn(4, 5, generator=g).t(), "s": torch.tensor(7.0)}
    entry = serialize_by_value(sent)
    raw = base64.b64decode(entry)
    assert b"torch.storage" in raw and b"_load_from_bytes" in raw and b"megatron" not in raw
    got = dict(deserialize_named_tensors(entry))
    assert list(got) == list(sent)
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 2  # float32 and bfloat16
    assert all(got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v) for k, v in sent.items())
    assert torch.storage._load_from_bytes is before
