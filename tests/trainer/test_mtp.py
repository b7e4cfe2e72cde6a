"""Multi-token prediction (--mtp-num-layers, --enable-mtp-training, --mtp-loss-scaling-factor) on tiny GLM-4.7-Flash
with one MTP layer (tests/conftest.py tiny_glm4_moe_lite_mtp).

Expected values come from a hand-written float64 reference of DeepSeek-V3's MTP module (its report, section 2.2;
SGLang's Glm4MoeLiteModelNextN runs the same): for position i of a sample t,
    h'_i = eh_proj([RMSNorm_e(emb(t_{i+1})); RMSNorm_h(h_i)])     (h_i: the decoder's last hidden state, after its norm)
    y    = one decoder layer (HF's layer num_hidden_layers of the checkpoint, causal over the positions)
    loss = cross-entropy of lm_head(RMSNorm_shared_head(y_i)) against t_{i+2}
counted where t_{i+2} is a trained response token (loss mask 1), averaged over those tokens per micro-batch, then over
the micro-batches, times --mtp-loss-scaling-factor; the embedding, the decoder and lm_head are constants (no gradient
reaches them), as slime's Megatron detaches them. The decoder's hidden states, the embedding, lm_head and the MTP
layer's decoder layer are transformers' modules of the same folder in float64; the norms, eh_proj, the masks and the
averages are written out here.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.trainer.mtp_scenarios import FACTOR
from tests.trainer.test_moe import _per_expert
from tests.trainer.trainer_ref import LOSS_MASKS, hf_model, make_batch
from tests.trainer.trainer_scenarios import scenario_runner

MTP_PREFIX = "model.layers.4."  # the MTP layer: HF's layer num_hidden_layers (4)
OWN = tuple(MTP_PREFIX + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"))
GROUPS = ([0, 1], [2, 3])  # micro-batch size 2 over the 4 samples, in order


@pytest.fixture(scope="module")
def mtp_run(tiny_glm4_moe_lite_mtp, tiny_mimo_mtp, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("mtp_scenarios"), {"glm4_moe_lite_mtp": tiny_glm4_moe_lite_mtp,
                                                                       "mimo_mtp": tiny_mimo_mtp})


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# MiMo-7B (mimo): the MTP layer under model.mtp_layers.0., its own four tensors under MiMo's names, its input_proj
# applied to [hidden state; embedding] (SGLang's MiMoMultiTokenPredictorLayer), its decoder layer Qwen2's
MIMO_PREFIX = "model.mtp_layers.0."
MIMO_OWN = tuple(MIMO_PREFIX + n for n in ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                                           "final_layernorm.weight"))


def _cp_owner(n: int, cp: int) -> torch.Tensor:
    """The context-parallel rank that holds each of a sample's n positions: the sample padded to a multiple of 2 x cp
    and cut in 2 x cp chunks, rank r holding chunks r and 2 x cp - 1 - r (megatron's load-balanced split)."""
    chunk = -(-n // (2 * cp))
    owner = [min(k, 2 * cp - 1 - k) for k in range(2 * cp) for _ in range(chunk)]
    return torch.tensor(owner[:n])


def _reference(folder, tmp, prefix: str, own_names: tuple[str, ...], hidden_first: bool, cp: int = 1):
    """(loss, grads by HF name) of the formula in the module docstring, in float64. transformers builds the decoder
    (`base`) and, as layer num_hidden_layers of the same config with one more layer, the MTP layer's decoder layer;
    `hidden_first`: the projection's input is [hidden state; embedding] (MiMo) rather than [embedding; hidden state].
    cp > 1: megatron-core's MTP loss under context parallelism, where each rank averages over the counted tokens of its
    own positions and the ranks' averages are averaged (the gradient: summed over CP, divided by CP, as DDP does)."""
    from safetensors.torch import load_file, save_file

    from slime_rl.config.families import FAMILIES

    cfg = json.loads((folder / "config.json").read_text())
    n_layers, family = cfg["num_hidden_layers"], FAMILIES[cfg["model_type"]]
    cfg["model_type"] = family.transformers_model_type or cfg["model_type"]  # MiMo runs as Qwen2
    stored = load_file(folder / "model.safetensors")
    for name, layers in (("base", n_layers), ("full", n_layers + 1)):
        (tmp / name).mkdir()
        shutil.copy(folder / "tokenizer.json", tmp / name)
        # one more entry per layer list (GLM-4.7-Flash's mlp_layer_types, Qwen2's layer_types): the MTP layer's kind
        extra = {k: cfg[k][:n_layers] + cfg[k][-1:] * (layers - n_layers) for k in ("mlp_layer_types", "layer_types")
                 if isinstance(cfg.get(k), list)}
        (tmp / name / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers, **extra}))
        # the MTP layer's decoder tensors as HF's layer num_hidden_layers (MiMo's are under model.mtp_layers.0.)
        tensors = {(f"model.layers.{n_layers}." + k[len(prefix):] if k.startswith(prefix) else k): v
                   for k, v in stored.items() if k not in own_names}
        save_file(tensors, str(tmp / name / "model.safetensors"), metadata={"format": "pt"})
    base, layer = hf_model(tmp / "base"), hf_model(tmp / "full").model.layers[n_layers]
    own = {k: stored[k].double().requires_grad_() for k in own_names}
    eps = base.config.rms_norm_eps
    batch = make_batch()
    per_mb = []
    for ids in GROUPS:
        num, den = torch.zeros(cp, dtype=torch.float64), torch.zeros(cp, dtype=torch.float64)
        for i in ids:
            t = torch.tensor(batch["tokens"][i])
            n, r = len(t), batch["response_lengths"][i]
            with torch.no_grad():
                h = base.model(t[None]).last_hidden_state[0]  # [n, H], after the final norm
                e = base.model.embed_tokens(t[1:])  # emb(t_{i+1}) for i < n - 1
            enorm, hnorm, eh_proj, head_norm = (own[k] for k in own_names)
            parts = [_rms(e, enorm, eps), _rms(h[:-1], hnorm, eps)]
            x = torch.cat(parts[::-1] if hidden_first else parts, -1) @ eh_proj.T
            pos = torch.arange(n - 1)[None]
            causal = torch.full((n - 1, n - 1), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            y = layer(x[None], attention_mask=causal, position_ids=pos,
                      position_embeddings=base.model.rotary_emb(x[None], pos))[0]
            logits = _rms(y, head_norm, eps) @ base.lm_head.weight.detach().T
            ce = torch.nn.functional.cross_entropy(logits[:n - 2], t[2:], reduction="none")  # position i -> t_{i+2}
            mask = torch.zeros(n, dtype=torch.float64)
            mask[n - r:] = torch.tensor(LOSS_MASKS[i], dtype=torch.float64)
            owner = torch.nn.functional.one_hot(_cp_owner(n, cp)[:n - 2], cp).double()  # [positions, cp]
            num, den = num + (ce * mask[2:]) @ owner, den + mask[2:] @ owner
        per_mb.append((num / den.clamp(min=1)).mean())
    loss = sum(per_mb) / len(per_mb)
    (FACTOR * loss).backward()
    grads = {k: v.grad for k, v in own.items()}
    grads |= _per_expert({prefix + k: (p.grad if p.grad is not None else torch.zeros_like(p))
                          for k, p in layer.named_parameters()})
    return float(loss.detach()), grads


@pytest.fixture(scope="module")
def mtp_ref(tiny_glm4_moe_lite_mtp, tmp_path_factory):
    return _reference(tiny_glm4_moe_lite_mtp, tmp_path_factory.mktemp("mtp_ref"), MTP_PREFIX, OWN, False)


@pytest.fixture(scope="module")
def mtp_ref_cp2(tiny_glm4_moe_lite_mtp, tmp_path_factory):
    return _reference(tiny_glm4_moe_lite_mtp, tmp_path_factory.mktemp("mtp_ref_cp2"), MTP_PREFIX, OWN, False, cp=2)


def _assert_mtp_matches(stats: dict, grads: dict, ref, prefix: str = MTP_PREFIX) -> None:
    loss, want = ref
    assert abs(stats["mtp/mtp_loss"] - loss) < 1e-5 * loss, (stats["mtp/mtp_loss"], loss)
    assert stats["mtp/mtp_1_loss"] == stats["mtp/mtp_loss"]
    got = {k: v for k, v in grads.items() if k.startswith(prefix)}
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name].double()
        assert torch.allclose(g, w, atol=1e-7, rtol=1e-4), (name, float((g - w).abs().max()))
    assert sum(float(w.abs().sum()) for w in want.values()) > 0


def test_mtp_loss_and_grads_are_deepseek_v3s_formula(mtp_run, mtp_ref):
    """One rank, packed and right-padded micro-batches: the MTP loss the trainer logs and the MTP layer's gradients
    (--mtp-loss-scaling-factor times the loss) equal the float64 reference; the policy's loss and every other
    parameter's gradient are those of the same checkpoint trained without MTP (the MTP loss reaches only its layer),
    and --mtp-num-layers alone changes nothing: no MTP loss, the MTP layer frozen (sent as loaded)."""
    res = mtp_run("mtp1", 1)[0]
    for layout in ("packed", "padded"):
        _assert_mtp_matches(res[f"train/{layout}/stats"], res[f"train/{layout}/grad"], mtp_ref)
    trained, none, frozen = res["train/packed/grad"], res["none/packed/grad"], res["frozen/packed/grad"]
    assert set(trained) - set(none) == {k for k in trained if k.startswith(MTP_PREFIX)}
    for name, g in none.items():
        assert torch.equal(trained[name], g), name
        assert torch.equal(frozen[name], g), name
    assert set(frozen) == set(none)
    policy = {k: v for k, v in res["train/packed/stats"].items() if not k.startswith("mtp/")}
    assert policy == res["none/packed/stats"] == res["frozen/packed/stats"]
    assert res["train/packed/logp"] == res["none/packed/logp"] == res["frozen/packed/logp"]
    # the step: train/mtp_loss logged with MTP training only; a frozen MTP layer keeps the checkpoint's values
    assert "train/mtp_loss" in res["train/metrics"] and res["train/metrics"]["train/mtp_loss"] > 0
    assert not any("mtp" in k for k in (*res["none/metrics"], *res["frozen/metrics"]))
    mtp_names = [k for k in res["sent"] if k.startswith(MTP_PREFIX)]
    assert not torch.equal(res["train/after"][OWN[2]], res["initial"][OWN[2]])  # eh_proj trained
    for name in mtp_names:
        assert torch.equal(res["frozen/after"][name], res["initial"][name]), name
    # weight sync sends the MTP layer (also when frozen: the first sync), under HF's names; without the flag nothing
    assert res["frozen/sent"] == res["sent"] and not any(k.startswith(MTP_PREFIX) for k in res["none/sent"])
    assert set(OWN) <= set(mtp_names)


def test_mtp_layers_round_trip_through_save_hf_and_checkpoints(mtp_run, tiny_glm4_moe_lite_mtp):
    """--save-hf writes the trained MTP layer under the checkpoint's names, bit for bit what the trainer holds (and
    sends), and a trainer built from that folder holds it again bit for bit; a Megatron checkpoint resumes it, and one
    without MTP layers loads the rest."""
    from safetensors import safe_open

    res = mtp_run("mtp1", 1)[0]
    after, exported = res["train/after"], res["exported"]
    with safe_open(tiny_glm4_moe_lite_mtp / "model.safetensors", "pt") as f:
        assert set(exported) == set(f.keys())  # the source checkpoint's tensors, MTP layer included
    assert set(after) == set(exported)
    for name, t in after.items():
        assert torch.equal(exported[name], t), name
        assert torch.equal(res["reloaded_hf"][name], t), name
        assert torch.equal(res["resumed"][name], t), name
    # a checkpoint without MTP layers (slime's --ref-load converted without them): the rest loaded, the MTP layer the
    # HF checkpoint's
    for name, t in res["mtp_from_plain"].items():
        want = res["initial"][name] if name.startswith(MTP_PREFIX) else res["none/after"][name]
        assert torch.equal(t, want), name


def test_mtp_under_tp2_pp2_and_cp2_equals_one_rank(mtp_run, mtp_ref, mtp_ref_cp2):
    """TP=2 (eh_proj and the layer split over the ranks; with full activation recompute), PP=2 (the MTP layer on the
    last stage with its own copy of the embedding) and CP=2 (each sample's tokens over two ranks: megatron rolls the
    tokens and the mask across them): the same MTP loss and gradients as the reference; under CP megatron-core's
    weighting (each rank's mean over the counted tokens of its positions, averaged over the ranks: slime's too), which
    the reference writes out."""
    ranks = mtp_run("mtp_tp2pp2", 2)
    for key in ("tp2", "pp2", "cp2"):
        grads = {k: v for r in ranks for k, v in r[f"{key}/grad"].items()}
        _assert_mtp_matches(ranks[-1][f"{key}/stats"], grads, mtp_ref if key != "cp2" else mtp_ref_cp2)
        assert ranks[0][f"{key}/stats"] == ranks[-1][f"{key}/stats"]
        if key == "cp2":  # the CP ranks' grad buffers hold the same (DP x CP-reduced) gradients
            for name, g in ranks[0]["cp2/grad"].items():
                assert torch.equal(ranks[1]["cp2/grad"][name], g), name


def test_mtp_num_layers_is_refused_without_mtp_layers(tiny_glm4_moe_lite, tiny_glm4_moe_lite_mtp, tiny_qwen2, tmp_path):
    """--mtp-num-layers against config.json: a checkpoint without MTP layers (num_nextn_predict_layers 0), more layers
    than it holds, a family without them; --enable-mtp-training without --mtp-num-layers; MTP layers with LoRA."""
    from slime_rl.config import ConfigError, build_config
    from slime_rl.train import check_model_features

    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')

    def refused(hf, *flags: str) -> str:
        with pytest.raises(ConfigError) as info:
            check_model_features(build_config(["--hf-checkpoint", str(hf), "--prompt-data", str(tmp_path / "d.jsonl"),
                                               "--rollout-batch-size", "4", "--num-rollout", "1", "--rm-type", "digit",
                                               *flags]))
        return str(info.value)

    assert refused(tiny_glm4_moe_lite, "--mtp-num-layers", "1") == (
        f"--mtp-num-layers 1: {tiny_glm4_moe_lite}/config.json has num_nextn_predict_layers 0, so the checkpoint holds "
        "no multi-token-prediction layer(s) to build (a checkpoint with them has num_nextn_predict_layers >= 1 and "
        "their tensors model.layers.4.*)")
    assert "has num_nextn_predict_layers 1, so the checkpoint holds only 1 multi-token-prediction layer(s)" in refused(
        tiny_glm4_moe_lite_mtp, "--mtp-num-layers", "2", "--enable-mtp-training")
    assert refused(tiny_qwen2, "--mtp-num-layers", "1").startswith(
        "--mtp-num-layers 1: model_type 'qwen2' has no multi-token-prediction layers the trainer builds")
    assert refused(tiny_glm4_moe_lite_mtp, "--enable-mtp-training") == (
        "--enable-mtp-training needs --mtp-num-layers N (the multi-token-prediction layers to build and train)")
    assert refused(tiny_glm4_moe_lite_mtp, "--mtp-num-layers", "1", "--lora-rank", "4").startswith(
        "--mtp-num-layers with --lora-rank / --lora-load: LoRA adapts the decoder's linears")


def test_mimo_mtp_layer_trains_and_exports_under_mimos_names(mtp_run, tiny_mimo_mtp, tmp_path_factory):
    """MiMo-7B (mimo: Qwen2's decoder and model.mtp_layers.*): the MTP loss and the MTP layer's gradients equal the
    reference with MiMo's input order ([hidden state; embedding]: megatron's eh_proj holds input_proj's halves swapped),
    weight sync sends the layer under MiMo's names, and --save-hf writes them bit for bit as the trainer holds them."""
    ref = _reference(tiny_mimo_mtp, tmp_path_factory.mktemp("mimo_ref"), MIMO_PREFIX, MIMO_OWN, True)
    res = mtp_run("mimo1", 1)[0]
    _assert_mtp_matches(res["train/packed/stats"], res["train/packed/grad"], ref, MIMO_PREFIX)
    assert set(MIMO_OWN) <= set(res["sent"]) and all(k.startswith(("model.layers.", "model.mtp_layers.0.")) or
                                                     k in ("model.embed_tokens.weight", "model.norm.weight",
                                                           "lm_head.weight") for k in res["sent"])
    for name, t in res["initial"].items():  # loaded and sent back unchanged (input_proj's swap undone)
        assert torch.equal(res["exported_initial"][name], t), name
    assert set(res["after"]) == set(res["exported"])
    for name, t in res["after"].items():
        assert torch.equal(res["exported"][name], t), name
