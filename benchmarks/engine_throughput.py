"""engine: built-in torch engine throughput vs Hugging Face ``generate`` at the same batch.

Both decode ``batch`` prompts for exactly ``new_tokens`` tokens (greedy) with the same model; the
engine runs its continuous-batching loop (``step`` until every request is done), HF runs one
``generate`` call with its KV cache. Reports output tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from rollart.benchmarks.common import write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: the built-in tiny model)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench/engine")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rollart.engines.base import EngineRequest, SamplingParams
    from rollart.engines.torch_engine import TorchEngine
    from rollart.models import default_tiny_path

    torch.set_num_threads(1)
    path = args.model or str(default_tiny_path())
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 100, (args.batch, args.prompt_len), generator=g)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = TorchEngine(path, max_batch_size=args.batch)
    hf_s, eng_s = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        hf_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i, row in enumerate(prompts.tolist()):
            engine.add_request(
                EngineRequest(f"r{i}", row, SamplingParams(temperature=0, max_new_tokens=args.new_tokens))
            )
        while engine.has_unfinished():
            engine.step()
        eng_s.append(time.perf_counter() - t0)
    tokens = args.batch * args.new_tokens
    hf_tps, eng_tps = tokens / min(hf_s), tokens / min(eng_s)
    result = {
        "bench": "engine",
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "hf_generate_tokens_per_s": hf_tps,
        "torch_engine_tokens_per_s": eng_tps,
        "ratio": eng_tps / hf_tps,
        "goal": ">= 0.8x of HF generate",
    }
    return write_report(
        args.out,
        "engine",
        result,
        {"HF generate": hf_tps, "rollart torch engine": eng_tps},
        "output tokens/s",
        f"engine throughput: {eng_tps / hf_tps:.2f}x of HF generate",
    )
