"""slime's --custom-config-path with its mismatch helper (examples/train_infer_mismatch_helper: mis.yaml and
`--custom-tis-function-path ...mis.compute_mis_weights_with_cp`): the file's settings become the off-policy
flags, and the weights those flags give equal, on random inputs, a float64 reference of the helper written
out below from mis.yaml's comments and the helper's README (its weights, masks, rejection, veto and batch
normalization per call, one call per micro-batch)."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from slime_rl.algo.offpolicy import correction
from slime_rl.config import ConfigError, build_config
from tests.config.test_from_slime import _base

MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
SLIMES_FILE = Path(__file__).resolve().parents[1] / "migration" / "custom_configs" / "mis.yaml"  # slime 624b824's


def _config(tmp: Path, settings: dict | None, *extra: str):
    path = SLIMES_FILE
    if settings is not None:
        path = tmp / "custom.yaml"
        path.write_text(yaml.safe_dump(settings))
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        cfg = build_config(_base(tmp) + ["--custom-config-path", str(path), "--custom-tis-function-path", MIS,
                                         *extra])
    return cfg, [str(n.message) for n in notes]


def test_slimes_mis_yaml_becomes_the_off_policy_flags_and_says_so(tmp_path):
    # use_tis, use_rs, token levels, truncate at 2.0 (lower bound 0.5 unused by truncate), rs bounds = the tis
    # bounds [0.5, 2.0], veto 1.0e-4, batch normalization
    cfg, notes = _config(tmp_path, None, "--use-tis")
    a = cfg.algo
    assert (a.use_tis, a.tis_level, a.tis_mode, a.tis_clip, a.tis_clip_low) == (True, "token", "truncate", 2.0, 0.0)
    # the helper keeps pi_old / pi_engine in [0.5, 2]; token_k1 bounds pi_engine / pi_old: [1 / 2, 1 / 0.5]
    assert (a.rollout_rs, a.rollout_rs_threshold) == ("token_k1", "0.5_2.0")
    assert a.rollout_rs_veto_threshold == 1e-4 and a.tis_batch_normalize
    (note,) = [n for n in notes if "mismatch helper" in n]
    assert note.startswith(f"--custom-config-path {SLIMES_FILE}: slime's mismatch helper: use_tis, tis_level token")
    assert "--rollout-rs token_k1 --rollout-rs-threshold 0.5_2.0" in note and "--tis-batch-normalize" in note


@pytest.mark.parametrize("settings, want", [
    ({"use_tis": True, "tis_mode": "clip", "tis_upper_bound": 4.0},  # lower bound 1 / upper
     {"tis_mode": "truncate", "tis_clip": 4.0, "tis_clip_low": 0.25, "rollout_rs": None}),
    ({"use_tis": True, "tis_mode": "mask", "tis_level": "geometric", "tis_lower_bound": 0.9999,
      "tis_upper_bound": 1.0001}, {"tis_mode": "mask", "tis_level": "geometric", "tis_clip_low": 0.9999}),
    ({"use_tis": True, "tis_upper_bound": 2.0, "use_rs": True, "rs_level": "sequence", "rs_lower_bound": 0.25,
      "rs_upper_bound": 5.0}, {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.2_4.0",
                               "rollout_rs_veto_threshold": None}),
    ({"use_tis": True, "tis_upper_bound": 2.0, "use_rs": True, "rs_level": "geometric", "rs_veto_threshold": "1e-3"},
     {"rollout_rs": "seq_mean_k1", "rollout_rs_veto_threshold": 1e-3}),  # YAML reads 1e-3 (no dot) as a string
    ({"use_tis": False, "use_rs": True, "tis_upper_bound": 2.0},  # the helper returns before its weights
     {"use_tis": False, "rollout_rs": None, "get_mismatch_metrics": True}),
    ({"use_tis": True, "tis_upper_bound": 2.0, "eps_clip": 0.3}, {"eps_clip": 0.3}),  # any flag by its name
])
def test_the_helpers_settings_map_to_flags(settings, want, tmp_path):
    a = _config(tmp_path, settings, "--eps-clip", "0.1")[0].algo
    assert {k: getattr(a, k) for k in want} == want


@pytest.mark.parametrize("settings, extra, message", [
    ({"use_tis": True}, (), "key 'tis_upper_bound' is required with use_tis"),
    ({"use_tis": True, "tis_upper_bound": 2.0, "tis_mode": "cap"}, (), "key 'tis_mode': 'cap' is not one of"),
    ({"use_tis": True, "tis_upper_bound": 2.0, "tis_mode": "mask", "tis_lower_bound": 3.0}, (),
     "tis_mode mask: tis_lower_bound 3.0 must be below tis_upper_bound 2.0"),
    ({"use_tis": True, "tis_upper_bound": 2.0, "tis_level": "geometric", "tis_batch_normalize": True}, (),
     "tis_batch_normalize with tis_level geometric"),
    ({"use_tis": True, "tis_upper_bound": "two"}, (), "key 'tis_upper_bound': expected a number"),
    ({"use_tis": True, "tis_upper_bound": 2.0}, ("--tis-clip", "3.0"),
     "the mismatch helper's settings give --tis-clip 2.0; the command line gives 3.0: give one"),
    ({"use_tis": True, "tis_upper_bound": 2.0, "not_a_setting": 1}, (), "unknown key 'not_a_setting'"),
    ({"use_tis": True, "tis_upper_bound": 2.0, "loss_mask_type": "qwen"}, (),
     "--loss-mask-type is slime's and has no counterpart here"),
])
def test_bad_settings_are_refused_naming_the_file_and_key(settings, extra, message, tmp_path):
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, settings, *extra)
    assert str(info.value).startswith(f"--custom-config-path {tmp_path / 'custom.yaml'}: ") and message in str(
        info.value), str(info.value)


def test_the_helpers_settings_without_the_helper_are_refused(tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text("use_tis: true\ntis_upper_bound: 2.0\n")
    with pytest.raises(ConfigError, match="is a setting of slime's mismatch helper: it takes effect with "
                                          f"--custom-tis-function-path {MIS}"):
        build_config(_base(tmp_path) + ["--custom-config-path", str(path)])
    path.write_text("eps_clip: 0.3\n")  # a plain flag needs no helper
    assert build_config(_base(tmp_path) + ["--custom-config-path", str(path)]).algo.eps_clip == 0.3


# ---- the weights, against the helper's rules in float64
def helper_reference(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, s: dict) -> torch.Tensor:
    """[B, T]: each token's final multiplier of its pg term under mis.yaml's settings `s` (one call: one
    micro-batch): the weight (0 off the mask) over the batch mean when normalizing, times the rejection mask."""
    upper = s["tis_upper_bound"]
    lower = s.get("tis_lower_bound") or 1.0 / upper
    rs_lower, rs_upper = s.get("rs_lower_bound") or lower, s.get("rs_upper_bound") or upper
    weights, keeps = [], []
    for o, r, m in zip(old.tolist(), rollout.tolist(), mask.tolist(), strict=True):
        d = [a - b for a, b in zip(o, r, strict=True)]
        n = sum(m)

        def at(level: str, d=d, m=m, n=n) -> list[float]:
            if level == "token":
                return list(d)
            total = sum(x * k for x, k in zip(d, m, strict=True))
            return [total if level == "sequence" else total / max(n, 1)] * len(d)

        raw = [math.exp(min(max(x, -20.0), 20.0)) for x in at(s.get("tis_level", "token"))]
        mode = s.get("tis_mode", "truncate")
        keep = list(m)
        if mode == "truncate":
            w = [min(x, upper) * k for x, k in zip(raw, m, strict=True)]
        elif mode == "clip":
            w = [min(max(x, lower), upper) * k for x, k in zip(raw, m, strict=True)]
        else:  # mask: the weight stays, the token leaves the loss
            w = [x * k for x, k in zip(raw, m, strict=True)]
            keep = [k * float(lower <= x <= upper) for x, k in zip(raw, keep, strict=True)]
        if s.get("use_rs"):
            rs = [math.exp(min(max(x, -20.0), 20.0)) for x in at(s.get("rs_level", "token"))]
            keep = [k * float(rs_lower <= x <= rs_upper) for x, k in zip(rs, keep, strict=True)]
            veto = s.get("rs_veto_threshold")
            if veto is not None and any(x < math.log(veto) and k for x, k in zip(d, m, strict=True)):
                keep = [0.0] * len(keep)
        weights.append(w)
        keeps.append(keep)
    if s.get("tis_batch_normalize"):
        if s.get("tis_level", "token") == "token":
            mean = sum(x * k for w, m in zip(weights, mask.tolist(), strict=True) for x, k in zip(w, m, strict=True)) \
                / sum(sum(m) for m in mask.tolist())
        else:  # every row has a trained token here
            means = [sum(x * k for x, k in zip(w, m, strict=True)) / sum(m)
                     for w, m in zip(weights, mask.tolist(), strict=True)]
            mean = sum(means) / len(means)
        if mean > 1e-8:
            weights = [[x / mean for x in w] for w in weights]
    return torch.tensor([[x * k for x, k in zip(w, keep, strict=True)] for w, keep in zip(weights, keeps, strict=True)],
                        dtype=torch.float64)


SETTINGS = [
    {"use_tis": True, "tis_level": level, "tis_mode": mode, "tis_upper_bound": upper, "tis_lower_bound": lower,
     "use_rs": rs_level is not None, "rs_level": rs_level or "token", "rs_veto_threshold": veto,
     "tis_batch_normalize": norm and level != "geometric"}
    for level, mode, (lower, upper), rs_level, veto, norm in itertools.product(
        ("token", "sequence", "geometric"), ("truncate", "clip", "mask"), ((None, 2.0), (0.6, 1.8)),
        (None, "token", "sequence", "geometric"), (None, 0.3), (False, True))
    if not (rs_level is None and veto is not None)
]


def test_the_weights_equal_the_helpers_rules_in_float64(tmp_path):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 0.0  # the prompt's last position, as in a batch
    mask[torch.arange(B), torch.randint(1, T, (B,), generator=g)] = 1.0  # a trained token in every row
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    rollout = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.45
    rejected = normalized = 0
    for s in SETTINGS:
        settings = {k: v for k, v in s.items() if v is not None}
        algo = _config(tmp_path, settings)[0].algo
        fix = correction(old, rollout, mask, algo)
        want = helper_reference(old, rollout, mask, settings)
        assert torch.allclose(fix.weight * mask, want, rtol=1e-12, atol=1e-12), (settings, fix.weight * mask, want)
        rejected += int(fix.rejected.sum() > 0)
        normalized += int(settings["tis_batch_normalize"] and abs(float(fix.norm) - 1.0) > 1e-3)
    # the inputs exercise what is compared: rejections and normalizations that change the weights
    assert rejected > len(SETTINGS) // 3 and normalized > len(SETTINGS) // 8, (rejected, normalized)
