from slime_rl.observability.metrics import REQUIRED_KEYS, MetricsLogger, Timer, summary_line

__all__ = ["REQUIRED_KEYS", "MetricsLogger", "Timer", "summary_line"]
