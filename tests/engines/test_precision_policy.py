"""The engine's bf16 precision policy (engines/embedded/precision.py): the fp32 islands SGLang keeps,
checked against float64 references and against the trainer's own norm (torch.nn.RMSNorm)."""

from __future__ import annotations

import pytest
import torch

from slime_rl.engines.embedded.precision import ENV, apply_precision_policy, islands_from_env


@pytest.fixture()
def llama_bf16(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.bfloat16).eval()


def test_rmsnorm_rounds_once_like_sglang_and_the_trainer(llama_bf16, monkeypatch):
    monkeypatch.setenv(ENV, "rmsnorm")
    norm = llama_bf16.model.layers[0].input_layernorm
    torch.manual_seed(0)
    norm.weight.data = (torch.rand_like(norm.weight, dtype=torch.float32) * 2).bfloat16()
    x = (torch.randn(16, norm.weight.numel()) * 3).bfloat16()
    stock = norm(x)
    assert apply_precision_policy(llama_bf16) == ["rmsnorm x5"]  # 2 layers x 2 norms + the final norm
    got = norm(x)
    x64 = x.double()
    ref = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double())
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref.bfloat16())  # one rounding, at the end
    trainer_norm = torch.nn.RMSNorm(x.shape[-1], eps=norm.variance_epsilon, dtype=torch.bfloat16)
    trainer_norm.weight.data = norm.weight.data.clone()
    assert torch.equal(got, trainer_norm(x))  # Megatron's local-spec norm rounds the same way
    assert not torch.equal(stock, got)  # stock HF rounds before the weight product: it differs


def test_lm_head_gives_fp32_logits_and_follows_weight_updates(llama_bf16, monkeypatch):
    monkeypatch.setenv(ENV, "lm_head")
    assert apply_precision_policy(llama_bf16) == ["lm_head"]
    head = llama_bf16.get_output_embeddings()
    h = torch.randn(3, 5, head.in_features).bfloat16()
    logits = head(h)
    ref = h.double() @ head.weight.double().T
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-5)  # fp32 accumulation, no bf16 rounding
    with torch.no_grad():
        head.weight.mul_(2)  # an in-place weight sync must be seen by the patched forward
    torch.testing.assert_close(head(h).double(), 2 * ref, rtol=1e-5, atol=1e-5)


def test_attn_scores_keep_the_decode_scores_in_fp32(llama_bf16, monkeypatch):
    """The static decode step's attention (attention.py) with the island takes q.k in fp32 as flash
    attention does; bf16 scores of ~20 round in steps of 0.125 and move the softmax. Checked
    against float64 attention on the same bf16 inputs."""
    from slime_rl.engines.embedded.attention import FP32_SCORES, decode_attention

    monkeypatch.setenv(ENV, "attn_scores")
    attn = llama_bf16.model.layers[0].self_attn
    assert apply_precision_policy(llama_bf16) == ["attn_scores x2"] and getattr(attn, FP32_SCORES)
    torch.manual_seed(0)
    B, H, Hkv, T, D = 4, 4, 2, 64, 16
    q = (torch.randn(B, H, 1, D) * 3).bfloat16()
    k, v = (torch.randn(B, Hkv, T, D) * 3).bfloat16(), torch.randn(B, Hkv, T, D).bfloat16()
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    # float64 reference: query head h reads KV head h // (H / Hkv)
    kk, vv = k.double().repeat_interleave(H // Hkv, 1), v.double().repeat_interleave(H // Hkv, 1)
    p = torch.softmax(q.double() @ kk.transpose(-1, -2) * D ** -0.5, dim=-1)
    ref = (p @ vv).transpose(1, 2)  # [B, 1, H, D]
    err_fp32 = (decode_attention(attn, q, k, v, mask)[0].double() - ref).abs().mean().item()
    plain = torch.nn.Module()  # no island flag: bf16 scores
    err_bf16 = (decode_attention(plain, q, k, v, mask)[0].double() - ref).abs().mean().item()
    assert err_fp32 < 0.5 * err_bf16, (err_fp32, err_bf16)  # measured 0.22-0.29x over seeds 0-4


def test_the_flag_chooses_the_islands_when_the_env_is_unset(tiny_llama, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.delenv(ENV, raising=False)
    stock = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.bfloat16).eval()
    # RMSNorm always rounds as SGLang's; fp32 logits only with --enable-fp32-lm-head, as in SGLang
    assert apply_precision_policy(stock) == ["rmsnorm x5", "attn_scores x2"]
    h = torch.randn(2, stock.config.hidden_size).bfloat16()
    assert stock.get_output_embeddings()(h).dtype == torch.bfloat16
    fp32_head = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.bfloat16).eval()
    assert apply_precision_policy(fp32_head, fp32_lm_head=True) == ["rmsnorm x5", "attn_scores x2", "lm_head"]
    assert fp32_head.get_output_embeddings()(h).dtype == torch.float32


def test_fp32_models_and_none_are_untouched(tiny_llama, llama_bf16, monkeypatch):
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    assert apply_precision_policy(fp32) == []
    monkeypatch.setenv(ENV, "none")
    assert apply_precision_policy(llama_bf16) == []
    monkeypatch.setenv(ENV, "rmsnorm,softmax")
    with pytest.raises(ValueError, match=r"SLIME_RL_FP32_ISLANDS='rmsnorm,softmax': unknown island\(s\) \['softmax'\]"):
        islands_from_env()


def test_rope_gives_the_trainers_bits_in_bf16():
    """The deterministic decode path (--enable-deterministic-inference) relies on every op outside
    the GEMMs and attention rounding as the trainer's: HF's Llama RoPE (frequencies as a matmul,
    cos/sin cast to bf16, q*cos + rotate_half(q)*sin) against megatron's (an outer product,
    `_apply_rotary_pos_emb_bshd`, which trainer/packed_rope.py's THD path calls), on SmolLM2's head
    dim and base, positions 0..399, in bf16: bit for bit."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    cfg.rope_parameters = {"rope_theta": 1e5, "rope_type": "default"}
    T = 400
    torch.manual_seed(0)
    q = (torch.randn(1, 9, T, 64) * 3).bfloat16()
    cos, sin = LlamaRotaryEmbedding(cfg)(q, torch.arange(T)[None])
    hf = apply_rotary_pos_emb(q, q, cos, sin)[0]
    rope = RotaryEmbedding(kv_channels=64, rotary_percent=1.0, rotary_base=1e5, use_cpu_initialization=True)
    f = rope.get_freqs_non_repeated(T)  # get_emb without its move to the GPU
    freqs = torch.cat((f, f), dim=-1)[:, None, None, :]
    mg = rope_utils._apply_rotary_pos_emb_bshd(q[0].permute(1, 0, 2)[:, None], freqs)[:, 0].permute(1, 0, 2)[None]
    assert torch.equal(hf, mg)
    # and a rounding difference would show: the same rotation in fp32, rounded once at the end
    from transformers.models.llama.modeling_llama import rotate_half

    cos32, sin32 = torch.cos(freqs[:, 0, 0]), torch.sin(freqs[:, 0, 0])
    other = (q.float() * cos32 + rotate_half(q).float() * sin32).bfloat16()
    assert not torch.equal(other, hf)
