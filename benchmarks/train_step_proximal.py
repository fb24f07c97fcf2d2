"""Actor training-step time with and without the pi_old (proximal) forward pass.

On a quickstart-sized batch (256 trajectories of 20-30 tokens, the last 3 the action, like reverse-3;
the default tiny model; ``max_tokens_per_microbatch`` 8192 as in ``pipelines/quickstart.yaml``), one
in-process ``TorchTrainWorker`` per mode takes ``--steps`` timed ``train_step`` calls after one warm-up
call: ``proximal: recompute`` (the extra no-grad forward over every micro-batch before the update) and
``proximal: auto`` (with ``ppo_epochs: 1`` pi_old is the detached current log-probs, no extra pass).
The two modes alternate step by step so load on a shared machine hits both alike.

    python -m rollart.benchmarks.train_step_proximal --steps 10 --out runs/bench/train_step_proximal.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import rollart as ra
from rollart.cluster.worker import WorkerContext, host_class
from rollart.training import columns as C
from rollart.training.torch_strategy import TorchTrainWorker

log = logging.getLogger("rollart.bench")


def quickstart_batch(rows: int = 256, seed: int = 0) -> ra.Batch:
    g = torch.Generator().manual_seed(seed)
    ids, masks, adv, behaviour = [], [], [], []
    for i in range(rows):
        length = int(torch.randint(20, 31, (1,), generator=g))
        ids.append(torch.randint(3, 200, (length,), generator=g).tolist())
        masks.append([0] * (length - 3) + [1] * 3)
        adv.append([float((-1) ** i)] * length)
        behaviour.append([0.0] * (length - 3) + (-torch.rand(3, generator=g) * 3).tolist())
    return ra.Batch({C.INPUT_IDS: ids, C.LOSS_MASK: masks, C.ADVANTAGES: adv, C.BEHAVIOUR_LOGPROBS: behaviour})


def worker(proximal: str, loss: str) -> Any:
    ctx = WorkerContext(cluster="bench", job_id="bench", rank=0, world_size=1, pool=None, hardware="CPU")
    cfg = {"lr": 1e-3, "loss": loss, "ppo_epochs": 1, "max_tokens_per_microbatch": 8192, "proximal": proximal}
    return host_class(TorchTrainWorker)(ctx, (), {"config": cfg})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--loss", default="ppo")
    p.add_argument("--modes", default="recompute,auto", help="comma-separated: recompute, auto")
    p.add_argument("--out", type=Path, default=Path("runs/bench/train_step_proximal.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    batch = quickstart_batch()
    workers = {mode: worker(mode, args.loss) for mode in args.modes.split(",")}
    wall: dict[str, list[float]] = {mode: [] for mode in workers}
    cpu: dict[str, list[float]] = {mode: [] for mode in workers}
    for step in range(args.steps + 1):
        for mode, w in workers.items():
            t0, c0 = time.perf_counter(), time.process_time()
            w.train_step(batch)
            if step > 0:  # the first call warms allocator and kernels
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
    report: dict[str, Any] = {
        "rows": len(batch),
        "tokens": sum(len(s) for s in batch[C.INPUT_IDS]),
        "loss": args.loss,
        "device": str(next(iter(workers.values())).device),
        "threads": torch.get_num_threads(),
        # CPU seconds of this process: on a shared machine far steadier than wall-clock seconds
        **{f"{mode}_cpu_median_s": statistics.median(v) for mode, v in cpu.items()},
        **{f"{mode}_wall_median_s": statistics.median(v) for mode, v in wall.items()},
        "cpu_s": cpu,
        "wall_s": wall,
    }
    if len(workers) == 2:
        report["cpu_speedup"] = report["recompute_cpu_median_s"] / report["auto_cpu_median_s"]
    log.info(
        "train_step median over %d steps: %s",
        args.steps,
        ", ".join(
            f"{m} {report[f'{m}_cpu_median_s']:.3f} s CPU ({report[f'{m}_wall_median_s']:.3f} s wall)" for m in workers
        ),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
