"""``rollart bench engine`` and ``rollart bench train-step``: the JSON fields and their arithmetic, on the CPU
with a one-layer cut of the 0.5B shape (its full width: the 151 936-row vocabulary)."""

import argparse

import pytest

from rollart.benchmarks import engine_throughput, train_step


def _args(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLART_CACHE", str(tmp_path / "cache"))


@pytest.mark.timeout(300)
def test_engine_bench_reports_decode_tokens_per_s_and_its_roofline_fraction(tmp_path):
    argv = ["--shape", "qwen2.5-0.5b", "--layers", "1", "--batch", "2", "--prompt-len", "8", "--new-tokens", "4"]
    r = engine_throughput.run(_args(engine_throughput, [*argv, "--repeats", "1", "--compare", "--out", str(tmp_path)]))
    assert (r["model"], r["device"], r["dtype"], r["params"]) == ("qwen2.5-0.5b (1 layers)", "cpu", "fp32", 151_047_936)
    assert (r["engine"], r["kv_cache"], r["cuda_graphs"]) == ("TorchEngine", "static", False)
    # --compare: the dynamic-cache engine (the one before the static cache) on the same prompts
    assert r["speedup_vs_dynamic"] == pytest.approx(r["dynamic_decode_step_ms"] / r["decode_step_ms"])
    assert r["dynamic_roofline_fraction"] == pytest.approx(r["roofline_fraction"] / r["speedup_vs_dynamic"])
    # a decode step reads the weights once and every row's context of K and V: 1 layer, 2 KV heads of 64
    assert r["kv_bytes_per_token"] == 1 * 2 * 2 * 64 * 4
    kv = sum(2 * (8 + k) * r["kv_bytes_per_token"] for k in (1, 2, 3)) / 3
    assert r["bytes_per_decode_step"] == pytest.approx(151_047_936 * 4 + kv)
    assert r["decode_tokens_per_s"] == pytest.approx(2 / (r["decode_step_ms"] / 1e3))
    assert r["achieved_B_per_s"] == pytest.approx(r["bytes_per_decode_step"] * 1e3 / r["decode_step_ms"])
    assert r["roofline_fraction"] == pytest.approx(r["achieved_B_per_s"] / r["bandwidth_B_per_s"])
    assert 0 < r["roofline_fraction"] < 1.5 and r["bandwidth_source"].startswith("measured copy kernel")
    ideal = r["bytes_per_decode_step"] / r["bandwidth_B_per_s"]  # on the CPU also by this process's CPU time
    assert r["roofline_fraction_cpu_time"] == pytest.approx(ideal * 1e3 / r["decode_step_cpu_ms"])
    assert "hf_generate_tokens_per_s" not in r  # not asked for a shape


@pytest.mark.timeout(300)
def test_train_step_bench_reports_tokens_per_s_and_mfu(tmp_path):
    argv = ["--shape", "qwen2.5-0.5b", "--layers", "1", "--seq-len", "16", "--steps", "1", "--warmup", "0"]
    r = train_step.run(_args(train_step, [*argv, "--out", str(tmp_path)]))
    assert (r["device"], r["dtype"], r["batch"], r["tokens_per_step"]) == ("cpu", "fp32", 1, 16)
    # 6·N per token (the tied matrix once: it multiplies as the output layer) + attention 12·L·d·T
    assert r["flops_per_step"] == 16 * (6 * 151_047_936 + 12 * 1 * 896 * 16)
    assert r["tokens_per_s"] == pytest.approx(16 / r["step_s"])
    assert r["mfu"] == pytest.approx(r["flops_per_step"] / r["step_s"] / r["peak_flops"])
    assert 0 < r["mfu"] < 1 and r["peak_flops_source"].startswith("measured fp32 matmul")
    assert r["mfu_cpu_time"] == pytest.approx(r["flops_per_step"] / r["step_cpu_s"] / r["peak_flops"])
    assert r["tokens_per_cpu_s"] == pytest.approx(16 / r["step_cpu_s"])


@pytest.mark.timeout(300)
def test_train_step_bench_compares_packed_and_padded_steps_with_their_phases(tmp_path):
    argv = ["--batch", "6", "--lengths", "8-40", "--packing", "both", "--steps", "1", "--warmup", "0"]
    r = train_step.run(_args(train_step, [*argv, "--max-tokens", "64", "--out", str(tmp_path)]))
    lengths = train_step.lengths_of("8-40", 6)
    assert sorted(lengths) == [8, 14, 21, 27, 34, 40] and r["tokens_per_step"] == sum(lengths)
    assert r["ran_packed"] is True and r["seq_len"] == 40
    # padded, a 64-token budget holds rows x the longest; packed, the rows' lengths: fewer micro-batches
    assert r["padded"]["microbatches"] > r["packed"]["microbatches"] >= 3
    assert r["packing_speedup"] == pytest.approx(r["padded"]["step_s"] / r["packed"]["step_s"])
    assert r["packing_speedup_cpu_time"] == pytest.approx(r["padded"]["step_cpu_s"] / r["packed"]["step_cpu_s"])
    for run in (r["padded"], r["packed"]):
        phases = run["phase_s"]
        assert set(phases) == {"forward", "backward", "optimizer", "communication", "other"}
        assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
        assert phases["communication"] == 0.0  # one process: no data-parallel reduction
        assert sum(phases.values()) == pytest.approx(run["step_s"], rel=1e-6)
    # the attention FLOPs count each row's own length: sum(len^2), not rows x longest^2
    d = 128  # the tiny model: 4 heads of 32, 2 layers, tied embeddings
    assert r["flops_per_step"] == pytest.approx(
        6 * r["params"] * sum(lengths) + 12 * 2 * d * sum(n * n for n in lengths)
    )
    with pytest.raises(SystemExit, match="--lengths"):
        train_step.lengths_of("40-8", 6)
