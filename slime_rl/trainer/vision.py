"""Qwen2.5-VL and Qwen3.5 in the Megatron trainer: the language decoder is megatron-core's GPTModel with mRoPE,
the vision tower is the HF module (convert/vision.py) attached to the first stage.

Why the HF tower and not a Megatron one: it is the engine's exact module (the built-in engine runs
HF Qwen2.5-VL; SGLang ports the same code), so image features agree between rollout and training by
construction, and its weights load and sync under their checkpoint names. It is small next to the
decoder (0.67B of 7B) and runs replicated on every TP rank of stage 0 (its input, the pixels, is the
same there); its gradient arrives identical on every TP rank because the decoder's input gradient
is all-reduced over TP by megatron's column-parallel layers, so no extra reduction is needed.

Per micro-batch (`VisionBatching.attach`):
- positions become Qwen2.5-VL's 3-D mRoPE positions ([3, b, s], or [3, 1, t] packed), computed per
  sample from its tokens and image grids (data/mrope.py), on every pipeline stage (each layer
  rotates q/k); megatron's `MultimodalRotaryEmbedding` turns them into per-token frequencies (Qwen3.5:
  `InterleavedMultimodalRotaryEmbedding`, its sections interleaved). Qwen3.5's rule for the positions is
  Qwen2.5-VL's for still images (transformers' Qwen3_5Model.get_rope_index);
- the first stage gets pixel_values (the checkpoint's image processor on the sample's PNG data
  URLs, as the engine does) and a mask of the prompt's <|image_pad|> positions: a pad id sampled
  in a response is text, as in the engine.
`decoder_input` then runs the tower and writes its features into the word embeddings at the mask.
Context parallelism is not supported with images (refused at config time).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slime_rl.data.images import load_image_processor, pixel_inputs
from slime_rl.data.mrope import mrope_positions
from slime_rl.trainer.convert import ModelArch
from slime_rl.trainer.convert.vision import vision_module
from slime_rl.trainer.mcore import tensor_parallel


@dataclass
class VisionInputs:
    """A micro-batch's image inputs (first stage only; None elsewhere)."""

    pixel_values: Tensor | None  # [patches, C * T * P * P], images in sample order
    image_grid_thw: Tensor | None  # [images, 3]
    image_mask: Tensor  # [b, s] (or [1, t] packed) bool: where image features go


def attach_vision_tower(gpt: torch.nn.Module, arch: ModelArch) -> None:
    """Give a first-stage GPTModel its vision tower (`gpt.vision_model`, random until the HF weights
    load) and make its embedding return the full [s, b, h] sequence, so the image features can be
    written in before the sequence-parallel scatter (GPTModel scatters when the embedding does not)."""
    assert arch.vision is not None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpt.vision_model = vision_module(arch.vision.config, device=device, model_type=arch.vision.model_type)
    emb = gpt.embedding
    emb.scatter_to_sequence_parallel = False
    emb.reduce_scatter_embeddings = False
    emb.word_embeddings.reduce_scatter_embeddings = False


class InterleavedMultimodalRotaryEmbedding(torch.nn.Module):
    """Qwen3.5's 3-D rotary frequencies (transformers' Qwen3_5TextRotaryEmbedding): rotary frequency j of a token
    takes its height position when j % 3 == 1 and j < 3 x sections[1], its width position when j % 3 == 2 and
    j < 3 x sections[2], else its time position; the halves of the rotary channels repeat the frequencies (megatron's
    non-interleaved pairs). megatron-core 0.19's MultimodalRotaryEmbedding gives each axis a consecutive block of
    frequencies instead (Qwen2.5-VL), so the trainer replaces the GPTModel's with this one; same call and output
    ([s, b, 1, rotary dim] from positions [3, b, s])."""

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_base: float, device: Any = None) -> None:
        super().__init__()
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))

    def forward(self, position_ids: Tensor, mrope_section: list[int], cp_group: Any = None) -> Tensor:
        seq = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)  # [3, b, s]
        freqs = seq[..., None] * self.inv_freq  # [3, b, s, dim / 2]
        mixed = freqs[0].clone()
        for axis in (1, 2):
            mixed[..., axis:3 * mrope_section[axis]:3] = freqs[axis, ..., axis:3 * mrope_section[axis]:3]
        emb = torch.cat((mixed, mixed), dim=-1)  # [b, s, dim]
        return emb[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, dim]


def float_buffers(module: torch.nn.Module) -> dict[str, Tensor]:
    """Copies of the floating-point buffers (the vision RoPE's inv_freq): Float16Module casts every
    buffer to bf16, HF keeps these in float32; `restore_buffers` puts them back after wrapping."""
    return {n: b.detach().clone() for n, b in module.named_buffers() if b.is_floating_point()}


def restore_buffers(module: torch.nn.Module, saved: dict[str, Tensor]) -> None:
    for name, value in saved.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._buffers[attr] = value.to(owner._buffers[attr].device)


def freeze_vision_tower(gpt: torch.nn.Module) -> int:
    """--freeze-vision-tower: no gradients, no optimizer state, not re-sent by weight sync.
    Returns the number of frozen parameters (0 off the first stage)."""
    tower = getattr(gpt, "vision_model", None)
    if tower is None:
        return 0
    for p in tower.parameters():
        p.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


class VisionBatching:
    """Builds the mRoPE positions and image inputs of micro-batches (see the module docstring)."""

    def __init__(self, arch: ModelArch, hf_checkpoint: str, with_pixels: bool, cache_size: int = 256) -> None:
        assert arch.vision is not None
        self.image_token_id = arch.vision.image_token_id
        self.merge = arch.vision.spatial_merge_size
        self.with_pixels = with_pixels
        self.hf_checkpoint = hf_checkpoint
        self._processor: Any = None
        # the n samples of a prompt share its images, and each step runs 2-3 passes over the batch
        self._cache: OrderedDict[str, tuple[Tensor, list[int]]] = OrderedDict()
        self._cache_size = cache_size

    def _pixels(self, url: str) -> tuple[Tensor, list[int]]:
        hit = self._cache.get(url)
        if hit is not None:
            self._cache.move_to_end(url)
            return hit
        if self._processor is None:
            self._processor = load_image_processor(self.hf_checkpoint)
            if self._processor is None:
                raise ValueError(f"{self.hf_checkpoint}: no preprocessor_config.json, but the batch has images")
        out = pixel_inputs(self._processor, [url])
        hit = (out["pixel_values"], [int(x) for x in out["image_grid_thw"][0].tolist()])
        self._cache[url] = hit
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return hit

    def attach(self, mb: Any, batch: dict, sample_ids: list[int]) -> None:
        """Replace mb.position_ids by mRoPE positions and set mb.vision (in place)."""
        packed = mb.packed_seq_params is not None
        starts = mb.packed_seq_params.cu_seqlens_q.tolist() if packed else [0] * len(sample_ids)
        pos = mb.position_ids.cpu().unsqueeze(0).repeat(3, 1, 1)  # [3, b, s]; padding keeps its plain positions
        mask = torch.zeros(mb.tokens.shape, dtype=torch.bool)
        grids_all = batch.get("image_grid_thw")
        urls: list[str] = []
        for k, i in enumerate(sample_ids):
            tokens = list(batch["tokens"][i])
            n_prompt = len(tokens) - int(batch["response_lengths"][i])
            grids = list(grids_all[i]) if grids_all is not None else []
            p, _ = mrope_positions(tokens, self.image_token_id, grids, self.merge, n_prompt)
            row, off = (0, starts[k]) if packed else (k, 0)
            pos[:, row, off:off + len(tokens)] = p
            prompt = torch.tensor(tokens[:n_prompt])
            mask[row, off:off + n_prompt] = prompt == self.image_token_id
            images = list(batch["images"][i]) if "images" in batch else []
            if len(images) != len(grids):
                raise ValueError(f"trainer batch sample {i}: {len(images)} image(s) but {len(grids)} image grid(s)")
            urls += images
        device = mb.tokens.device
        mb.position_ids = pos.to(device)
        pixels = grid_thw = None
        if self.with_pixels and urls:
            parts = [self._pixels(u) for u in urls]
            want = [list(g) for i in sample_ids for g in (grids_all[i] if grids_all is not None else [])]
            got = [g for _, g in parts]
            if got != want:
                raise ValueError(f"the image processor of {self.hf_checkpoint} gives grids {got} for this "
                                 f"micro-batch's images, the rollout recorded {want}")
            pixels = torch.cat([p for p, _ in parts]).to(device)
            grid_thw = torch.tensor(got, dtype=torch.long, device=device)
        mb.vision = VisionInputs(pixel_values=pixels, image_grid_thw=grid_thw, image_mask=mask.to(device))


def decoder_input(gpt: torch.nn.Module, mb: Any) -> Tensor:
    """The first stage's decoder input [s, b, h] (the local sequence part under SP): word
    embeddings with the vision tower's features at the image pads."""
    emb = gpt.embedding(input_ids=mb.tokens, position_ids=None)  # [s, b, h], not scattered (attach_vision_tower)
    v = mb.vision
    if v.pixel_values is not None:
        tower = gpt.vision_model
        pixels = v.pixel_values.to(next(tower.parameters()).dtype)
        feats = tower(pixels, grid_thw=v.image_grid_thw).pooler_output
        # masked_scatter fills in [b, s] row-major order: sample by sample, the images in prompt order
        emb = emb.transpose(0, 1).masked_scatter(v.image_mask.unsqueeze(-1), feats.to(emb.dtype))
        emb = emb.transpose(0, 1).contiguous()
    if gpt.config.sequence_parallel:
        emb = tensor_parallel.scatter_to_sequence_parallel_region(emb).clone()
    return emb
