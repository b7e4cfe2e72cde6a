"""Engine actors: each holds its placement bundle(s) and runs one engine server process
(the built-in engine or SGLang), prefixing the server's log lines with the engine id.

Fault tolerance: the actor outlives its process. `restart` kills what is left of the old process
(a hung one included) and starts a new one in the same actor, hence the same placement bundle and
device, on a fresh port; the cluster then re-creates the weight-update group and sends the weights."""

from __future__ import annotations

import collections
import os
import random
import socket
import subprocess
import sys
import threading
from typing import Any

import ray

from slime_rl.config import Config
from slime_rl.config.builtin_engine import (
    API_KEY_ENV,
    LISTEN_FD_ENV,
    ROUTING_SELECT_ROUND_ENV,
    ServerConfig,
    from_sglang_args,
)
from slime_rl.config.seeds import engine_seed, run_seed
from slime_rl.engines.launch import EngineLaunchError, embedded_command, sglang_command, wait_healthy
from slime_rl.orchestration.placement import EngineSlot


def terminate(process: subprocess.Popen, timeout_s: float = 20.0) -> int:
    """SIGTERM (servers shut down gracefully on it), SIGKILL after `timeout_s`; the exit code.
    Only this process: never anything found by name."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


# where free_port looks: above the well-known and registered services most hosts run, below the kernel's
# ephemeral range (ip_local_port_range), from which the OS takes the local port of every outgoing
# connection: a port picked there (bind to port 0) can be taken by one of those (Ray's, an HTTP client's)
# between the pick and the server's bind, "Address already in use" (seen in CI)
PORT_FLOOR = 20000
# how many of an engine's last log lines a launch error carries
LOG_TAIL_LINES = 50


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound (not listening: a connection to it is refused) to a port that was free on `host`,
    below the kernel's ephemeral range when there is room (random in [PORT_FLOOR, its start), so that
    two pickers rarely meet); else one the OS hands out. While it is open no other socket can bind
    that port, SO_REUSEADDR or not (Linux lets two sockets share a port only when both set it)."""
    low = _ephemeral_low()
    rng = random.Random()  # the OS's entropy: not the run's seeded streams
    for port in [rng.randrange(PORT_FLOOR, low) for _ in range(64 if low - PORT_FLOOR >= 1000 else 0)] + [0]:
        s = socket.socket()
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            if port == 0:
                raise
            continue
        return s
    raise AssertionError("unreachable: the last try binds port 0")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now (`reserve_port`'s, released): for a server that binds it itself."""
    with reserve_port(host) as s:
        return s.getsockname()[1]


def sglang_lora_args(cfg: Config) -> dict[str, Any]:
    """--lora-sync adapter: SGLang serves adapters only with --enable-lora, and one loaded after the start
    (/load_lora_adapter_from_tensors) only within --max-lora-rank and --lora-target-modules (its "all" for
    all-linear). The adapter's rank and targets: --lora-load's, else the flags' (preflight checked the folder)."""
    m = cfg.model
    if not m.adapter_sync:
        return {}
    from slime_rl.trainer.convert.lora_targets import run_rank_and_targets

    rank, targets = run_rank_and_targets(m.lora_rank, m.lora_target_modules, m.lora_load)
    return {"enable_lora": True, "max_lora_rank": int(rank),
            "lora_target_modules": ["all"] if "all-linear" in targets else sorted(targets)}


def engines_back_up_weights(cfg: Config) -> bool:
    """Whether a colocated release keeps the engines' weights on the host (SGLang's and the built-in engine's
    --enable-weights-cpu-backup): given by the user, or chosen for --lora-sync adapter, whose syncs send the
    adapters alone and so need the base to come back by itself after each release."""
    return bool(cfg.engine.sglang_args.get("enable_weights_cpu_backup")) or (cfg.model.adapter_sync
                                                                            and cfg.engine.colocate)


def engine_command(cfg: Config, slot: EngineSlot, host: str, port: int, api_key: str | None, use_gpu: bool,
                   nccl_port: int | None = None, node_rank: int = 0, dist_init_addr: str | None = None,
                   bootstrap_port: int | None = None) -> list[str]:
    """The launch command of one engine: what the actor runs and what --dry-run prints. The built-in
    engine gets its key through `engine_env` instead (argv is world-readable); SGLang only through
    --api-key. `nccl_port` None: SGLang picks its own on its node, checked free and below the
    kernel's ephemeral range (so no outgoing connection takes it before it binds): port + 1 was
    neither checked nor safe from the ephemeral range. An engine over several nodes (`slot.nodes` > 1):
    the command of its node part `node_rank`, all parts meeting at `dist_init_addr` (node rank 0's
    host:port); `host` and `port` are that part's own. A prefill or decode engine (--prefill-num-servers,
    --sglang-config) gets its --disaggregation-mode and its server group's overrides; a prefill engine the
    `bootstrap_port` its decode partners fetch the KV cache through."""
    seed = engine_seed(run_seed(cfg.model.seed, cfg.rollout.seed), slot.engine_id)
    # --deterministic-rollout seeds every request; SGLang honours sampling_seed only with this switch
    deterministic = cfg.rollout.sample_seed is not None
    if cfg.engine.backend == "sglang":
        extra = _colocated_sglang_args(cfg)
        if deterministic:
            extra.setdefault("enable_deterministic_inference", True)
        if cfg.trainer.use_rollout_routing_replay:  # SGLang returns routed_experts only with this switch
            extra["enable_return_routed_experts"] = True
        for name, value in sglang_lora_args(cfg).items():  # a --sglang-max-lora-rank etc. of the user's stays
            extra.setdefault(name, value)
        if engines_back_up_weights(cfg):
            extra["enable_weights_cpu_backup"] = True
        role, overrides = cfg.engine.role(slot.engine_id)
        extra |= overrides  # its server group's settings, on top of the --sglang-* flags (as slime applies them)
        if role == "prefill" and bootstrap_port is None:
            raise ValueError(f"engine {slot.engine_id} prefills: it needs a bootstrap port")
        # base GPU 0: the actor holds exactly the engine's devices (Ray sets CUDA_VISIBLE_DEVICES to them)
        return sglang_command(model_path=cfg.model.hf_checkpoint, host=host, port=port,
                              tp_size=slot.num_gpus, nccl_port=nccl_port,
                              dist_init_addr=dist_init_addr, base_gpu_id=0, random_seed=seed, api_key=api_key,
                              extra=extra, nnodes=slot.nodes, node_rank=node_rank,
                              disaggregation_mode=None if role == "regular" else role,
                              bootstrap_port=bootstrap_port if role == "prefill" else None)
    # the --sglang-* flags the built-in engine shares with SGLang (config/builtin_engine.py SGLANG_ARGS)
    shared = from_sglang_args(cfg.engine.sglang_args)
    # rows decoding together: --sglang-max-running-requests, else as many as the rollout client keeps
    # in flight (--sglang-server-concurrency), so no request waits in the engine while slots are free
    # and none waits in the client while the engine could batch it
    shared.setdefault("max_running_requests", cfg.rollout.concurrency_per_engine)
    # SGLang's own switch passed through (--sglang-enable-deterministic-inference) gives the
    # batch-invariant kernels without per-request seeds, as in SGLang
    shared["enable_deterministic_inference"] = deterministic or shared.get("enable_deterministic_inference", False)
    shared["enable_weights_cpu_backup"] = engines_back_up_weights(cfg)
    return embedded_command(ServerConfig(
        model_path=str(cfg.model.hf_checkpoint), host=host, port=port, random_seed=seed,
        device="cuda" if use_gpu else "cpu", dtype="bfloat16" if cfg.model.bf16 else "float32",
        # on CPU the engine runs while the trainer ranks wait (sync loop), so it may use every core
        num_threads=None if use_gpu else (os.cpu_count() or 1),
        enable_return_routed_experts=cfg.trainer.use_rollout_routing_replay,
        colocated_devices=slot.num_gpus if cfg.engine.colocate else 1,
        **shared | {"enable_fp32_lm_head": cfg.model.fp32_lm_head}))


# --mem-fraction-static for a colocated SGLang engine: the share of the GPU its weights + KV pool take.
# SGLang sizes the pool from the memory free at start-up times this fraction (0.88 or so by default),
# as if alone on the GPU; colocated, the trainer's process already holds its model there, and during
# the sync the trainer's two bucket buffers (--update-weight-buffer-size each) sit next to the
# engine's resumed weights. 0.7 keeps 30% of what was free for the trainer's CUDA context, allocator
# slack and those buffers (the KV pool is released during training anyway).
# --sglang-mem-fraction-static overrides it.
COLOCATED_MEM_FRACTION_STATIC = 0.7


def _colocated_sglang_args(cfg: Config) -> dict:
    """--sglang-* flags; with --colocate SGLang needs its memory saver to honour /release_memory_occupation
    and a static-memory fraction that leaves the trainer room (COLOCATED_MEM_FRACTION_STATIC)."""
    extra = dict(cfg.engine.sglang_args)
    if cfg.engine.colocate:
        extra.setdefault("enable_memory_saver", True)
        extra.setdefault("mem_fraction_static", COLOCATED_MEM_FRACTION_STATIC)
    return extra


def engine_env(cfg: Config, api_key: str | None) -> dict[str, str]:
    """Environment for the engine process: the built-in engine's API key, and the driver's
    ROUTING_SELECT_ROUND_ENV (tests and measurements only: the built-in engine's routing flips)."""
    env = {API_KEY_ENV: api_key} if api_key and cfg.engine.backend == "embedded" else {}
    if cfg.engine.backend == "embedded" and os.environ.get(ROUTING_SELECT_ROUND_ENV):
        env[ROUTING_SELECT_ROUND_ENV] = os.environ[ROUTING_SELECT_ROUND_ENV]
    return env


@ray.remote
class EngineActor:
    """Owns one engine server process for the life of the run."""

    def __init__(self, engine_id: int) -> None:
        self.engine_id = engine_id
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self._held: socket.socket | None = None  # pick_port(hold=True)'s socket, until start hands it over
        self._lines: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._pump_thread: threading.Thread | None = None

    def start(self, cmd: list[str], url: str, timeout: float = 300.0, env: dict[str, str] | None = None) -> str:
        """Run `cmd` and wait until its /health answers. A port held by `pick_port(hold=True)` goes to the
        process as an inherited socket (LISTEN_FD_ENV). An engine that exits first, or is not healthy in
        `timeout` seconds, raises EngineLaunchError with its last log lines."""
        held, self._held = self._held, None
        try:
            self._spawn(cmd, env, held)
        finally:
            if held is not None:
                held.close()  # the engine's copy stays open
        wait_healthy(url, timeout=timeout, process=self.process, recent_logs=self._recent_lines)
        self.url = url
        return url

    def _spawn(self, cmd: list[str], env: dict[str, str] | None, held: socket.socket | None = None) -> None:
        """Start `cmd` (this actor's environment plus `env`; `held`: a socket it inherits, named in LISTEN_FD_ENV)
        with its output pumped to this actor's, the last lines kept for a launch error."""
        self._env = dict(env or {})
        full = dict(os.environ) | self._env | ({LISTEN_FD_ENV: str(held.fileno())} if held is not None else {})
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full, text=True,
                                        pass_fds=() if held is None else (held.fileno(),))
        self._lines.clear()
        self._pump_thread = threading.Thread(target=self._pump, args=(self.process,), daemon=True)
        self._pump_thread.start()

    def start_part(self, cmd: list[str], env: dict[str, str] | None = None, settle_s: float = 2.0) -> int:
        """Run node part 1.. of an engine over several nodes (SGLang --node-rank k): it serves no HTTP, so
        nothing answers /health; its TP ranks join node part 0's at --dist-init-addr, and part 0's /health
        answers once they all have. Returns its pid; EngineLaunchError when it exits within `settle_s`
        seconds (a bad flag, a missing model), with its last log lines."""
        self._spawn(cmd, env)
        try:
            code = self.process.wait(timeout=settle_s)
        except subprocess.TimeoutExpired:
            return self.process.pid
        tail = "\n".join(self._recent_lines())
        raise EngineLaunchError(f"engine {self.engine_id}'s node part on {self.node_ip()} exited with code {code}"
                                + (f"; last log lines:\n{tail}" if tail else ""))

    def _pump(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self._lines.append(line.rstrip("\n"))
            sys.stdout.write(f"[engine {self.engine_id}] {line}")
            sys.stdout.flush()

    def _recent_lines(self) -> list[str]:
        """The engine's last log lines; after its exit, once the pump has read what it wrote last."""
        if self._pump_thread is not None and self.process is not None and self.process.poll() is not None:
            self._pump_thread.join(timeout=5.0)
        return list(self._lines)

    def restart(self, cmd: list[str], url: str, timeout: float = 300.0) -> str:
        """A fresh process in this actor's placement (same bundle/device), after the old one is gone."""
        self.kill()
        self.url = None
        return self.start(cmd, url, timeout, getattr(self, "_env", None))

    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def alive(self, timeout: float = 5.0) -> bool:
        """The process runs and its /health answers 200 within `timeout` seconds."""
        from slime_rl.engines.client import EngineClient

        if self.process is None or self.process.poll() is not None or self.url is None:
            return False
        with EngineClient(self.url, timeout=timeout) as client:
            return client.health()

    def kill(self) -> None:
        """SIGKILL: a hung server may not answer SIGTERM, and the restart must not wait on it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def pull_weights(self, root: str, version: int, local_dir: str | None, hf_checkpoint: str) -> str:
        """--update-weight-transport disk, on this engine's host: bring its checkpoint to `version`
        (weight_sync/disk.pull) and return the folder its engine loads."""
        from slime_rl.weight_sync.disk import pull

        return pull(root, version, local_dir, hf_checkpoint)

    def spare_port(self) -> int:
        """Another free port on this node (an engine's --dist-init-addr, a node part's --port), checked free
        like `pick_port`'s; a port `pick_port(hold=True)` holds stays held."""
        return free_port(self.node_ip())

    def pick_port(self, hold: bool = False) -> int:
        """A free port on the address the engine will bind (not every interface). `hold`: for the built-in
        engine, which listens on a socket handed over: the port stays bound by this actor until `start`
        passes it on, so nothing else on the node can take it while the engine loads its model. SGLang
        binds its port itself: it is only checked free."""
        if self._held is not None:
            self._held.close()
            self._held = None
        if not hold:
            return free_port(self.node_ip())
        self._held = reserve_port(self.node_ip())
        return self._held.getsockname()[1]

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)
