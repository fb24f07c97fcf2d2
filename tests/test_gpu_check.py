"""``scripts/gpu_check.sh`` on a machine without a GPU (CI): every GPU step is reported skipped, the CPU-safe
steps run, and the one JSON summary on stdout says so."""

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_STEPS = {
    "gpu_tests",
    "quickstart_train_gpu",
    "quickstart_bf16_lora",
    "quickstart_megatron",
    "quickstart_colocated",
    "quickstart_rollout_gpu",
    "quickstart_fsdp_gpu",
    "engine_0.5b_before_after",
    "engine_1.5b_before_after",
    "train_step_packing_0.5b",
    "train_step_packing_1.5b",
}


@pytest.mark.timeout(600)
def test_without_a_gpu_the_gpu_steps_are_skipped_and_the_cpu_steps_pass(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--no-gpu", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=580,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    summary = json.loads(proc.stdout)  # stdout is the summary and nothing else
    assert proc.returncode == 0 and summary["ok"] is True, (summary, proc.stderr[-3000:])
    steps = summary["steps"]
    assert {n for n, s in steps.items() if s["status"] == "skipped"} == GPU_STEPS
    assert all(steps[n]["reason"] == "no GPU" for n in GPU_STEPS)
    assert steps["env"]["result"]["ray_detects"] == "no GPU"
    cpu = steps["cpu_pool"]["result"]["cpu_worker"]
    assert (cpu["device"], cpu["cuda_visible_devices"], cpu["cuda_available"]) == ("cpu", "", False)
    assert steps["bench_engine"]["result"]["decode_tokens_per_s"] > 0
    assert steps["bench_engine"]["result"]["roofline_fraction"] > 0
    assert steps["bench_train_step"]["result"]["tokens_per_s"] > 0 and steps["bench_train_step"]["result"]["mfu"] > 0
    for name in ("train_memory_ddp_fsdp", "train_3b_fsdp_offload"):  # the sharded layouts' CPU-safe part
        rows = steps[name]["result"]["rows"]
        assert rows and all(r["states_gib"] == pytest.approx(r["theory_gib"]) for r in rows), rows
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == summary
    assert "===== cpu_pool" in (tmp_path / "gpu_check.log").read_text()


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_gpu_runs_it_would_start(tmp_path, monkeypatch):
    check = _script()
    args = argparse.Namespace(out=str(tmp_path), steps=5, quick=False)
    assert check.COLOCATED.is_file()  # colocated mode's config ships with rollart
    colocated = check._colocated(args)
    assert colocated[1:5] == ["-m", "rollart.cli", "run", str(check.COLOCATED)]
    assert "steps=5" in colocated
    commands = {s.name: s.command(args) for s in check.STEPS}
    train = commands["quickstart_train_gpu"]
    assert train[1:5] == ["-m", "rollart.cli", "run", "quickstart"]
    assert "pools.train={hardware: GPU, devices: 1}" in train and "pools.rollout={hardware: CPU, cpus: 1}" in train
    lora = commands["quickstart_bf16_lora"]
    assert {"train.dtype=bf16", "train.gradient_checkpointing=true", "train.lora={r: 8}"} <= set(lora)
    assert commands["bench_engine"][-2:] == ["--shape", "qwen2.5-0.5b"]
    assert commands["bench_train_step"][-2:] == ["--shape", "qwen2.5-0.5b"]
    assert "train.sharding=fsdp" in commands["quickstart_fsdp_gpu"]
    offload = commands["train_3b_fsdp_offload"]
    assert offload[offload.index("--shape") + 1] == "qwen2.5-3b" and "fsdp+offload" in offload
