from slime_rl.observability.metrics import REQUIRED_KEYS, MetricsLogger, Timer, summary_line
from slime_rl.observability.progress import Progress, StepClock, format_duration

__all__ = ["REQUIRED_KEYS", "MetricsLogger", "Progress", "StepClock", "Timer", "format_duration", "summary_line"]
