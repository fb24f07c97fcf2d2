"""Train the calculator agent on a CPU: ``python run.py [--steps N] [--out DIR]``.

Builds the starting policy (rollart's tiny model with a tool-rendering chat template, after a short
supervised warm-up: ``warmup.py``), then trains ``agent.solve`` through the policy endpoint with
``config.yaml``. Prints the reward of every step; ``OUT/calculator/metrics.jsonl`` and ``metrics.png``
hold the curve.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="training steps (default: config.yaml's)")
    p.add_argument("--out", default="runs", help="where the model and the run go")
    p.add_argument("--warmup-steps", type=int, default=200, help="supervised warm-up steps of the starting policy")
    p.add_argument(
        "--cache",
        default=os.environ.get("ROLLART_CACHE", str(Path.home() / ".cache" / "rollart")),
        help="where the starting policy is built once and reused",
    )
    p.add_argument("--seed", type=int, default=None, help="the sampler's seed (default: config.yaml's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpx2"):  # the openai client logs every call
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars, here and in the workers
    sys.path.insert(0, str(HERE))
    from warmup import build_policy

    from rollart.config import load_config
    from rollart.pipelines.agentic import AgenticPipeline

    model = build_policy(Path(args.cache), steps=args.warmup_steps)
    out = Path(args.out).resolve()
    overrides = {
        "model": str(model),
        "output_dir": str(out / "{name}"),
        "cluster.metadata_store": str(out / "metadata.sqlite"),  # the run's own record of its pools
    }
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.seed is not None:
        overrides["sampling.seed"] = args.seed
    cfg = load_config(HERE / "config.yaml", overrides)
    from rollart.pipeline.startup import set_command_started

    set_command_started(time.time())  # the run's start-up line counts from here, not from the warm-up
    try:
        pipeline = AgenticPipeline(cfg, progress=False)
        try:
            history = pipeline.run()
        finally:
            pipeline.shutdown()
    finally:
        set_command_started(None)
    for h in history:
        print(f"step {h['step']:3d}  reward {h['reward_mean']:.3f}")
    return history


if __name__ == "__main__":
    main()
