"""Bring your own data end to end with the tiny model: two dataset tasks trained and evaluated per tag
(eval metrics in metrics.jsonl, resume restores the samplers), and the documentation's "Train on your own
data" walk-through run as written (its files and commands, a few steps)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import rollart
from rollart.config import load_config
from rollart.pipelines.agentic import AgenticPipeline

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_two_dataset_tasks_train_evaluate_per_tag_and_resume(ray_local, tmp_path):
    sums = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    words = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st"]
    copies = [{"question": f"{w}=", "solution": w[::-1]} for w in words]
    write_jsonl(tmp_path / "sums.jsonl", sums[:80])
    write_jsonl(tmp_path / "sums_val.jsonl", sums[80:])
    write_jsonl(tmp_path / "flip.jsonl", copies)
    (tmp_path / "checks.py").write_text(
        "def first_char(completion, answer, **row):\n    return float(completion[:1] == answer[:1])\n"
    )
    (tmp_path / "run.yaml").write_text(
        f"""
name: byo
cluster: {{metadata_store: {tmp_path / "meta.sqlite"}}}
pools: {{train: {{hardware: CPU, cpus: 1}}, rollout: {{hardware: CPU, cpus: 1}}}}
tiny_model: {{hidden_size: 32, num_layers: 1, intermediate_size: 64}}
data:
  - {{train: sums.jsonl, val: sums_val.jsonl, verifier: number, groups: 2}}
  - {{train: flip.jsonl, val: flip.jsonl, tag: flip, prompt_key: question, answer_key: solution,
      verifier: "checks:first_char", groups: 2}}
rollout: {{num_env_groups: 4, group_size: 4, batch_groups: 4}}
sampling: {{temperature: 1.0, max_new_tokens: 2, seed: 0}}
eval: {{every: 2, samples_per_prompt: 4, max_prompts: 5, pass_k: [1, 2, 4]}}
steps: 3
checkpoint_every: 2
output_dir: {tmp_path / "run"}
"""
    )
    cfg = load_config(tmp_path / "run.yaml")
    pipe = AgenticPipeline(cfg, progress=False)
    try:
        history = pipe.run()
    finally:
        pipe.shutdown()
    lines = read(pipe.metrics_path)
    assert [h["step"] for h in lines] == [1, 2, 3] == [h["step"] for h in history]
    assert [("eval" in h) for h in lines] == [False, True, True]  # every 2 steps and after the last
    for h in lines:
        assert set(h["reward_by_tag"]) == {"sums", "flip"} and set(h["data_epoch"]) == {"sums", "flip"}
    for h in lines[1:]:
        ev = h["eval"]
        assert set(ev["by_tag"]) == {"sums", "flip"} and ev["failed"] == 0
        assert ev["prompts"] == 10 and ev["samples"] == 40
        for m in [ev, *ev["by_tag"].values()]:
            assert 0.0 <= m["pass@1"] <= m["pass@2"] <= m["pass@4"] <= 1.0
            assert m["pass@1"] == pytest.approx(m["accuracy"])  # n samples for every prompt: pass@1 = accuracy
            assert 0.0 <= m["mean_reward"] <= 1.0
    assert pipe.plot_path is not None and pipe.plot_path.exists()
    saved_position = {tag: s.next_position for tag, s in pipe.data_tasks.samplers.items()}

    resumed = AgenticPipeline(load_config(tmp_path / "run.yaml", {"steps": 4}), resume=True, progress=False)
    try:
        assert resumed.start_step == 2
        # restored from the checkpoint of step 1 (the run went on to step 2 after it)
        assert all(0 < resumed.data_tasks.samplers[t].next_position <= saved_position[t] for t in saved_position)
        more = resumed.run()
    finally:
        resumed.shutdown()
    assert [h["step"] for h in more] == [3, 4] and "eval" in more[-1]


def walkthrough_section() -> str:
    text = (ROOT / "docs" / "data.md").read_text()
    start = text.index("## Walk-through")
    end = text.index("\n## Reference", start)
    return text[start:end]


def test_the_documented_walk_through_runs_as_written(tmp_path):
    blocks = re.findall(r"```(\w+)\n(.*?)```", walkthrough_section(), flags=re.S)
    files = {}
    commands = []
    for lang, body in blocks:
        first = body.splitlines()[0]
        if first.startswith("# file: "):
            files[first.removeprefix("# file: ").strip()] = body
        elif lang == "bash":
            commands.append(body.strip())
    install = commands.pop(0)  # the data extra, from the repository root (this test's environment has it)
    assert install.startswith('pip install -c constraints/cpu.txt -e ".[data]"'), install
    assert set(files) == {"make_data.py", "my_rewards.py", "sums.yaml"} and len(commands) == 3
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    run_cmd, read_cmd, export_cmd = commands
    assert "rollart run sums.yaml" in run_cmd
    # a few steps instead of 200, evaluating after each, fewer prompts
    few = ["--set", "steps=2", "--set", "eval.every=1", "--set", "eval.max_prompts=4", "--set", "checkpoint_every=2"]
    # the subprocesses import the rollart this test imports
    here = str(Path(rollart.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    for part in run_cmd.split("&&"):
        argv = shlex.split(part)
        if argv[0] == "python":
            argv[0] = sys.executable
        elif argv[0] == "rollart":
            argv = [sys.executable, "-m", "rollart.cli", *argv[1:], *few]
        out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=800, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
    lines = read(tmp_path / "runs" / "sums" / "metrics.jsonl")
    assert len(lines) == 2
    for h in lines:
        ev = h["eval"]
        assert {"accuracy", "mean_reward", "pass@1", "pass@8", "by_tag"} <= set(ev) and set(ev["by_tag"]) == {"sums"}
        assert ev["prompts"] == 4 and ev["samples"] == 32 and "sums" in h["reward_by_tag"]
    assert (tmp_path / "runs" / "sums" / "metrics.png").exists()
    argv = shlex.split(read_cmd)
    assert argv[0] == "python"
    out = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()] == ["1", "2"]
    # the run's own export, then `rollart export` from its checkpoint, loaded by transformers
    assert (tmp_path / "runs" / "sums" / "hf" / "model.safetensors").exists()
    export, load = (shlex.split(part) for part in export_cmd.split("&&"))
    assert export[:2] == ["rollart", "export"] and load[0] == "python"
    out = subprocess.run(
        [sys.executable, "-m", "rollart.cli", *export[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    out = subprocess.run(
        [sys.executable, *load[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "Qwen2ForCausalLM" and int(out.stdout.split()[1]) > 0
