"""Reward functions that raise, for the failure policy (--reward-failure-value) tests."""

from __future__ import annotations

from slime_rl.data import Sample

BROKEN_FROM = 32  # flaky_then_broken: every sample from this index on raises (step 1 of 8 x 4 samples)


def flaky(sample: Sample) -> float:
    """Raises on every third sample index; 1.0 otherwise."""
    if sample.index % 3 == 0:
        raise ZeroDivisionError(f"flaky on purpose (sample {sample.index})")
    return 1.0


def always_broken(sample: Sample) -> float:
    raise KeyError("broken reward")


def flaky_then_broken(sample: Sample) -> float:
    """`flaky` on the first BROKEN_FROM samples, then raises on every sample."""
    if sample.index >= BROKEN_FROM:
        raise KeyError(f"broken from sample {BROKEN_FROM} on")
    return flaky(sample) * float(len(sample.response) % 2)


def group_flaky(samples: list[Sample]) -> list[float]:
    """`--group-rm` form: a group containing a sample index divisible by 5 raises; 1.0 for the others."""
    if any(s.index % 5 == 0 for s in samples):
        raise ValueError(f"group {samples[0].group_index} broken on purpose")
    return [1.0] * len(samples)


HANG = __import__("threading").Event()  # never set: what the hanging rewards wait on


def hangs_on_odd(sample: Sample) -> float:
    """A sync reward that never returns for odd sample indices (waits on an event nobody sets)."""
    if sample.index % 2:
        HANG.wait()
    return 1.0


async def async_hangs_on_odd(sample: Sample) -> float:
    import asyncio

    if sample.index % 2:
        await asyncio.Event().wait()
    return 1.0


def group_hangs_on_first(samples: list[Sample]) -> list[float]:
    """`--group-rm` form: the group holding sample 0 never returns."""
    if any(s.index == 0 for s in samples):
        HANG.wait()
    return [1.0] * len(samples)
