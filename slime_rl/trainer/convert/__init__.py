"""HF <-> Megatron name/shape maps per model family (keyed by HF `model_type`)."""

from slime_rl.config.families import FAMILIES, Family, Layout, ParamMap, get_family
from slime_rl.trainer.convert.arch import (
    ModelArch,
    arch_from_hf_config,
    hf_shapes,
    load_arch,
    read_hf_config,
    with_mtp,
)
from slime_rl.trainer.convert.shards import hf_to_mcore_shard, mcore_param_to_hf_views, mcore_shape, mcore_shards_to_hf

__all__ = [
    "FAMILIES", "Family", "Layout", "ModelArch", "ParamMap", "arch_from_hf_config", "get_family",
    "hf_shapes", "hf_to_mcore_shard", "load_arch", "mcore_param_to_hf_views", "mcore_shape",
    "mcore_shards_to_hf", "read_hf_config", "with_mtp",
]
