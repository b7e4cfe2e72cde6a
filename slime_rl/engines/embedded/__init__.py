"""The built-in rollout engine: SGLang's native HTTP API served by plain torch + transformers.

Modules: `sampling` (SamplingParams, the sampler and the log-prob convention), `batch` (the running
batch and its KV cache), `slots` and `graphs` (the static per-slot KV cache and the decode step
replayed from CUDA graphs, the default on CUDA), `engine` (the scheduler thread: continuous
batching, abort, pause, weight locks), `protocol` (the /generate wire format), `weights`
(weight-sync endpoints), `server` (HTTP), `cli` (`main(argv)`, the command line, with flags named
as SGLang's ServerArgs).
"""

from slime_rl.engines.embedded.cli import main

__all__ = ["main"]
