"""train-memory: what one train rank holds and how fast the ranks train, for each way of splitting the model.

For every layout (``ddp``, ``fsdp``, ``fsdp+offload``, ``tp``: tensor parallelism 2 with FSDP over the
rest) and rank count (``--ranks 1 2 4``), that many processes on this machine each run one
``TorchTrainWorker`` rank (the torch strategy a run uses, joined over gloo on the CPU or NCCL on GPUs,
without Ray) and take ``--steps`` timed ``train_step`` calls on a global batch of ``--batch`` rows of
``--seq-len`` tokens (split across the data-parallel ranks) after one untimed step.

Per layout it reports, as the maximum over the ranks:

- ``states_gib``: the bytes of weights, gradients and AdamW states the rank holds, measured on its tensors
  after a step (local shards only), and ``theory_gib``, the same from the arithmetic of
  ``rollart.training.memory`` (16 bytes a parameter, divided as the layout divides them);
- ``peak_rss_gib``: the rank's peak resident memory over its whole life (load included; per rank in
  ``peak_rss_gib_by_rank``), ``load_peak_rss_gib``, while the rank is built and its weights loaded, and
  ``step_peak_rss_gib``, over the timed steps only (the peak is reset after the untimed step);
  on GPUs also ``peak_gpu_gib`` (``torch.cuda.max_memory_allocated``);
- ``tokens_per_s``: the global batch's tokens over the median step time;
- ``publish_extra_rss_gib``: how much the rank's resident memory rises while its weights stream out a
  bucket of ``--bucket-mb`` at a time (gathered from the shards, copied to the CPU, handed on; a tensor
  larger than a bucket in row pieces of at most a bucket), against ``bucket_gib``.

``--job`` runs each layout as a whole job on this machine instead (``rollart run``'s pipeline: a local Ray,
the torch engine on one CPU, the driver, the train ranks; the reverse task for ``--steps`` steps) and reports
its train ranks' states and peak RSS (each rank's ``memory()``) with the rewards the run logged.

A layout that does not fit the machine's memory (checked against the arithmetic before it starts) is
reported as ``skipped`` with the reason, as a run would refuse it. ``--shape qwen2.5-0.5b`` is the real
architecture with random weights; without ``--shape``/``--model``, the built-in tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"sharding": "ddp"},
    "fsdp": {"sharding": "fsdp"},
    "fsdp+offload": {"sharding": "fsdp", "offload": "cpu"},
    "tp": {"sharding": "fsdp", "tensor_parallel": 2},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default=None, help="a model shape with random weights, e.g. qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=None, help="with --shape: fewer layers (a quick smoke run)")
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: the built-in tiny model)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4], help="rank counts to run each layout at")
    p.add_argument("--batch", type=int, default=4, help="rows of the global batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--device", default="auto", help="auto (GPUs when torch sees them), cpu, cuda")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on GPUs, fp32 on the CPU")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--bucket-mb", type=int, default=32, help="the bucket of the weights' publish (weights.bucket_mb)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads a rank (default: 1 on the CPU; on GPUs, the cores)"
    )
    p.add_argument(
        "--job",
        action="store_true",
        help="run each layout as a whole job instead (rollout engine, driver and the train ranks on this machine: "
        "the reverse task for --steps steps) and report its ranks' memory and rewards",
    )
    p.add_argument(
        "--channel",
        choices=["ray", "dist", "mooncake"],
        default="ray",
        help="with --job: the weights' channel (weights.channel); dist and mooncake keep the weights out of "
        "Ray's object store, whose shared memory counts against the machine's",
    )
    p.add_argument("--out", default="runs/bench/train_memory")


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _state_bytes(worker: Any) -> int:
    params = [p for p in worker.module.parameters()]
    total = sum(_local_bytes(p) for p in params)
    total += sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    for state in worker.optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if hasattr(v, "numel") and v.dim() > 0)
    return total


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], out_file: str) -> None:
    """One rank of one layout (a spawned process): build, step, measure, write its JSON."""
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    import torch

    torch.set_num_threads(spec["threads"])
    from rollart.benchmarks.train_step import batch_of
    from rollart.cluster.worker import Worker, WorkerContext
    from rollart.training.torch_strategy import TorchTrainWorker

    device = torch.device(spec["device"], rank) if spec["device"] == "cuda" else torch.device("cpu")
    ctx = WorkerContext(cluster="bench", job_id="bench", rank=rank, world_size=world, pool=None, hardware=device.type)
    worker = TorchTrainWorker.__new__(TorchTrainWorker)
    Worker._rollart_bind(worker, ctx)
    worker.device_ids = (rank,) if device.type == "cuda" else ()
    TorchTrainWorker.__init__(worker, spec["config"])
    worker.setup_distributed("127.0.0.1", port)
    config = worker.module.config if not hasattr(worker.module, "module") else worker.module.module.config
    batch = batch_of(spec["batch"], spec["seq_len"], min(config.vocab_size, 50_000))
    share = batch.split(world)[rank]
    load_peak = _peak_rss()  # building the rank and loading its weights
    _reset_peak_rss()
    worker.train_step(share)  # untimed: allocates the optimiser states and warms the allocator
    life_peak = max(load_peak, _peak_rss())  # the load and a first step
    _reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(spec["steps"]):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _barrier()
        t0 = time.perf_counter()
        worker.train_step(share)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _barrier()
        times.append(time.perf_counter() - t0)
    step_peak = _peak_rss()  # read before the publish's measurement resets the peak
    publish_extra = _publish_extra_rss(worker, spec["bucket_bytes"])
    result = {
        "rank": rank,
        "publish_extra_rss": publish_extra,
        "states_bytes": _state_bytes(worker),
        "load_peak_rss": load_peak,
        "step_peak_rss": step_peak,
        "peak_rss": max(life_peak, step_peak),
        "step_s": statistics.median(times),
        "peak_gpu": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    Path(out_file).write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _publish_extra_rss(worker: Any, bucket_bytes: int) -> int:
    """How much the rank's resident memory rises while its weights stream out (gathered, copied to the CPU a
    bucket at a time, handed to a channel that drops each tensor once it has it), over its RSS before."""
    import gc

    gc.collect()
    _reset_peak_rss()
    before = _rss()
    metas = worker.weight_metas()
    # each item dropped before the next is asked for, as a channel does (a loop variable would keep it alive)
    for item in worker._tensor_stream(bucket_bytes, [m.name for m in metas]) if worker.rank == 0 else ():
        del item
    if worker.rank != 0 and worker.weights_sharded():
        for bucket in worker.weight_stream(bucket_bytes, [m.name for m in metas]):
            del bucket
    return max(_peak_rss() - before, 0)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _run_layout(spec: dict[str, Any], world: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    from rollart.resource_manager.net import free_port

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        files = [str(Path(tmp) / f"rank{r}.json") for r in range(world)]
        port = free_port("127.0.0.1")
        procs = [ctx.Process(target=_rank, args=(r, world, port, spec, files[r])) for r in range(world)]
        for p in procs:
            p.start()
        for r, p in enumerate(procs):
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"rank {r} of {world} exited with {p.exitcode}")
        return [json.loads(Path(f).read_text()) for f in files]


def _job(args: argparse.Namespace, path: str, cfg: dict[str, Any], world: int) -> dict[str, Any]:
    """One whole job of ``--steps`` steps with the train config ``cfg`` on ``world`` CPU ranks."""
    import ray

    from rollart.config import PipelineConfig
    from rollart.pipelines.agentic import AgenticPipeline

    out = Path(args.out) / f"job-{cfg['sharding']}-{world}"
    config = PipelineConfig.model_validate(
        {
            "name": "train-memory",
            "model": path,
            "cluster": {"local_resources": {"CPU": world + 2}},
            "pools": {"train": {"hardware": "CPU", "cpus": world}, "rollout": {"hardware": "CPU", "cpus": 1}},
            "envs": [{"name": "reverse", "groups": 2, "kwargs": {"length": 3}}],
            "rollout": {"num_env_groups": 2, "group_size": 2, "batch_groups": 2, "alpha": 0},
            "sampling": {"temperature": 1.0, "max_new_tokens": 3, "seed": 0},
            "train": {k: v for k, v in cfg.items() if k != "model"},
            "weights": {"channel": args.channel, "bucket_mb": args.bucket_mb},
            "steps": args.steps,
            "checkpoint_every": 0,
            "output_dir": str(out),
        }
    )
    own_ray = not ray.is_initialized()
    pipe = AgenticPipeline(config, progress=False)
    try:
        history = pipe.run()
        ranks = pipe.train.memory()
    finally:
        pipe.shutdown()
        if own_ray:
            ray.shutdown()
    return {
        "states_gib": max(r["states_bytes"] for r in ranks) / 2**30,
        "peak_rss_gib": max(r["peak_rss_bytes"] for r in ranks) / 2**30,
        "peak_rss_gib_by_rank": [r["peak_rss_bytes"] / 2**30 for r in sorted(ranks, key=lambda r: r["rank"])],
        "load_peak_rss_gib_by_rank": [
            (r.get("load_peak_rss_bytes") or 0) / 2**30 for r in sorted(ranks, key=lambda r: r["rank"])
        ],
        "rewards": [h["reward_mean"] for h in history],
        "step_s": statistics.median(h["time"]["step_s"] for h in history) if history else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import psutil
    import torch

    from rollart.benchmarks.common import write_report
    from rollart.benchmarks.device_peaks import pick_device
    from rollart.benchmarks.engine_throughput import model_folder
    from rollart.training.memory import model_param_counts, state_bytes_per_rank

    device = pick_device(args.device)
    on_gpu = device.type == "cuda"
    path, label = model_folder(args.model, args.shape, args.layers)
    total, split = model_param_counts(path)
    host = psutil.virtual_memory().total
    rows: list[dict[str, Any]] = []
    for layout in args.layouts:
        for world in args.ranks:
            cfg = {
                "model": path,
                "dtype": args.dtype or ("bf16" if on_gpu else "fp32"),
                "gradient_checkpointing": args.gradient_checkpointing,
                "max_tokens_per_microbatch": args.batch * args.seq_len,
                "loss": "ppo",
                "prefix_sharing": False,
                **LAYOUTS[layout],
            }
            tp = cfg.get("tensor_parallel", 1)
            theory = state_bytes_per_rank(total, split, sharding=cfg["sharding"], ranks=world, tensor_parallel=tp)
            row: dict[str, Any] = {"layout": layout, "ranks": world, "theory_gib": theory / 2**30}
            if world % tp:
                row["skipped"] = f"tensor_parallel {tp} needs a multiple of {tp} ranks"
            elif on_gpu and world > torch.cuda.device_count():
                row["skipped"] = f"{world} ranks, {torch.cuda.device_count()} GPUs"
            elif not on_gpu and theory * world > 0.9 * host:
                row["skipped"] = (
                    f"{world} ranks x {theory / 2**30:.1f} GiB of states > 90% of this machine's {host / 2**30:.0f} GiB"
                )
            if "skipped" in row:
                rows.append(row)
                continue
            if args.job:
                row.update(_job(args, path, cfg, world))
                rows.append(row)
                continue
            threads = args.threads or (max(1, (os.cpu_count() or 1) // world) if on_gpu else 1)
            spec = {
                "config": cfg,
                "device": device.type,
                "batch": args.batch,
                "seq_len": args.seq_len,
                "steps": args.steps,
                "threads": threads,
                "bucket_bytes": args.bucket_mb << 20,
            }
            ranks = _run_layout(spec, world)
            step_s = max(r["step_s"] for r in ranks)
            row.update(
                {
                    "states_gib": max(r["states_bytes"] for r in ranks) / 2**30,
                    "peak_rss_gib": max(r["peak_rss"] for r in ranks) / 2**30,
                    "step_peak_rss_gib": max(r["step_peak_rss"] for r in ranks) / 2**30,
                    "load_peak_rss_gib": max(r["load_peak_rss"] for r in ranks) / 2**30,
                    "peak_rss_gib_by_rank": [r["peak_rss"] / 2**30 for r in sorted(ranks, key=lambda r: r["rank"])],
                    "peak_gpu_gib": (max(r["peak_gpu"] for r in ranks) / 2**30) if on_gpu else None,
                    "publish_extra_rss_gib": max(r["publish_extra_rss"] for r in ranks) / 2**30,
                    "bucket_gib": (args.bucket_mb << 20) / 2**30,
                    "step_s": step_s,
                    "tokens_per_s": args.batch * args.seq_len / step_s,
                }
            )
            rows.append(row)
    result = {
        "bench": "train-memory",
        "model": label,
        "params": total,
        "device": str(device),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "job": args.job,
        "rows": rows,
    }
    key = "peak_rss_gib" if args.job else "step_peak_rss_gib"
    bars = {f"{r['layout']} x{r['ranks']}": r[key] for r in rows if "skipped" not in r}
    return write_report(
        args.out, "train_memory", result, bars, "peak RSS per rank (GiB)", f"train-memory: {label}, per rank"
    )
