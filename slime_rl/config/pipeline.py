"""How the decoder's layers fall on the pipeline stages: Megatron-LM's split, even unless
--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers give the first / last stage its
own count (slime's large-model scripts do: a stage also holding the embedding or the LM head gets fewer
layers). The stages in between share the rest evenly, as megatron-core's TransformerConfig requires
(num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage)."""

from __future__ import annotations

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> tuple[int, ...]:
    """Layers of each pipeline stage, first to last; ValueError naming the flags when they do not split
    `num_layers` (config.json's num_hidden_layers) over `pp` stages."""
    if pp == 1:
        if first is not None or last is not None:
            given = FIRST_FLAG if first is not None else LAST_FLAG
            raise ValueError(f"{given} needs --pipeline-model-parallel-size > 1")
        return (num_layers,)
    for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: a stage needs at least 1 layer")
    rest = num_layers - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    given = " and ".join(f"{flag} {value}" for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last))
                         if value is not None)
    if middle == 0:
        if rest != 0:
            raise ValueError(f"{given} over --pipeline-model-parallel-size {pp} must add up to num_hidden_layers="
                             f"{num_layers}")
        return (first, last)  # type: ignore[return-value]
    if rest < middle or rest % middle:
        what = f"{given} leave" if given else "are"
        hint = "" if given else (f"; Megatron-LM refuses this split too; {FIRST_FLAG} or {LAST_FLAG} gives the first "
                                 "or last stage its own count")
        raise ValueError(f"num_hidden_layers={num_layers}: {rest} layers {what} for {middle} pipeline stage(s), "
                         f"which must share them evenly (--pipeline-model-parallel-size {pp}){hint}")
    each = rest // middle
    return tuple([first if first is not None else each] + [each] * (pp - 2)
                 + [last if last is not None else each])


def stage_first_layer(counts: tuple[int, ...], stage: int) -> int:
    """The global index of stage `stage`'s first layer."""
    return sum(counts[:stage])
