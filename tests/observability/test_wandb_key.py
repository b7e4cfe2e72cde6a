"""slime's --wandb-key: wandb logs in with it; it never reaches a printed config or the run's config."""

from __future__ import annotations

import os

from slime_rl.config import LoggingConfig, build_config
from slime_rl.observability import MetricsLogger
from tests.config.test_config import base_argv

KEY = "0123456789abcdef" * 3


def test_the_key_reaches_wandb_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = build_config(base_argv(tmp_path) + ["--use-wandb", "--wandb-mode", "offline", "--wandb-key", KEY])
    assert cfg.logging.wandb_key == KEY
    assert KEY not in repr(cfg) and KEY not in str(cfg.to_dict())  # what is printed and what wandb records
    logger = MetricsLogger(LoggingConfig(run_dir=str(tmp_path / "run"), use_wandb=True, wandb_mode="offline",
                                         wandb_key=KEY), cfg.to_dict())
    try:
        assert os.environ["WANDB_API_KEY"] == KEY  # what wandb.init logs in with
    finally:
        logger.close()
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert not written, written


def test_team_and_host_reach_wandb(tmp_path, monkeypatch):
    """slime's --wandb-team is wandb's entity and --wandb-host its server (WANDB_BASE_URL), as slime passes them."""
    import wandb

    monkeypatch.setenv("WANDB_BASE_URL", "unset-after-the-test")
    monkeypatch.delenv("WANDB_BASE_URL")
    cfg = build_config(base_argv(tmp_path) + ["--use-wandb", "--wandb-team", "my-team", "--wandb-host",
                                              "https://wandb.example.org"])
    assert (cfg.logging.wandb_team, cfg.logging.wandb_host) == ("my-team", "https://wandb.example.org")
    seen = {}

    def init(**kwargs):
        seen.update(kwargs, base_url=os.environ.get("WANDB_BASE_URL"))
        raise RuntimeError("stop here")  # what reaches wandb.init is all this test checks

    monkeypatch.setattr(wandb, "init", init)
    log_cfg = LoggingConfig(run_dir=str(tmp_path / "run"), use_wandb=True, wandb_team="my-team",
                            wandb_host="https://wandb.example.org")
    try:
        MetricsLogger(log_cfg)
    except RuntimeError as exc:
        assert str(exc) == "stop here"
    assert seen["entity"] == "my-team" and seen["base_url"] == "https://wandb.example.org"
