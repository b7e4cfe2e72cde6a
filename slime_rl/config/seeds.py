"""How `--seed` and `--rollout-seed` reach every random choice of a run.

slime's meaning of the two flags: `--seed` (Megatron's, default 1234) seeds the trainer's RNGs (the
init of what is random: a critic's value head; dropout inside TP regions) and SGLang's
`random_seed`; `--rollout-seed` (default 42) seeds the prompt shuffle and the requests'
`sampling_seed`. Here both enter every rollout-side choice through one number, the run seed, so
that changing either changes the run and repeating both repeats it:

    run_seed      = (seed * 1_000_033 + rollout_seed)                 mod (2^31 - 1)
    data order    = random.Random(run_seed * 1_000_003 + epoch).shuffle(range(n_prompts))
    sampling_seed = (run_seed * 1_000_003 + index * 7919 + length)    mod (2^31 - 1)
    engine seed   = (run_seed + engine index)                         mod (2^31 - 1)

`index` is the sample's run-wide number (eval samples count from `EVAL_INDEX_BASE` in
`rollout.eval`), `length` the tokens of prompt + response so far (a multi-turn sample's later turns
and a continued partial sample draw fresh seeds). `sampling_seed` goes with every request under
`--deterministic-rollout`; without it the engines sample from their own generator, seeded with the
engine seed. 2^31 - 1 keeps every seed an int32, what SGLang, torch and numpy all take.
"""

from __future__ import annotations

SEED_MODULUS = 2**31 - 1


def run_seed(seed: int, rollout_seed: int) -> int:
    """The one number `--seed` and `--rollout-seed` make together (see the module docstring)."""
    return (seed * 1_000_033 + rollout_seed) % SEED_MODULUS


def data_order_seed(run: int, epoch: int) -> int:
    """The seed of epoch `epoch`'s prompt permutation (`random.Random(...).shuffle`)."""
    return run * 1_000_003 + epoch


def sampling_seed(run: int, index: int, length: int) -> int:
    """SGLang's `sampling_seed` of one request: the sample's index and its prompt + response length
    so far, under the run seed."""
    return (run * 1_000_003 + index * 7919 + length) % SEED_MODULUS


def engine_seed(run: int, engine_id: int) -> int:
    """The engine's own `--random-seed` (requests without a sampling_seed draw from it)."""
    return (run + engine_id) % SEED_MODULUS
