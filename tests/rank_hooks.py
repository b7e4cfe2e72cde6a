"""Test-only rank actors: subclasses of the production RankActor that misbehave on purpose. A test
puts one in place of `trainer_group.RankActor` (monkeypatch, in the driver process, before the
Cluster is built); the production class carries no test hooks. Module-level so that Ray's workers
import it by name."""

from __future__ import annotations

import ray

from slime_rl.orchestration import trainer_group

FAILING_RANK, FAILING_STEP = 1, 1


@ray.remote
class RankFailingAtStep(trainer_group.RankActor.__ray_actor_class__):
    """Policy rank FAILING_RANK raises in `train(FAILING_STEP)`, as a crashing rank would."""

    def train(self, step: int, buffer, readers: int | None = None) -> dict[str, float]:
        if self.role == trainer_group.POLICY and self.rank == FAILING_RANK and step == FAILING_STEP:
            raise RuntimeError(f"injected failure at step {step} (test hook)")
        return super().train(step, buffer, readers)
