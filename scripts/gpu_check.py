"""The device check behind ``scripts/gpu_check.sh``: every GPU path of rollart in one run, one JSON summary.

Steps, in order (each in its own process, with its own timeout, inside one overall time budget; a step
the budget no longer fits is reported ``skipped``):

- ``env``: Python, torch, CUDA, the GPU's name, Ray, rollart, and what Ray's detection finds;
- ``gpu_tests``: the ``gpu``-marked tests (:data:`GPU_TEST_FILES`);
- ``cpu_pool``: a worker of a CPU pool next to a worker of a GPU pool: its CUDA is hidden, it never
  selects CUDA, and it holds no GPU memory (``nvidia-smi``: the GPU's used memory before and after it
  starts and runs a model, and the compute processes by pid). Without a GPU: the CPU-pool half;
- ``bench_engine``, ``bench_train_step``: ``rollart bench engine`` / ``train-step`` at the 0.5B shape;
- ``engine_0.5b_before_after``, ``engine_1.5b_before_after``: the torch engine's decode at the 0.5B shape
  (batch 64) and the 1.5B shape (batch 16), the static-cache engine against the dynamic-cache one it
  replaced (``--compare``: tokens/s, fraction of the HBM roofline, speed-up);
- ``train_step_packing_0.5b``, ``train_step_packing_1.5b``: ``rollart bench train-step`` on rows of 16-512
  tokens, padded against packed (``train.packing``): tokens/s, MFU and the time per phase of each;
- ``quickstart_train_gpu``: the quickstart, train on the GPU, rollout on a CPU pool (separate pools);
- ``quickstart_colocated``: ``pipelines/quickstart_colocated.yaml`` (train and rollout on the one GPU);
- ``quickstart_bf16_lora``: train on the GPU with ``train.dtype: bf16``, gradient checkpointing and LoRA;
- ``quickstart_megatron``: train on the GPU with ``train.strategy: megatron``;
- ``quickstart_rollout_gpu``: rollout on the GPU, train on a CPU pool;
- ``quickstart_fsdp_gpu``: train on the GPU with ``train.sharding: fsdp`` (one rank over NCCL);
- ``train_memory_ddp_fsdp``: ``rollart bench train-memory`` at the 1.5B shape, DDP against FSDP on one GPU
  (GPU peak memory, host peak RSS, tokens/s);
- ``train_3b_fsdp_offload``: the 3B shape on one GPU with FSDP and CPU offload (its states in host memory).

Without a GPU (or with ``--no-gpu``) the GPU steps are ``skipped`` and the rest run on the CPU;
``--quick`` runs the benches on the built-in tiny model with tiny batches (CI). Logs go to
``OUT/gpu_check.log``, the summary to stdout and ``OUT/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SELF = str(Path(__file__).resolve())
ROOT = Path(SELF).parent.parent
COLOCATED = ROOT / "pipelines" / "quickstart_colocated.yaml"


@dataclass
class Step:
    name: str
    command: Callable[[argparse.Namespace], list[str] | str]  # argv, or a skip reason
    timeout_s: float
    needs_gpu: bool = True
    parse: Callable[[str], Any] | None = None  # what of its stdout goes into the summary
    in_checkout: bool = False  # run in the checkout (pytest's rootdir); else in OUT, so the installed rollart is used
    result: dict[str, Any] = field(default_factory=dict)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _last_json(stdout: str) -> Any:
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def _run_summary(stdout: str) -> Any:
    summary = _last_json(stdout)
    if not summary.get("steps"):
        raise ValueError(f"the run trained no step: {summary}")
    return {k: summary.get(k) for k in ("steps", "first_reward", "final_reward")}


def _bench_fields(*keys: str) -> Callable[[str], Any]:
    def parse(stdout: str) -> Any:
        out = _last_json(stdout)
        if out.get("error"):
            raise ValueError(out["error"])
        return {k: out.get(k) for k in keys}

    return parse


def _quickstart(*sets: str) -> Callable[[argparse.Namespace], list[str]]:
    def command(args: argparse.Namespace) -> list[str]:
        name = "_".join(s.split("=")[0].split(".")[-1] for s in sets) or "run"
        return _py(
            "-m",
            "rollart.cli",
            "run",
            "quickstart",
            "--json",
            "--set",
            f"steps={args.steps}",
            "--set",
            "checkpoint_every=0",
            "--set",
            f"output_dir={args.out}/runs/{name}",
            *[x for s in sets for x in ("--set", s)],
        )

    return command


GPU_TEST_FILES = ("tests/test_gpu_placement.py", "tests/test_engine_vllm.py")  # where the gpu-marked tests are
GPU_POOL = "{hardware: GPU, devices: 1}"
CPU_POOL = "{hardware: CPU, cpus: 1}"
ENGINE_FIELDS = (
    "model",
    "device_name",
    "dtype",
    "batch",
    "decode_tokens_per_s",
    "roofline_fraction",
    "bandwidth_source",
    "achieved_B_per_s",
)
# the engine before (dynamic cache) and after (static cache, sampling on the device, CUDA graphs), side by side
COMPARE_FIELDS = (
    *ENGINE_FIELDS,
    "dynamic_decode_tokens_per_s",
    "dynamic_roofline_fraction",
    "speedup_vs_dynamic",
)
MEMORY_FIELDS = ("model", "params", "device", "batch", "seq_len", "rows")
TRAIN_FIELDS = ("model", "device_name", "dtype", "batch", "seq_len", "tokens_per_s", "mfu", "peak_flops_source")
# padded against packed steps on rows of spread lengths (train.packing), with MFU and the time per phase
PACKING_FIELDS = (*TRAIN_FIELDS, "lengths", "padded", "packed", "packing_speedup", "phase_s")


def _bench(name: str, full: list[str], quick: list[str]) -> Callable[[argparse.Namespace], list[str]]:
    def command(args: argparse.Namespace) -> list[str]:
        extra = quick if args.quick else full
        return _py("-m", "rollart.cli", "bench", name, "--json", "--out", f"{args.out}/bench", *extra)

    return command


def _colocated(args: argparse.Namespace) -> list[str]:
    return _py(
        "-m",
        "rollart.cli",
        "run",
        str(COLOCATED),
        "--json",
        "--set",
        f"steps={args.steps}",
        "--set",
        "checkpoint_every=0",
        "--set",
        f"output_dir={args.out}/runs/colocated",
    )


def _megatron(args: argparse.Namespace) -> list[str] | str:
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        return "megatron-core is not installed (pip install 'rollart[megatron]'; scripts/device_bundle.sh bundles it)"
    return _quickstart(f"pools.train={GPU_POOL}", "train.strategy=megatron")(args)


STEPS = [
    Step("env", lambda a: _py(SELF, "env"), 60, needs_gpu=False, parse=_last_json),
    Step(
        "gpu_tests",
        lambda a: _py("-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TEST_FILES),
        240,
        in_checkout=True,
    ),
    Step("cpu_pool", lambda a: _py(SELF, "cpu-pool"), 120, needs_gpu=False, parse=_last_json),
    Step(
        "bench_engine",
        _bench("engine", ["--shape", "qwen2.5-0.5b"], ["--batch", "2", "--new-tokens", "4", "--repeats", "1"]),
        150,
        needs_gpu=False,
        parse=_bench_fields(*ENGINE_FIELDS),
    ),
    Step(
        "bench_train_step",
        _bench("train-step", ["--shape", "qwen2.5-0.5b"], ["--steps", "1", "--warmup", "0", "--seq-len", "32"]),
        150,
        needs_gpu=False,
        parse=_bench_fields(*TRAIN_FIELDS),
    ),
    Step(
        "quickstart_train_gpu",
        _quickstart(f"pools.train={GPU_POOL}", f"pools.rollout={CPU_POOL}"),
        150,
        parse=_run_summary,
    ),
    Step("quickstart_colocated", _colocated, 150, parse=_run_summary),
    Step(
        "quickstart_bf16_lora",
        _quickstart(
            f"pools.train={GPU_POOL}", "train.dtype=bf16", "train.gradient_checkpointing=true", "train.lora={r: 8}"
        ),
        150,
        parse=_run_summary,
    ),
    Step("quickstart_megatron", _megatron, 150, parse=_run_summary),
    Step(
        "quickstart_fsdp_gpu",
        _quickstart(f"pools.train={GPU_POOL}", f"pools.rollout={CPU_POOL}", "train.sharding=fsdp"),
        150,
        parse=_run_summary,
    ),
    Step(
        "train_memory_ddp_fsdp",
        _bench(
            "train-memory",
            ["--shape", "qwen2.5-1.5b", "--layouts", "ddp", "fsdp", "--ranks", "1", "--batch", "8", "--seq-len", "512"],
            ["--layouts", "fsdp", "--ranks", "2", "--batch", "2", "--seq-len", "16", "--steps", "1"],
        ),
        240,
        needs_gpu=False,
        parse=_bench_fields(*MEMORY_FIELDS),
    ),
    Step(
        "train_3b_fsdp_offload",
        _bench(
            "train-memory",
            ["--shape", "qwen2.5-3b", "--layouts", "fsdp+offload", "--ranks", "1", "--batch", "4", "--seq-len", "512"],
            ["--layouts", "fsdp+offload", "--ranks", "1", "--batch", "2", "--seq-len", "16", "--steps", "1"],
        ),
        300,
        needs_gpu=False,
        parse=_bench_fields(*MEMORY_FIELDS),
    ),
    Step(
        "quickstart_rollout_gpu",
        _quickstart(f"pools.rollout={GPU_POOL}", f"pools.train={CPU_POOL}"),
        150,
        parse=_run_summary,
    ),
    # last: the time budget may not fit them (--only runs them alone)
    Step(
        "engine_0.5b_before_after",
        _bench("engine", ["--shape", "qwen2.5-0.5b", "--batch", "64", "--compare"], []),
        240,
        parse=_bench_fields(*COMPARE_FIELDS),
    ),
    Step(
        "engine_1.5b_before_after",
        _bench("engine", ["--shape", "qwen2.5-1.5b", "--batch", "16", "--compare"], []),
        240,
        parse=_bench_fields(*COMPARE_FIELDS),
    ),
    Step(
        "train_step_packing_0.5b",
        _bench("train-step", ["--shape", "qwen2.5-0.5b", "--lengths", "16-512", "--packing", "both"], []),
        240,
        parse=_bench_fields(*PACKING_FIELDS),
    ),
    Step(
        "train_step_packing_1.5b",
        _bench("train-step", ["--shape", "qwen2.5-1.5b", "--lengths", "16-512", "--packing", "both"], []),
        240,
        parse=_bench_fields(*PACKING_FIELDS),
    ),
]


def run_steps(args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "gpu_check.log"
    started = time.monotonic()
    results: dict[str, Any] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        for step in STEPS:
            if step.needs_gpu and not gpu:
                results[step.name] = {"status": "skipped", "reason": "no GPU"}
                continue
            if args.only and step.name not in args.only:
                results[step.name] = {"status": "skipped", "reason": "not selected"}
                continue
            command = step.command(args)
            if isinstance(command, str):
                results[step.name] = {"status": "skipped", "reason": command}
                continue
            left = args.budget_s - (time.monotonic() - started)
            if left < 30:
                results[step.name] = {"status": "skipped", "reason": f"time budget ({args.budget_s:.0f} s) spent"}
                continue
            timeout = min(step.timeout_s, left - 10)
            log.write(f"\n===== {step.name}: {' '.join(command)} (timeout {timeout:.0f} s)\n")
            log.flush()
            t0 = time.monotonic()
            try:
                proc = subprocess.run(
                    command,
                    cwd=ROOT if step.in_checkout else out,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    timeout=timeout,
                    check=False,
                )
            except subprocess.TimeoutExpired as err:
                stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
                log.write(stdout)
                results[step.name] = {"status": "failed", "reason": f"timed out after {timeout:.0f} s"}
                continue
            seconds = round(time.monotonic() - t0, 1)
            log.write(proc.stdout)
            log.flush()
            entry: dict[str, Any] = {"status": "passed" if proc.returncode == 0 else "failed", "seconds": seconds}
            if proc.returncode != 0:
                tail = (proc.stdout.strip().splitlines() or [""])[-1][:300]
                entry["reason"] = f"exit code {proc.returncode}" + (f": {tail}" if tail else "")
            elif step.parse is not None:
                try:
                    entry["result"] = step.parse(proc.stdout)
                except (ValueError, KeyError) as err:
                    entry.update(status="failed", reason=f"unexpected output: {err}")
            if step.name == "cpu_pool" and entry["status"] == "passed" and not entry.get("result", {}).get("ok"):
                entry.update(status="failed", reason="a CPU-pool worker touched the GPU (see result)")
            results[step.name] = entry
    ran = [r for r in results.values() if r["status"] != "skipped"]
    return {
        "check": "gpu_check",
        "date": time.strftime("%Y-%m-%d"),
        "gpu": gpu,
        "quick": args.quick,
        "seconds": round(time.monotonic() - started, 1),
        "ok": bool(ran) and all(r["status"] == "passed" for r in ran),
        "steps": results,
        "log": str(log_path),
    }


# ---------------------------------------------------------------------- the steps run in their own process
def env_facts() -> dict[str, Any]:
    import ray
    import torch
    import transformers

    import rollart
    from rollart.resource_manager.launcher import detect_gpus

    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": ray.__version__,
        "rollart": rollart.__version__,
        "cuda": cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
        "ray_detects": detect_gpus().describe(),
        "cpus": os.cpu_count(),
    }


def _gpu_memory_mib() -> dict[str, Any]:
    """The GPU's used memory and the compute processes on it, as ``nvidia-smi`` reports them."""
    if shutil.which("nvidia-smi") is None:
        return {}
    used = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout.split()
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    pids = {}
    for line in apps.splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        pids[int(pid)] = float(mib)
    return {"used_mib": float(used[0]) if used else None, "apps": pids}


def cpu_pool_check() -> dict[str, Any]:
    """A CPU-pool worker beside a GPU-pool worker (when there is a GPU): what each saw and held."""
    import rollart as ra

    class Holder(ra.Worker):
        def __init__(self) -> None:
            import torch

            from rollart.cluster.devices import worker_device
            from rollart.models import default_tiny_path
            from rollart.models.shapes import load_causal_lm

            self.device = worker_device(self.device_ids)
            self.model = load_causal_lm(default_tiny_path()).to(self.device)
            with torch.no_grad():  # a forward pass: whatever the worker would touch, it touched
                self.model(torch.ones((1, 8), dtype=torch.long, device=self.device))

        @ra.register(dispatch=ra.Dispatch.ONE_TO_ALL)
        def facts(self) -> dict[str, Any]:
            import torch

            return {
                "pid": os.getpid(),
                "device": str(self.device),
                "device_ids": list(self.device_ids),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "cuda_available": torch.cuda.is_available(),  # initialises CUDA where a device is visible
                "cuda_initialized": torch.cuda.is_initialized(),
            }

    from rollart.resource_manager.launcher import detect_gpus

    gpu = detect_gpus().count > 0  # NVML, as Ray sees it: this driver never initialises CUDA
    pools: dict[str, Any] = {"cpu": {"hardware": "CPU", "cpus": 1}}
    if gpu:
        pools["gpu"] = {"hardware": "GPU", "devices": 1}
    rm = ra.ResourceManager(pools, store=os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu_check_meta.sqlite"))
    out: dict[str, Any] = {}
    try:
        if gpu:
            out["gpu_worker"] = ra.Cluster("gpu_holder", Holder, rm, pool="gpu").facts()[0]
        before = _gpu_memory_mib()
        cpu = ra.Cluster("cpu_holder", Holder, rm, pool="cpu").facts()[0]
        after = _gpu_memory_mib()
    finally:
        rm.shutdown()
    out["cpu_worker"] = cpu
    ok = cpu["device"] == "cpu" and cpu["cuda_visible_devices"] == "" and not cpu["cuda_available"]
    if before and after:
        delta = (after["used_mib"] or 0.0) - (before["used_mib"] or 0.0)
        out["gpu_memory"] = {
            "used_mib_before_cpu_worker": before["used_mib"],
            "used_mib_after_cpu_worker": after["used_mib"],
            "cpu_worker_listed": cpu["pid"] in after["apps"],
            "gpu_worker_listed": out.get("gpu_worker", {}).get("pid") in after["apps"],
            "apps": after["apps"],
        }
        # a CUDA context alone takes hundreds of MiB; other processes may move a little meanwhile
        ok = ok and delta < 64 and cpu["pid"] not in after["apps"]
    else:
        out["gpu_memory"] = "no nvidia-smi"
    if gpu:
        ok = ok and out["gpu_worker"]["device"] == "cuda:0"
    out["ok"] = ok
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="rollart's GPU check: one JSON summary on stdout")
    p.add_argument("what", nargs="?", default="all", choices=["all", "env", "cpu-pool"], help=argparse.SUPPRESS)
    p.add_argument("--no-gpu", action="store_true", help="skip every GPU step (as on a machine without a GPU)")
    p.add_argument("--quick", action="store_true", help="benches on the tiny model with tiny batches (CI)")
    p.add_argument("--steps", type=int, default=5, help="training steps of each quickstart run")
    p.add_argument("--budget-s", type=float, default=450.0, help="all steps together (default 7.5 minutes)")
    p.add_argument("--only", nargs="*", default=None, help="run only these steps")
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"))
    args = p.parse_args()
    args.out = str(Path(args.out).resolve())
    if args.what == "env":
        print(json.dumps(env_facts()))
        return
    if args.what == "cpu-pool":
        print(json.dumps(cpu_pool_check()))
        return
    gpu = not args.no_gpu and shutil.which("nvidia-smi") is not None and _nvidia_smi_lists_a_gpu()
    summary = run_steps(args, gpu)
    Path(args.out, "gpu_check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    sys.exit(0 if summary["ok"] else 1)


def _nvidia_smi_lists_a_gpu() -> bool:
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return proc.returncode == 0 and "GPU" in proc.stdout


if __name__ == "__main__":
    main()
