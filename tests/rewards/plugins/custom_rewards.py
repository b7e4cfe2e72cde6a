"""Custom rewards of every supported shape, for the loader tests."""

import asyncio
import threading
import time

CALLS: list[str] = []  # thread names the sync rewards ran on


def dict_reward(sample) -> dict:
    """A dict reward: "score" is the reward, the other numeric keys are metrics, the rest ignored."""
    return {"score": 0.25, "length": float(len(sample.response)), "passed": True, "note": "ignored"}


def slow_sync_reward(sample) -> float:
    """Blocks its thread for 0.2 s, as a heavy rule-based checker would."""
    CALLS.append(threading.current_thread().name)
    time.sleep(0.2)
    return 1.0


async def async_group_reward(samples) -> list[float]:
    await asyncio.sleep(0)
    best = max(len(s.response) for s in samples)
    return [1.0 if len(s.response) == best else 0.0 for s in samples]


def wrong_length_group_reward(samples) -> list[float]:
    return [1.0]


def missing_key_reward(sample) -> dict:
    return {"overall": 1.0}


def nan_reward(sample) -> float:
    return float("nan")
