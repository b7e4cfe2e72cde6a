"""Command line of the embedded engine: `main(argv)`, also `python -m slime_rl.engines.embedded`.

Flag names are SGLang's ServerArgs names where SGLang has the option (sglang/srt/arg_groups/fields/*.py,
SGLang 0.5.23: --model-path, --host, --port, --api-key, --random-seed, --dtype, --device,
--max-running-requests, --weight-version, --tp-size, --log-level, --disable-cuda-graph,
--cuda-graph-max-bs-decode, --enable-deterministic-inference, --enable-weights-cpu-backup, --enable-fp32-lm-head,
--disable-overlap-schedule, --enable-torch-compile, --torch-compile-max-bs;
--cuda-graph-max-bs is its older name), so a launcher builds the same argv for either engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from slime_rl.engines.embedded.server import EmbeddedServer, ServerConfig
from slime_rl.engines.launch import API_KEY_ENV, ROUTING_SELECT_ROUND_ENV


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slime_rl.engines.embedded",
                                description="Serve an HF causal LM with SGLang's native HTTP API.")
    p.add_argument("--model-path", "--model", dest="model_path", required=True, help="HF checkpoint folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` (not on /health*); default: ${API_KEY_ENV}")
    p.add_argument("--random-seed", type=int, default=0, help="seed of requests without sampling_seed")
    p.add_argument("--dtype", default="float32", choices=["float32", "float", "bfloat16", "float16", "half"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--max-running-requests", type=int, default=64, help="rows in the running batch")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                   help="only 1 (the embedded engine is one process)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="on CUDA, decode eagerly with the dynamic KV cache instead of replaying CUDA graphs of "
                        "the decode step on a static KV cache")
    p.add_argument("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs", dest="cuda_graph_max_bs", type=int,
                   default=None, help="largest padded batch with a CUDA graph; larger ones run the static "
                                      "step eagerly (default: --max-running-requests)")
    p.add_argument("--static-kv-cache", action="store_true",
                   help="use the static KV cache even without CUDA graphs (CPU, or with --disable-cuda-graph)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens before launching the next (SGLang's flag); by default "
                        "step n+1 is launched first and the host's work for step n overlaps it")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="run the static decode step with its RMSNorms, MLPs and RoPE compiled by torch.compile "
                        "(SGLang's flag): inductor fuses their small elementwise kernels; compiles on the first step")
    p.add_argument("--torch-compile-max-bs", type=int, default=32,
                   help="largest padded batch whose decode step is compiled (SGLang's flag and default)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="honour each request's sampling_seed (SGLang 0.5.23 ignores it without this switch); "
                        "on CUDA also batch-invariant decode attention, as SGLang's switch: the static path's "
                        "decode steps run the trainer's flash kernel over the slot cache")
    p.add_argument("--max-request-bytes", type=int, default=256 << 20,
                   help="a request body larger than this is refused with 413 before it is read")
    p.add_argument("--http-read-timeout", type=float, default=30.0,
                   help="seconds a request's head and body may take to arrive (else 408, connection closed)")
    p.add_argument("--http-idle-timeout", type=float, default=300.0,
                   help="seconds a kept-alive connection may wait for its next request before it is closed")
    p.add_argument("--http-max-connections", type=int, default=4096,
                   help="open connections served at once; one more is answered 503 and closed")
    p.add_argument("--enable-fp32-lm-head", action="store_true",
                   help="logits in fp32 from the bf16 hidden state and weight (SGLang's flag); the trainer "
                        "computes them so too when the run passes --sglang-enable-fp32-lm-head")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="keep a host copy of released weights and restore it on resume (SGLang's flag); "
                        "without it a release drops the weights and they must all be sent again")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="answer a request's return_routed_experts with each MoE layer's top-k expert ids "
                        "(SGLang's flag; meta_info['routed_experts'], base64 int32 [tokens, layers, top_k])")
    p.add_argument("--debug-routing-select-round", default=os.environ.get(ROUTING_SELECT_ROUND_ENV) or None,
                   choices=["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"],
                   help="test/measurement only: choose experts from router logits rounded to this dtype "
                        "(a bf16 engine's routing flips), the weights from the fp32 probabilities")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse flags, load the model and serve until SIGTERM/SIGINT."""
    args = build_parser().parse_args(argv)
    if args.tp_size != 1:
        raise SystemExit(f"--tp-size {args.tp_size}: the embedded engine supports only 1")
    if args.max_running_requests < 1:
        raise SystemExit("--max-running-requests: must be >= 1")
    if args.cuda_graph_max_bs is not None and args.cuda_graph_max_bs < 1:
        raise SystemExit("--cuda-graph-max-bs-decode: must be >= 1")
    if args.torch_compile_max_bs < 1:
        raise SystemExit("--torch-compile-max-bs: must be >= 1")
    for flag, value in (("--http-read-timeout", args.http_read_timeout), ("--http-idle-timeout",
                        args.http_idle_timeout), ("--http-max-connections", args.http_max_connections),
                        ("--max-request-bytes", args.max_request_bytes)):
        if not value > 0:  # also NaN
            raise SystemExit(f"{flag} {value}: must be > 0")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = EmbeddedServer(ServerConfig(
        model_path=args.model_path, host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        random_seed=args.random_seed, dtype=args.dtype, device=args.device,
        max_running_requests=args.max_running_requests, weight_version=args.weight_version,
        num_threads=args.num_threads, disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs, static_kv_cache=args.static_kv_cache,
        disable_overlap_schedule=args.disable_overlap_schedule,
        enable_torch_compile=args.enable_torch_compile, torch_compile_max_bs=args.torch_compile_max_bs,
        enable_deterministic_inference=args.enable_deterministic_inference,
        enable_weights_cpu_backup=args.enable_weights_cpu_backup, enable_fp32_lm_head=args.enable_fp32_lm_head,
        enable_return_routed_experts=args.enable_return_routed_experts,
        routing_select_round=args.debug_routing_select_round,
        max_request_bytes=args.max_request_bytes, read_timeout_s=args.http_read_timeout,
        idle_timeout_s=args.http_idle_timeout, max_connections=args.http_max_connections))

    def stop(signum: int, _frame) -> None:
        # serve_forever runs in this thread; shutdown() must be called from another one.
        threading.Thread(target=server.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
        signal.signal(signal.SIGTERM, stop)
    print(f"embedded engine serving {args.model_path} at {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()
