"""The text `--dry-run` prints about a run: where every trainer rank and engine goes (node and GPU
ids), the parallel layout, optimizer steps per rollout, and the memory and weight-sync estimates of
`estimate.py`. Pure: it reads the config and config.json, nothing else."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from slime_rl.config import Config
from slime_rl.orchestration.estimate import (
    GiB,
    ModelShape,
    TrainerLayout,
    estimate_memory,
    estimate_sync,
    lora_params,
    model_shape,
)
from slime_rl.orchestration.fit import (
    NON_TORCH_GIB,
    TRAINER_RESERVE,
    GpuMemory,
    engine_verdict,
    trainer_verdict,
)
from slime_rl.orchestration.placement import Device, PlacementPlan, engine_devices, rank_coords


def _count(n: int) -> str:
    """A parameter count: 7.616 B, 135.5 M, or as it is below a million."""
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def _layout_text(cfg: Config) -> str:
    p = cfg.parallel
    text = (f"TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} x "
            f"CP {p.context_parallel_size} x DP {p.data_parallel_size}")
    ep = getattr(p, "expert_model_parallel_size", 1)
    return text + (f" (EP {ep})" if ep > 1 else "")


def tokens_per_micro_batch(cfg: Config) -> tuple[int, str]:
    """Tokens of the largest micro-batch (before the CP split) and how that number was reached."""
    response = cfg.rollout.max_response_len
    prompt = cfg.data.rollout_max_prompt_len
    sample = response + (prompt or 0)
    unbounded = "" if prompt else " (prompt length unbounded: --rollout-max-prompt-len unset, counted as 0)"
    if cfg.trainer.use_dynamic_batch_size:
        budget = cfg.trainer.max_tokens_per_gpu or sample
        if sample > budget:
            return sample, f"one sample of {sample} tokens, over --max-tokens-per-gpu {budget}{unbounded}"
        return budget, f"--max-tokens-per-gpu {budget}"
    mbs = cfg.batch.micro_batch_size
    return mbs * sample, f"--micro-batch-size {mbs} x {sample} tokens per sample{unbounded}"


def trainer_layout(cfg: Config, gqa_expanded: bool = False) -> tuple[TrainerLayout, str]:
    """The memory estimate's view of the flags, and the micro-batch note."""
    p, t = cfg.parallel, cfg.trainer
    tokens, why = tokens_per_micro_batch(cfg)
    in_flight = None
    if not t.use_dynamic_batch_size:  # a fixed number of micro-batches per step and DP rank
        in_flight = max(1, cfg.batch.global_batch_size // (p.data_parallel_size * cfg.batch.micro_batch_size))
    lay = TrainerLayout(
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size,
        dp=p.data_parallel_size, ep=getattr(p, "expert_model_parallel_size", 1),
        etp=getattr(p, "expert_tensor_parallel_size", None), bf16=cfg.model.bf16,
        optimizer=cfg.optimizer.optimizer, sequence_parallel=t.sequence_parallel, tokens_per_micro_batch=tokens,
        micro_batches_in_flight=in_flight, recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method, recompute_num_layers=t.recompute_num_layers, gqa_expanded=gqa_expanded,
        optimizer_offload=cfg.optimizer.offload_fraction if cfg.optimizer.cpu_offload else 0.0,
        pipeline_layers=pipeline_split(cfg), mtp_layers=t.mtp_num_layers or 0, **_lora_layout(cfg))
    return lay, why


def _lora_layout(cfg: Config) -> dict:
    """TrainerLayout's lora_rank and lora_targets (lora_targets.run_rank_and_targets)."""
    from slime_rl.trainer.convert.lora_targets import run_rank_and_targets

    m = cfg.model
    rank, targets = run_rank_and_targets(m.lora_rank, m.lora_target_modules, m.lora_load)
    return {"lora_rank": rank, "lora_targets": targets}


def pipeline_split(cfg: Config) -> tuple[int, ...]:
    """Each stage's layers under --decoder-first/last-pipeline-num-layers (config.json's num_hidden_layers);
    () for the even split or when config.json cannot say."""
    p = cfg.parallel
    if p.decoder_first_pipeline_num_layers is None and p.decoder_last_pipeline_num_layers is None:
        return ()
    from slime_rl.trainer.convert import read_hf_config

    try:
        return p.stage_layers(int(read_hf_config(cfg.model.hf_checkpoint)["num_hidden_layers"]))
    except (FileNotFoundError, KeyError, ValueError):
        return ()


def _layers_text(layers: int, lay: TrainerLayout) -> str:
    if lay.pipeline_layers:
        return f"layers per stage {'/'.join(map(str, lay.pipeline_layers))}"
    return f"{layers // lay.pp} layers per stage"


def _recompute_text(cfg: Config) -> str:
    t = cfg.trainer
    if t.recompute_granularity is None:
        return "no recompute"
    if t.recompute_granularity == "selective":
        return "selective recompute (core attention)"
    return f"full recompute, {t.recompute_method or 'uniform'} {t.recompute_num_layers or 1}"


def sync_link(cfg: Config, plan: PlacementPlan, devices: tuple[Device, ...] | None) -> str:
    """"colocated", "intra-node" (every engine on a node of the trainer's source ranks) or "inter-node"."""
    if plan.colocated:
        return "colocated"
    if devices is None:
        return "intra-node"
    # the source of each pipeline stage: its rank with tp = cp = dp = 0 (TrainerWorker.is_weight_source)
    sources = {devices[b].node for r, b in enumerate(plan.trainer_bundles)
               if all(v == 0 for axis, v in rank_coords(r, cfg.parallel).items() if axis != "pp")}
    engines = {devices[b].node for e in plan.engines for b in e.bundles}
    return "intra-node" if len(sources | engines) == 1 else "inter-node"


def placement_lines(cfg: Config, plan: PlacementPlan, devices: tuple[Device, ...] | None) -> list[str]:
    """Node and GPU ids per trainer rank, critic rank and engine, with each rank's coordinates."""
    lines = [f"trainer: {len(plan.trainer_bundles)} ranks, {_layout_text(cfg)}"]
    for r, b in enumerate(plan.trainer_bundles):
        c = rank_coords(r, cfg.parallel)
        where = str(devices[b]) if devices else f"bundle {b}"
        lines.append(f"  rank {r}: {where} | tp {c['tp']} pp {c['pp']} cp {c['cp']} dp {c['dp']}")
    for r, b in enumerate(plan.critic_bundles):
        lines.append(f"  critic rank {r}: {devices[b] if devices else f'bundle {b}'}")
    kind = f"{cfg.engine.backend}, TP {cfg.engine.num_gpus_per_engine}"
    if cfg.debug.train_only:
        lines.append(f"engines: none (train-only: each rollout is read from --load-debug-rollout-data "
                     f"{cfg.debug.load_rollout_data})")
    else:
        lines.append(f"engines: {len(plan.engines)} ({kind}{', colocated' if plan.colocated else ''})")
    for e in plan.engines:
        where = " + ".join(map(str, engine_devices(plan, devices, e))) if devices else \
            f"bundle{'s' if len(e.bundles) > 1 else ''} {', '.join(map(str, e.bundles))}"
        if e.nodes > 1:
            where += f" (over {e.nodes} nodes: SGLang --nnodes {e.nodes}, node rank 0 serves HTTP)"
        beside = ""
        if plan.colocated:
            first, last = plan.trainer_bundles.index(e.bundles[0]), plan.trainer_bundles.index(e.bundles[-1])
            beside = f" | beside trainer rank{f's {first}..{last}' if last > first else f' {first}'}"
        lines.append(f"  engine {e.engine_id}: {where}{beside}")
    if devices:
        tp = cfg.parallel.tensor_model_parallel_size
        split = [r for r in range(0, len(plan.trainer_bundles), tp)
                 if len({devices[plan.trainer_bundles[r + i]].node for i in range(tp)}) > 1]
        if split:
            lines.append(f"  note: the TP group of rank {split[0]} spans nodes (--tensor-model-parallel-size {tp} "
                         "over the node boundary): its all-reduces cross the inter-node link")
        used = len({devices[b].node for b in plan.trainer_bundles})
        if used != cfg.parallel.actor_num_nodes:
            lines.append(f"  note: the trainer's {len(plan.trainer_bundles)} ranks fill {used} node(s); "
                         f"--actor-num-nodes {cfg.parallel.actor_num_nodes} only counts ranks (nodes x GPUs per node)")
    return lines


def steps_lines(cfg: Config) -> list[str]:
    r, gbs, dp = cfg.rollout, cfg.batch.global_batch_size, cfg.parallel.data_parallel_size
    lines = [f"batches: {r.rollout_batch_size} prompts x {r.n_samples_per_prompt} samples = {r.samples_per_rollout} "
             f"samples per rollout / --global-batch-size {gbs} = {cfg.optimizer_steps_per_rollout} optimizer "
             f"step(s) per rollout; each of the {dp} DP ranks trains {gbs // dp} samples per step"]
    if cfg.trainer.use_dynamic_batch_size:
        lines[-1] += f" in micro-batches of <= {cfg.trainer.max_tokens_per_gpu} tokens (--max-tokens-per-gpu)"
    else:
        mbs = cfg.batch.micro_batch_size
        lines[-1] += f" in {gbs // (dp * mbs)} micro-batches of {mbs} (--micro-batch-size)"
    return lines


def estimate_lines(cfg: Config, plan: PlacementPlan, devices: tuple[Device, ...] | None,
                   shape: ModelShape) -> list[str]:
    """Parameters, trainer memory per GPU and weight-sync time (estimate.py's method)."""
    lay, why = trainer_layout(cfg)
    mem = estimate_memory(shape, lay)
    dtype = "bf16" if lay.bf16 else "fp32"
    parts = [f"{_count(shape.embedding_params)} embedding", "tied LM head" if shape.tied else "untied LM head"]
    if shape.vision:
        parts.append(f"{_count(shape.vision.params)} vision tower")
    if shape.experts:
        parts.append(f"{shape.experts} experts, top-{shape.top_k}, in {len(shape.moe_layers)} layers")
    opt = "Adam m, v" if lay.optimizer == "adam" else "SGD momentum"
    sp = " with sequence parallel" if lay.sequence_parallel else ""
    lines = [
        f"model ({cfg.model.hf_checkpoint}/config.json): {shape.model_type}, {_count(shape.params)} parameters "
        f"({', '.join(parts)})",
        f"trainer memory per GPU, estimated (pipeline stage {mem.stage} of {lay.pp}: "
        f"{_count(mem.params)} parameters on each of its GPUs):",
        f"  weights      {mem.weights / GiB:7.2f} GiB  ({dtype})",
        f"  grads        {mem.grads / GiB:7.2f} GiB  (fp32 gradient buffer"
        + (f" of the LoRA adapters only: rank {lay.lora_rank}, the base frozen)" if lay.lora_rank else ")"),
        f"  optimizer    {mem.optimizer / GiB:7.2f} GiB  ({'fp32 master + ' if lay.bf16 else ''}{opt}, distributed "
        f"over DP x CP = {lay.dp * lay.cp}" + (f"; --optimizer-cpu-offload: {lay.optimizer_offload:g} of it in host "
                                               f"memory, {mem.host_optimizer / GiB:.2f} GiB per rank: fp32 params, "
                                               f"grads and {opt})" if lay.optimizer_offload else ")"),
        f"  activations  {mem.activations / GiB:7.2f} GiB  (micro-batch of {lay.tokens_per_micro_batch} tokens: "
        f"{why}; CP {lay.cp}, TP {lay.tp}{sp}; {_recompute_text(cfg)}; {_layers_text(shape.layers, lay)})",
        f"  logits       {mem.logits / GiB:7.2f} GiB  (last stage: fp32 logits, response slice and softmax)",
        f"  total        {mem.total / GiB:7.2f} GiB",
    ]
    if cfg.debug.train_only:  # no engine to send weights to
        return lines
    link = sync_link(cfg, plan, devices)
    gbps = cfg.plan.inter_node_gbps if link == "inter-node" else cfg.plan.intra_node_gbps
    sync = estimate_sync(shape, lay.bf16, link, gbps, tp=lay.tp, ep=lay.ep, etp=lay.etp,
                         gather_gbps=cfg.plan.intra_node_gbps)
    gbps = sync.gbps
    source = {"colocated": f"CUDA IPC hand-over, {gbps:g} GB/s as a whole sync measured on one H200",
              "intra-node": f"{gbps:g} GB/s (--plan-intra-node-gbps)",
              "inter-node": f"{gbps:g} GB/s (--plan-inter-node-gbps; engines on other nodes than the sources)"}[link]
    gather = (f"; first {sync.gathered_bytes / 1e9:.2f} GB gathered from the other TP/EP ranks at "
              f"{sync.gather_gbps:g} GB/s (--plan-intra-node-gbps): {sync.gather_seconds:.3f} s"
              if sync.gathered_bytes else "")
    lines.append(f"weight sync: {sync.bytes / 1e9:.2f} GB of {dtype} HF weights per sync, {link}: {source}{gather} "
                 f"-> {sync.seconds:.3f} s per sync (every --update-weights-interval "
                 f"{cfg.weight_sync.update_weights_interval} step(s))")
    per_engine = cfg.engine.num_gpus_per_engine
    if cfg.model.adapter_sync and lay.lora_rank:
        adapters = lora_params(shape, lay)
        nbytes = adapters * (2 if lay.bf16 else 4)
        lines.append(f"--lora-sync adapter: that sync once (the base), then {nbytes / 1e6:.1f} MB of adapters per "
                     f"sync ({_count(adapters)} {dtype} parameters), in each engine's request once per TP rank as "
                     f"base64: {nbytes * 4 / 3 * per_engine / 1e6:.1f} MB per engine")
    lines.append(f"weights per engine GPU: {sync.bytes / per_engine / GiB:.2f} GiB (TP {per_engine}); the KV cache "
                 "gets the rest of --sglang-mem-fraction-static")
    return lines


def gpu_memory(cfg: Config, plan: PlacementPlan) -> GpuMemory | None:
    """The GPU the plan is judged against: --cluster's `:GPU`, else this machine's first GPU, else None."""
    if cfg.plan.cluster is not None:
        return cfg.plan.cluster.gpu
    if plan.use_gpu:
        import torch

        return GpuMemory(torch.cuda.mem_get_info(0)[1] / GiB, torch.cuda.get_device_name(0))
    return None


def fit_lines(cfg: Config, plan: PlacementPlan, shape: ModelShape, gpu: GpuMemory | None) -> tuple[list[str], bool]:
    """The verdicts of fit.py for a trainer GPU and an engine GPU (a colocated one: both on the same
    GPU), and whether every one fits (True when there is no GPU to judge against)."""
    if gpu is None:
        return ["fit: not judged (no GPU named): --cluster NODESxGPUS:GPU, e.g. 1x8:H100 or 1x8:80 (GiB)"], True
    lay, _ = trainer_layout(cfg)
    colocated = plan.colocated and not cfg.debug.train_only
    prompt = cfg.data.rollout_max_prompt_len or 0
    sample = prompt + cfg.rollout.max_response_len
    verdicts = [trainer_verdict(shape, lay, gpu, colocated_context_gib=NON_TORCH_GIB if colocated else 0.0,
                                sample_tokens=sample)]
    lines: list[str] = []
    if not cfg.debug.train_only:
        if cfg.engine.backend == "sglang":
            mem = estimate_memory(shape, lay)
            resident = (mem.weights + mem.grads + mem.optimizer) / GiB * TRAINER_RESERVE + NON_TORCH_GIB
            verdicts.append(engine_verdict(
                shape, shape.params * (2 if cfg.model.bf16 else 4), cfg.engine.num_gpus_per_engine, gpu,
                cfg.engine.sglang_args, sample, cfg.rollout.n_samples_per_prompt,
                cfg.model.bf16, colocated_resident_gib=resident if colocated else None))
            if not cfg.data.rollout_max_prompt_len:
                lines.append("  note: a sample counts --rollout-max-response-len tokens only (--rollout-max-prompt-len "
                             "unset)")
        else:
            lines.append("engine GPU: not judged (the built-in engine sizes its KV slots when it starts; the "
                         "verdict follows SGLang's sizing: --rollout-backend sglang)")
    if plan.critic_bundles:
        lines.append("critic GPUs: not judged (their model is the policy's with a value head: about the trainer "
                     "GPU's figure)")
    fits = all(v.fits for v in verdicts)
    return [line for v in verdicts for line in v.lines] + lines, fits


def plan_report(cfg: Config, plan: PlacementPlan, devices: tuple[Device, ...] | None,
                config_json: dict) -> tuple[str, bool]:
    """Everything `--dry-run` prints before the engine commands (the placement plan's own lines first),
    and whether the plan fits its GPUs (True when no GPU is named)."""
    lines = []
    if cfg.plan.cluster is not None:
        nodes, gpus = cfg.plan.cluster.nodes, cfg.plan.cluster.gpus
        gpu = cfg.plan.cluster.gpu
        named = f" of {gpu.gib:.2f} GiB" if gpu else ""
        flag = f"--cluster {nodes}x{gpus}" + (f":{gpu.name.removesuffix(' GiB')}" if gpu else "")
        lines.append(f"cluster: {nodes} node(s) x {gpus} GPUs{named} ({flag}), not this machine")
    lines.append(plan.describe())
    lines += placement_lines(cfg, plan, devices)
    lines += steps_lines(cfg)
    shape = model_shape(config_json, where=f"{cfg.model.hf_checkpoint}/config.json")
    lines += estimate_lines(cfg, plan, devices, shape)
    verdicts, fits = fit_lines(cfg, plan, shape, gpu_memory(cfg, plan))
    return "\n".join(lines + verdicts), fits


# what a person sets before pasting the printed commands (one secret for the run; each node's address)
KEY_VAR = "SLIME_RL_API_KEY"
_MARK = "@@{}@@"  # a stand-in for "${VAR}" in a word (JSON keeps it as it is)


def _shell(cmd: list[str], env: dict[str, str], variables: dict[str, str]) -> str:
    """One pasteable command line: env, then argv; a word holding a `variables` stand-in is double-quoted
    with "${VAR}" in its place (so the shell expands it), every other word shell-quoted."""
    def word(text: str) -> str:
        if not any(mark in text for mark in variables):
            return shlex.quote(text)
        text = "".join("\\" + c if c in '"\\$`' else c for c in text)  # literal inside double quotes
        for mark, var in variables.items():
            text = text.replace(mark, f"${{{var}}}")
        return f'"{text}"'

    return "".join(f"{k}={word(v)} " for k, v in env.items()) + " ".join(word(w) for w in cmd)


def engine_lines(cfg: Config, plan: PlacementPlan, devices: tuple[Device, ...] | None) -> list[str]:
    """Each engine's command as a person would run it on its node: the GPUs it gets in
    CUDA_VISIBLE_DEVICES (SGLang then counts from --base-gpu-id 0), `python` of that node for a
    --cluster plan, the node's address and the run's secret as shell variables; then the router's."""
    from slime_rl.orchestration.engines import engine_command, engine_env

    key = _MARK.format(KEY_VAR)
    variables = {key: KEY_VAR}
    lines = []
    if plan.engines:
        nodes = sorted({d.node for e in plan.engines for d in engine_devices(plan, devices, e)}) if devices else []
        hosts = ", ".join([f"NODE{n}_IP" for n in nodes] or ["ENGINE_HOST"]
                          + (["HEAD_IP"] if cfg.engine.use_router else []))
        lines.append(f"engines by hand (set {KEY_VAR} to one secret and {hosts} to the nodes' addresses; the "
                     "job starts them itself):")
    urls, bootstrap_ports = [], {}
    for slot in plan.engines:
        parts = engine_devices(plan, devices, slot) if devices else [None] * slot.nodes
        port = 30000 + 10 * slot.engine_id
        dist_init = None
        role = cfg.engine.role(slot.engine_id)[0]
        if role == "prefill":  # its KV cache's bootstrap server, on its first node
            bootstrap_ports[slot.engine_id] = port + 8
        for k, where in enumerate(parts):
            host_var = f"NODE{where.node}_IP" if where else "ENGINE_HOST"  # no devices: a CPU plan, one node
            host = _MARK.format(host_var)
            variables[host] = host_var
            if k == 0:
                urls.append(f"http://{host}:{port}")
                dist_init = f"{host}:{port + 5}" if slot.nodes > 1 else None
            cmd = engine_command(cfg, slot, host=host, port=port, api_key=key, use_gpu=plan.use_gpu, node_rank=k,
                                 dist_init_addr=dist_init, bootstrap_port=bootstrap_ports.get(slot.engine_id))
            if cfg.plan.cluster is not None:
                cmd[0] = "python"  # the interpreter of the cluster's nodes, not this machine's path
            env = engine_env(cfg, key)
            if plan.use_gpu and where is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, where.gpus))
            name = (f"engine {slot.engine_id}" + (f" ({role})" if role != "regular" else "")
                    + (f" node rank {k}" if slot.nodes > 1 else ""))
            lines.append(f"{name}: {_shell(cmd, env, variables)}")
    if cfg.engine.use_router and plan.engines:
        from slime_rl.orchestration.router import router_launch_command

        head = _MARK.format("HEAD_IP")
        variables[head] = "HEAD_IP"
        cmd = router_launch_command(cfg, head, cfg.engine.router_port or 30999, urls, key,
                                    bootstrap_ports=bootstrap_ports)
        if cfg.plan.cluster is not None:
            cmd[0] = "python"
        lines.append(f"router: {_shell(cmd, {}, variables)}")
    return lines


def launch_line(cfg: Config, argv: Sequence[str]) -> str:
    """The command that starts this job on its cluster: the same flags without --dry-run and --cluster,
    through launch/ray_multi_node.sh (the head with the flags, first; then the other nodes) or
    launch/ray_single_node.sh (one node)."""
    flags, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--dry-run" or arg.startswith("--cluster="):
            continue
        elif arg == "--cluster":
            skip = True
        else:
            flags.append(arg)
    nodes, gpus = (cfg.plan.cluster.nodes, cfg.plan.cluster.gpus) if cfg.plan.cluster is not None else (1, None)
    if nodes > 1:
        return (f"launch: on the head first: MASTER_ADDR=<head ip> NODE_RANK=0 NNODES={nodes} NUM_GPUS={gpus} bash "
                f"launch/ray_multi_node.sh {shlex.join(flags)}; then on node i = 1..{nodes - 1}: "
                f"MASTER_ADDR=<head ip> NODE_RANK=i NUM_GPUS={gpus} bash launch/ray_multi_node.sh (or, under Slurm: "
                f"sbatch --nodes={nodes} launch/slurm_example.sbatch {shlex.join(flags)})")
    prefix = f"NUM_GPUS={gpus} " if gpus else ""
    return f"launch: {prefix}bash launch/ray_single_node.sh {shlex.join(flags)}"
