"""EasyR1's nested config (`data` / `algorithm` / `worker.actor|rollout|ref|critic|reward` /
`trainer`, verl/trainer/config.py and verl/workers/*/config.py) as our flags.

`--config FILE` whose top level holds those sections is read here: every key becomes our flag(s)
(`map_easyr1`), or is listed as not applicable with the reason (FSDP, offload, vLLM internals), or
is an error naming it when it would change training in a way this project cannot do (LoRA rank > 0,
an adaptive KL controller, EasyR1's remax estimator, ...). Keys EasyR1 gives a default and the file
leaves out are mapped with EasyR1's default when the default changes training (`EASYR1_DEFAULTS`),
so the run does what the same file does in EasyR1. The mapping is printed (`describe`), one line per
key. The command line still wins over the file.

Counting differences: EasyR1's `worker.actor.global_batch_size` counts prompts, ours samples (x
`worker.rollout.n`); its `lr_warmup_steps` count rollout steps, our `--lr-warmup-iters` optimizer
steps (x rollout_batch_size / global_batch_size). EasyR1 places actor and rollout on the same GPUs
(hybrid engine): here `--colocate`, the engines on the trainer's `nnodes x n_gpus_per_node` GPUs.

EasyR1's own command line (`config=FILE section.key=value ...`, `split_cli` / `merge_cli`) is read by OmegaConf
as EasyR1's main reads it, then mapped as a file is.

Each section is one function over an `EasyR1Context` (config/easyr1_context.py: the keys, the values
derived from them, the rule helpers), run in the order of `SECTION_MAPPERS`: `data`, `algorithm` and
`trainer` in config/easyr1_sections.py, the `worker.*` sections in config/easyr1_worker.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from slime_rl.config.easyr1_context import EasyR1Context, Mapping
from slime_rl.config.easyr1_sections import map_algorithm, map_data, map_trainer
from slime_rl.config.easyr1_worker import map_actor, map_critic, map_reward, map_rollout

__all__ = ["DICT_KEYS", "EASYR1_DEFAULTS", "SECTIONS", "SECTION_MAPPERS", "EasyR1Context", "Mapping", "describe",
           "flatten", "is_easyr1", "map_easyr1", "merge_cli", "split_cli"]

SECTIONS = ("data", "algorithm", "worker", "trainer")
# dict-valued keys: a value, not a section to walk into
DICT_KEYS = ("worker.actor.model.override_config", "worker.critic.model.override_config",
             "worker.rollout.val_override_config", "worker.reward.reward_function_kwargs")

# EasyR1's defaults that change training, for keys a file leaves out (verl/trainer/config.py,
# verl/workers/actor/config.py, verl/workers/rollout/config.py of EasyR1)
EASYR1_DEFAULTS: dict[str, Any] = {
    "data.prompt_key": "prompt", "data.answer_key": "answer", "data.image_key": "images",
    "data.max_prompt_length": 512, "data.max_response_length": 512, "data.rollout_batch_size": 512,
    "data.shuffle": True, "data.seed": 1, "data.min_pixels": 262144, "data.max_pixels": 4194304,
    "algorithm.gamma": 1.0, "algorithm.lam": 1.0, "algorithm.adv_estimator": "grpo", "algorithm.disable_kl": False,
    "algorithm.use_kl_loss": False, "algorithm.kl_penalty": "kl", "algorithm.kl_coef": 1e-3,
    "worker.actor.global_batch_size": 256, "worker.actor.micro_batch_size_per_device_for_update": 4,
    "worker.actor.max_grad_norm": 1.0, "worker.actor.clip_ratio_low": 0.2, "worker.actor.clip_ratio_high": 0.3,
    "worker.actor.clip_ratio_dual": 3.0, "worker.actor.loss_avg_mode": "token",
    "worker.actor.optim.lr": 1e-6, "worker.actor.optim.betas": [0.9, 0.999], "worker.actor.optim.weight_decay": 1e-2,
    "worker.rollout.n": 1, "worker.rollout.temperature": 1.0, "worker.rollout.top_p": 1.0,
    "worker.rollout.top_k": -1, "trainer.total_epochs": 15,
}

# the section mappers, in the order they run: the order of the printed mapping's lines
SECTION_MAPPERS: tuple[tuple[str, Callable[[EasyR1Context], None]], ...] = (
    ("data", map_data),
    ("algorithm", map_algorithm),
    ("worker.actor", map_actor),
    ("worker.critic", map_critic),
    ("worker.rollout", map_rollout),
    ("worker.reward", map_reward),
    ("trainer", map_trainer),
)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"worker": {"actor": {"optim": {"lr": 1}}}} -> {"worker.actor.optim.lr": 1} (DICT_KEYS stay whole)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in DICT_KEYS:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def is_easyr1(data: dict[str, Any]) -> bool:
    """Whether a --config mapping is EasyR1's nested layout (a section holding a mapping)."""
    return any(isinstance(data.get(s), dict) for s in SECTIONS)


def map_easyr1(data: dict[str, Any], where: str, error: type[Exception], backend: str | None = None) -> Mapping:
    """EasyR1's nested config -> our flags (see the module docstring), SECTION_MAPPERS in order. `where`:
    how errors name the file; `backend`: --rollout-backend from the command line (default: sglang,
    EasyR1's vLLM's counterpart)."""
    unknown_top = sorted(str(k) for k in data if k not in SECTIONS)
    if unknown_top:
        raise error(f"{where}: EasyR1 layout, unknown section(s) {unknown_top} (expected {', '.join(SECTIONS)})")
    given = flatten(data)
    ctx = EasyR1Context({**EASYR1_DEFAULTS, **given}, given, where, error, backend)
    for _section, mapper in SECTION_MAPPERS:
        mapper(ctx)
    unknown = sorted(k for k in given if k not in ctx.handled)
    if unknown:
        raise error(f"{where}: EasyR1 key(s) with no mapping: {', '.join(unknown)}")
    return ctx.m


def describe(mapping: Mapping, where: str) -> str:
    """The printed mapping: one line per EasyR1 key."""
    return "\n".join([f"[slime_rl] {where}: EasyR1 config, mapped to flags (the command line still wins):",
                      *mapping.lines])


# EasyR1's own command line (`python3 -m verl.trainer.main config=examples/config.yaml worker.actor.loss_type=cispo
# trainer.n_gpus_per_node=8`): OmegaConf's dotted `key=value`, `config=` naming the file the others go over
CLI_TOKEN = re.compile(r"(?:config|(?:data|algorithm|worker|trainer)(?:\.[A-Za-z_]\w*)+)=", re.ASCII)


def split_cli(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """argv -> (its other tokens, EasyR1's own overrides: `config=FILE` and `section.key=value`, in order)."""
    rest: list[str] = []
    overrides: list[str] = []
    for tok in argv:
        (overrides if CLI_TOKEN.match(tok) else rest).append(tok)
    return rest, overrides


def merge_cli(overrides: Sequence[str], read_file: Callable[[str], Any], error: type[Exception]) -> tuple[dict, str]:
    """EasyR1's main on its command line (verl/trainer/main.py): the `config=` file, then the other overrides
    merged over it by OmegaConf (`OmegaConf.from_cli`: a value is parsed as OmegaConf parses it, `True`, `3e-4`,
    `'{"n":16}'`, `'["console","wandb"]'`). Returns the merged mapping as plain data and how errors name it.
    `read_file`: how the file is read (the --config reader: duplicate keys are errors)."""
    try:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException
    except ImportError as exc:
        raise error(f"{overrides[0]}: EasyR1's command-line overrides are read by OmegaConf, as EasyR1 reads them: "
                    "pip install 'slime-rl[easyr1]' (or omegaconf)") from exc
    files = [tok.partition("=")[2] for tok in overrides if tok.startswith("config=")]
    dotted = [tok for tok in overrides if not tok.startswith("config=")]
    if len(files) > 1:
        raise error(f"EasyR1 command line: config= is given {len(files)} times ({', '.join(files)}); give one file")
    where = (f"EasyR1 command line config={files[0]}" if files else "EasyR1 command line") + (
        f" with {len(dotted)} override(s)" if dotted else "")
    base = read_file(files[0]) if files else {}
    if not isinstance(base, dict) or (base and not is_easyr1(base)):
        raise error(f"config={files[0]}: not EasyR1's layout (a file whose top level holds {', '.join(SECTIONS)}); "
                    "a file of this project's flags is --config FILE")
    try:
        merged = OmegaConf.merge(OmegaConf.create(base), OmegaConf.from_dotlist(list(dotted)))
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise error(f"{where}: {' '.join(str(exc).split())}") from exc
    return data, where
