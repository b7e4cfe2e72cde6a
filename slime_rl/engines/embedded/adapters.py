"""SGLang's LoRA endpoints on the built-in engine, by merging: the engine serves one adapter at a time.

- load_lora_adapter_from_tensors {lora_name, config_dict, serialized_named_tensors, pinned}: PEFT's
  adapter_config as a dict and one entry per device (the first is read, as SGLang's TP rank 0 reads its
  own), holding the adapter's tensors under PEFT's names (`base_model.model.<module>.lora_A.weight` [r, in],
  `lora_B.weight` [out, r]), by value or by reference (engines/tensor_ipc.py).
- load_lora_adapter {lora_name, lora_path, pinned}: the same from a PEFT folder (adapter_config.json +
  adapter_model.safetensors).
- unload_lora_adapter {lora_name}.
Answers are SGLang's {success, error_message, loaded_adapters}.

SGLang applies each request's adapter beside the base weights (its LoRA kernels). This engine has no such
kernels: the newest loaded adapter is merged into the weights it adapts, `W + B A alpha / r` computed in
fp32 from a kept copy of the base and rounded once to the weight's dtype (the trainer's `lora.merged`), and
every request runs under it. A request may name any loaded adapter (SGLang's `lora_path`; one loaded
before the newest is served by the newest, as a full weight update serves a running request the new
weights); one naming an adapter that is not loaded, or none while one is loaded (the base is not at hand),
is refused with a 400 naming the loaded ones. Unloading the newest merges the one loaded before it, or
restores the base. A full weight update of an adapted weight replaces the kept base, and the adapter is
merged over it again (SGLang keeps serving an adapter over updated base weights).

The copies of the base cost the memory of every adapted weight once more; they stay on a colocated
release of the weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from slime_rl.engines.embedded.engine import Engine
from slime_rl.engines.embedded.sampling import RequestError
from slime_rl.engines.tensor_ipc import UnsafePayloadError, deserialize_named_tensors

logger = logging.getLogger(__name__)
PREFIX, SUFFIXES = "base_model.model.", (".lora_A.weight", ".lora_B.weight")


class Adapter:
    """One loaded adapter: {weight name: (A, B)} and its scale alpha / r."""

    def __init__(self, name: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        self.name, self.pairs, self.scale = name, pairs, scale


class EngineAdapters:
    def __init__(self, engine: Engine, params: dict[str, torch.Tensor]) -> None:
        self.engine, self.params = engine, params
        self.loaded: dict[str, Adapter] = {}  # in load order: the last is the one merged
        self.base: dict[str, torch.Tensor] = {}  # weight name -> the base, for every weight an adapter touched

    @property
    def active(self) -> Adapter | None:
        return next(reversed(self.loaded.values()), None)

    # ---- endpoints: (ok, message) -> SGLang's LoRAUpdateOutput ----
    def answer(self, ok: bool, message: str) -> dict[str, Any]:
        return {"success": ok, "error_message": None if ok else message,
                "loaded_adapters": {n: "__tensor__" for n in self.loaded}}

    def load_from_tensors(self, body: dict) -> tuple[bool, str]:
        name, config = self._name(body), _config(body.get("config_dict"))
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            raise RequestError("serialized_named_tensors: expected a list of base64 strings, one per device")
        try:
            tensors = dict(deserialize_named_tensors(entries[0]))
        except UnsafePayloadError as e:
            raise RequestError(str(e)) from e
        return self._load(name, config, tensors)

    def load_from_path(self, body: dict) -> tuple[bool, str]:
        from safetensors.torch import load_file

        name, path = self._name(body), body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise RequestError("lora_path: a PEFT adapter folder is required")
        root = Path(path)
        files = (root / "adapter_config.json", root / "adapter_model.safetensors")
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            return False, f"LoRA adapter folder {path} has no {', '.join(missing)}"
        config = _config(json.loads(files[0].read_text()))
        return self._load(name, config, load_file(str(files[1])))

    def unload(self, body: dict) -> tuple[bool, str]:
        name = body.get("lora_name")
        if name not in self.loaded:
            return False, f"LoRA adapter {name!r} is not loaded (loaded: {', '.join(self.loaded) or 'none'})"
        before = self.active
        del self.loaded[name]
        if before is not None and before.name == name:
            self._merge(before, self.active)
        return True, ""

    # ---- requests and full weight updates ----
    def refusal(self, body: Any) -> str | None:
        """Why a /generate body cannot run under the loaded adapters (its `lora_path`), or None."""
        given = body.get("lora_path") if isinstance(body, dict) else None
        names = given if isinstance(given, list) else [given]
        for lp in names:
            if lp is None and self.loaded:
                return (f"lora_path: the built-in engine serves its newest adapter ({self.active.name}) merged into "
                        "its weights, not the base; name a loaded adapter")
            if lp is not None and lp not in self.loaded:
                return (f"lora_path: adapter {lp!r} is not loaded (loaded: {', '.join(self.loaded) or 'none'})")
        return None

    def base_written(self, names: list[str]) -> None:
        """A full weight update wrote these weights: the adapted ones are the new base, merged again."""
        touched = [n for n in names if n in self.base]
        if not touched:
            return
        with self.engine.weights_exclusive(), torch.no_grad():
            for n in touched:
                self.base[n] = self.params[n].detach().clone()
            active = self.active
            if active is not None:
                for n in touched:
                    self._write(n, active)

    # ---- internals ----
    def _name(self, body: dict) -> str:
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError("lora_name: a non-empty string is required")
        return name

    def _load(self, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> tuple[bool, str]:
        if name in self.loaded:
            return False, f"Failed to load LoRA adapter {name} because it is already loaded"
        try:
            pairs = self._pairs(tensors)
        except ValueError as e:
            return False, f"Failed to load LoRA adapter {name}: {e}"
        adapter = Adapter(name, pairs, float(config["lora_alpha"]) / float(config["r"]))
        before = self.active
        self.loaded[name] = adapter
        self._merge(before, adapter)
        logger.info("embedded engine: LoRA adapter %s loaded (%d weights, scale %g)", name, len(pairs),
                    adapter.scale)
        return True, ""

    def _pairs(self, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
            if not key.startswith(PREFIX) or suffix is None:
                raise ValueError(f"{key}: not a LoRA tensor under PEFT's names (base_model.model.<module>"
                                 ".lora_A.weight / .lora_B.weight)")
            modules.setdefault(key[len(PREFIX):-len(suffix)], {})[suffix[1:7]] = t
        pairs = {}
        for module, ab in modules.items():
            weight = f"{module}.weight"
            if set(ab) != {"lora_A", "lora_B"}:
                raise ValueError(f"{module}: has {', '.join(sorted(ab))} only (lora_A and lora_B are needed)")
            if weight not in self.params:
                raise ValueError(f"{module}: this model has no weight {weight}")
            a, b = ab["lora_A"], ab["lora_B"]
            shape = tuple(self.params[weight].shape)
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != shape:
                raise ValueError(f"{module}: lora_B {tuple(b.shape)} x lora_A {tuple(a.shape)} does not make the "
                                 f"weight's {shape}")
            pairs[weight] = (a.to(self.params[weight].device), b.to(self.params[weight].device))
        return pairs

    def _merge(self, before: Adapter | None, after: Adapter | None) -> None:
        """Replace `before`'s merge by `after`'s: every weight either adapts is written from its base. The
        engine pauses in place around it (running requests go on under `after`), unless paused already."""
        names = set(before.pairs if before else ()) | set(after.pairs if after else ())
        pause_here = self.engine.paused is None
        if pause_here:
            self.engine.pause("in_place")
        try:
            with self.engine.weights_exclusive(), torch.no_grad():
                self.engine.wait_weights()
                for n in sorted(names):
                    self._write(n, after)
        finally:
            if pause_here:
                self.engine.resume()

    def _write(self, name: str, adapter: Adapter | None) -> None:
        param = self.params[name]
        base = self.base.setdefault(name, param.detach().clone())
        if adapter is None or name not in adapter.pairs:
            param.copy_(base)
            return
        a, b = adapter.pairs[name]
        param.copy_((base.float() + (b.float() @ a.float()) * adapter.scale).to(param.dtype))


def _config(config: Any) -> dict:
    """PEFT's adapter_config: a LoRA of r and lora_alpha, without DoRA (refused as SGLang refuses it)."""
    if not isinstance(config, dict):
        raise RequestError("config_dict: PEFT's adapter_config as a JSON object is required")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise RequestError(f"config_dict: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise RequestError("config_dict: DoRA adapters are not supported (as in SGLang's LoRA serving)")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise RequestError(f"config_dict: {key} must be a positive number")
    return config
