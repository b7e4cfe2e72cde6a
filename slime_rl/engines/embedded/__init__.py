"""The built-in rollout engine: SGLang's native HTTP API served by plain torch + transformers.

Modules: `sampling` (SamplingParams, the sampler and the log-prob convention), `batch` (the running
batch and its KV cache), `slots` and `graphs` (the static per-slot KV cache and the decode step
replayed from CUDA graphs, the default on CUDA), `engine` (the scheduler thread: continuous
batching, abort, pause, weight locks), `steps` (its prefill, decode step, sampling and stop checks),
`request` (GenRequest and its abort finish reason), `protocol` (the /generate wire format), `weights`
(weight-sync endpoints), `server` (HTTP), `cli` (`main(argv)`, the command line, with flags named
as SGLang's ServerArgs; `python -m slime_rl.engines.embedded` runs it).

The package imports nothing itself: the engine actor that only builds the command line
(`orchestration.engines`) must not pay for torch and transformers, which only the server process needs.
"""
