"""Padding-free (packed) training, in-process on the tiny model (fp32, CPU): the packed passes give the
padded passes' log-probs, entropies, losses, gradients and updated weights on batches of mixed lengths
(5..60 tokens) with micro-batching active (also with the recomputed proximal log-probs, a KL term to the
reference, gradient checkpointing and LoRA); micro-batches are formed by a token budget; a model or strategy
that cannot pack is refused by name (or, unasked, trains padded)."""

from __future__ import annotations

import json

import pytest
import torch

import rollart as ra
from rollart.cluster.worker import WorkerContext, host_class
from rollart.config import ConfigError, validate_config
from rollart.models import build_tiny
from rollart.models.shapes import load_causal_lm
from rollart.training import columns as C
from rollart.training.config import TrainConfig
from rollart.training.microbatch import pad_right
from rollart.training.packing import (
    packed_forward_kwargs,
    packed_layout,
    packed_token_logprobs,
    plan_packed_microbatches,
    use_packed_attention,
)
from rollart.training.reference import ReferenceWorker
from rollart.training.torch_strategy import TorchTrainWorker, batch_logprobs, token_logprobs
from tests.test_training_steps import local_worker

pytestmark = pytest.mark.timeout(300)

# fp32 summation order differs between a padded and a packed pass (SDPA with a padding mask vs causal
# attention per row): entropies (about 5 nats) agree to a few ulps, hence the relative term
TOL = {"atol": 1e-6, "rtol": 1e-6}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("packing") / "tiny"
    return str(build_tiny(path, hidden_size=32, num_layers=2, intermediate_size=64, seed=4))


def mixed_batch(n: int = 12, seed: int = 0) -> ra.Batch:
    """Rows of 5..60 tokens, a prompt of 2..4 tokens each, signed advantages and an engine a little off."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 61, (n,), generator=g).tolist()
    lengths[0], lengths[1] = 5, 60
    ids, masks, adv, behaviour = [], [], [], []
    for i, n_tok in enumerate(lengths):
        prompt = 2 + i % 3
        ids.append(torch.randint(3, 60, (n_tok,), generator=g).tolist())
        masks.append([0] * prompt + [1] * (n_tok - prompt))
        adv.append([float((-1) ** i) * (1 + i / 10)] * n_tok)
        behaviour.append([0.0] * prompt + (-4.0 - torch.rand(n_tok - prompt, generator=g)).tolist())
    return ra.Batch({C.INPUT_IDS: ids, C.LOSS_MASK: masks, C.ADVANTAGES: adv, C.BEHAVIOUR_LOGPROBS: behaviour})


def test_token_budget_plans_put_every_row_once_and_give_long_rows_their_own():
    lengths = [5, 60, 33, 12, 200, 7, 41, 18]
    plans = plan_packed_microbatches(lengths, 64)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for p in plans:
        assert sum(lengths[i] for i in p) <= 64 or len(p) == 1
    assert [4] in plans  # 200 tokens over a 64-token budget: alone
    # first-fit decreasing fills the budget: as few micro-batches as the total allows here
    assert len(plans) == 1 + -(-sum(n for n in lengths if n != 200) // 64)
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        plan_packed_microbatches(lengths, 0)


def test_packed_passes_give_the_padded_logprobs_and_entropies(tiny):
    model = load_causal_lm(tiny, dtype=torch.float32)
    use_packed_attention(model)
    rows = mixed_batch()[C.INPUT_IDS]
    x = pad_right(rows, 0, torch.long)
    am = pad_right([[1] * len(r) for r in rows], 0, torch.long)
    with torch.no_grad():
        lp, ent = token_logprobs(model, x, am, with_entropy=True)
        plp, pent = packed_token_logprobs(model, packed_layout(rows), len(rows), x.shape[1], with_entropy=True)
        for r, ids in enumerate(rows):  # each row alone, unpadded: the packed pass is bit-identical to it
            one_lp, one_ent = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids)), with_entropy=True)
            assert torch.equal(plp[r, : len(ids)], one_lp[0]) and torch.equal(pent[r, : len(ids)], one_ent[0])
        # a packed call that gives only the position ids (no boundaries) is split where they restart
        layout = packed_layout(rows)
        kwargs = packed_forward_kwargs(layout)
        with_bounds = model(**kwargs).logits
        plain = {k: kwargs[k] for k in ("input_ids", "position_ids", "use_cache")}
        assert torch.equal(model(**plain).logits, with_bounds)
    real = am.bool()
    real[:, 0] = False  # a row's first token has no prediction: 0 in both layouts
    torch.testing.assert_close(plp[real], lp[real], **TOL)
    torch.testing.assert_close(pent[real], ent[real], **TOL)
    assert not plp[~real].any() and not pent[~real].any()  # nothing leaks into the padding positions
    assert float(lp[real].abs().min()) > 0  # real log-probs, not zeros on both sides
    # micro-batched through the strategy's helper (a 120-token budget: several packed micro-batches)
    batch = mixed_batch()
    packed = batch_logprobs(model, batch, 120, torch.device("cpu"), packed=True)
    padded = batch_logprobs(model, batch, 120, torch.device("cpu"))
    assert len(plan_packed_microbatches([len(r) for r in rows], 120)) > 2
    for a, b, ids in zip(packed, padded, rows):
        assert len(a) == len(ids)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL)
    # the reference model (the KL term's) answers the same, packed (the trainer's train.packing) or padded
    ctx = WorkerContext(cluster="local", job_id="test", rank=0, world_size=1, pool=None, hardware="CPU")
    refs = [
        host_class(ReferenceWorker)(ctx, (), {"model": tiny, "max_tokens_per_microbatch": 120, "packing": p})
        for p in (True, False)
    ]
    assert [r.packing for r in refs] == [True, False]
    for a, b in zip(*(r.compute_logprobs(batch) for r in refs)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL)


def grads(worker) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in worker.module.named_parameters() if p.grad is not None}


def weights(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.module.named_parameters()}


LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
STEP_CASES = [
    pytest.param({"loss": "ppo", "entropy_coef": 0.01}, id="ppo+entropy"),
    pytest.param({"loss": "decoupled_ppo", "ppo_epochs": 2, "tis_cap": 2.0}, id="decoupled-2epochs-proximal"),
    pytest.param({"loss": "cispo", "loss_agg": "seq-mean-token-mean"}, id="cispo-seq-mean"),
    pytest.param({"loss": "ppo", "kl_coef": 0.1, "gradient_checkpointing": True}, id="kl+gradient-checkpointing"),
    pytest.param({"loss": "ppo", "lora": LORA}, id="lora"),
]


@pytest.mark.parametrize("case", STEP_CASES)
def test_packed_and_padded_steps_take_the_same_update(tiny, case):
    """One step (DDP's single-rank path) over a mixed batch with a 150-token budget: the same loss,
    entropy, gradients (within 1e-6) and updated weights, packed or padded."""
    # AdamW's first step moves a weight by lr * g / (|g| + eps): a gradient near 0 turns its last bits into
    # up to lr of difference, so lr stays small enough for the weights to be compared at 1e-6
    cfg = {"model": tiny, "lr": 1e-4, "max_tokens_per_microbatch": 150, "prefix_sharing": False, **case}
    if "lora" in case:
        pytest.importorskip("peft", reason="the lora extra is not installed (pip install 'rollart[lora]')")
    packed = local_worker(TorchTrainWorker, **cfg, packing=True)
    padded = local_worker(TorchTrainWorker, **cfg, packing=False)
    assert weights(packed).keys() == weights(padded).keys()
    for name, w in weights(packed).items():
        assert torch.equal(w, weights(padded)[name])
    batch = mixed_batch(seed=1)
    if "kl_coef" in case:  # the reference's log-probs (here: another model's, so the KL term is not 0)
        ref = load_causal_lm(tiny, dtype=torch.float32)
        torch.nn.init.normal_(ref.model.embed_tokens.weight, std=0.1)
        batch[C.REF_LOGPROBS] = batch_logprobs(ref, batch, 150, torch.device("cpu"))
    m_packed, m_padded = packed.train_step(batch), padded.train_step(batch)
    assert m_packed["packed"] == 1.0 and m_padded["packed"] == 0.0
    assert m_packed["microbatches"] > 1 and m_padded["microbatches"] > 1  # micro-batching active in both
    assert m_packed["microbatches"] < m_padded["microbatches"]  # the budget holds more rows without padding
    # (the "entropy" metric is a mean of micro-batch means: it follows the micro-batches' composition)
    for key in ("loss", "grad_norm", "rollout_abs_logprob_diff", "tokens"):
        assert m_packed[key] == pytest.approx(m_padded[key], abs=1e-6, rel=1e-6), key
    if "kl_coef" in case:
        assert m_packed["kl_ref"] > 1e-3  # the KL term is in the loss
    g_packed, g_padded = grads(packed), grads(padded)  # the last epoch's gradients
    assert g_packed.keys() == g_padded.keys() and g_packed
    for name, g in g_packed.items():
        torch.testing.assert_close(g, g_padded[name], atol=1e-6, rtol=0)
    assert max(float(g.abs().max()) for g in g_packed.values()) > 1e-3  # a real gradient
    moved = 0.0
    before = weights(local_worker(TorchTrainWorker, **cfg))
    for name, w in weights(packed).items():
        torch.testing.assert_close(w, weights(padded)[name], atol=1e-6, rtol=0)
        moved = max(moved, float((w - before[name]).abs().max()))
    assert moved > 5e-5  # the step changed the weights


def test_prefix_sharing_and_packing_take_the_step_with_fewer_positions(tiny):
    """Rows that share long prompts run the shared-prefix passes; rows that share nothing run packed;
    both give the padded step's weights."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 60, (40,), generator=g).tolist()
    n = 6
    shared_ids = [prompt + torch.randint(3, 60, (3 + i,), generator=g).tolist() for i in range(n)]
    batch = ra.Batch(
        {
            C.INPUT_IDS: shared_ids,
            C.LOSS_MASK: [[0] * 40 + [1] * (len(r) - 40) for r in shared_ids],
            C.ADVANTAGES: [[float((-1) ** i)] * len(r) for i, r in enumerate(shared_ids)],
            C.BEHAVIOUR_LOGPROBS: [[-4.0] * len(r) for r in shared_ids],
        }
    )
    cfg = {"model": tiny, "lr": 1e-3, "max_tokens_per_microbatch": 4096}
    both = local_worker(TorchTrainWorker, **cfg)  # packing (null: on for this model) and prefix sharing
    padded = local_worker(TorchTrainWorker, **cfg, packing=False, prefix_sharing=False)
    assert both.train_step(batch)["packed"] == 0.0  # 40 shared tokens once beat 6 x 40 packed
    padded.train_step(batch)
    for name, w in weights(both).items():
        torch.testing.assert_close(w, weights(padded)[name], atol=1e-6, rtol=0)
    assert both.train_step(mixed_batch())["packed"] == 1.0  # nothing shared: packed


def test_packing_is_refused_by_name_where_it_cannot_run(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"train\.packing .*strategy: torch"):
        TrainConfig(strategy="megatron", packing=True)
    assert TrainConfig(strategy="megatron").packing is None  # unasked: the megatron strategy trains padded
    # a model with sliding-window layers: refused when asked for, padded when not
    sliding = tmp_path / "sliding"
    build_tiny(sliding, hidden_size=32, num_layers=2, intermediate_size=64, seed=4)
    config = json.loads((sliding / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0, layer_types=None)
    (sliding / "config.json").write_text(json.dumps(config))
    raw = {
        "pools": {"train": {"hardware": "CPU", "cpus": 1}, "rollout": {"hardware": "CPU", "cpus": 1}},
        "envs": [{"name": "reverse", "groups": 8}],
        "model": str(sliding),
        "train": {"packing": True},
    }
    with pytest.raises(ConfigError, match=r"train\.packing: true: .*sliding-window.*set train\.packing: false"):
        validate_config(raw)  # read from config.json, before anything starts
    raw["model"] = tiny
    assert validate_config(raw).train.packing is True
    with pytest.raises(ValueError, match=r"train\.packing: true: .*sliding-window.*set train\.packing: false"):
        local_worker(TorchTrainWorker, model=str(sliding), packing=True)  # the trainer checks the loaded config
    worker = local_worker(TorchTrainWorker, model=str(sliding), max_tokens_per_microbatch=150)
    assert worker.train_step(mixed_batch())["packed"] == 0.0


def _rows_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Causal SDPA per row of ``[L, H, D]`` tensors (grouped-query: key/value heads repeated)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        for s, e in zip(cu[:-1], cu[1:])
    ]
    return torch.cat(parts)


def varlen_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None, scale=None):
    """``varlen_attn`` as PyTorch 2.11 spells it: ``is_causal``, no ``enable_gqa`` (heads must match)."""
    assert is_causal and key.shape[1] == query.shape[1], "a causal call with as many key heads as query heads"
    return _rows_sdpa(query, key, value, cu_seq_q.tolist())


def varlen_new(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """``varlen_attn`` as later releases spell it: ``window_size`` for causality, ``enable_gqa``."""
    assert tuple(window_size) == (-1, 0) and enable_gqa == (key.shape[1] != query.shape[1])
    return _rows_sdpa(query, key, value, cu_seq_q.tolist())


@pytest.mark.parametrize("varlen", [varlen_old, varlen_new], ids=["is_causal", "window_size+enable_gqa"])
def test_the_varlen_kernel_is_called_as_the_installed_pytorch_spells_it(varlen):
    # a grouped-query causal call (Qwen2's 14 query heads over 2 key/value heads, in small) through either
    # signature gives SDPA per row: on an H200 with PyTorch 2.11 the later spelling failed, and every packed
    # step fell back to one SDPA call per row (0.70x the padded step at 0.5B)
    from rollart.training.packing import _varlen_call

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(20, 6, 8, generator=g), torch.randn(20, 2, 8, generator=g), torch.randn(20, 2, 8, generator=g)
    cu = torch.tensor([0, 3, 11, 20], dtype=torch.int32)
    out = _varlen_call(varlen, q, k, v, cu, 9, 8**-0.5)
    torch.testing.assert_close(out, _rows_sdpa(q, k, v, [0, 3, 11, 20]))


def test_unasked_packing_on_a_gpu_needs_bf16_and_the_varlen_kernel(tiny, caplog):
    from rollart.training.packing import packing_on, varlen_problem

    assert varlen_problem(torch.device("cpu")) is None  # on the CPU the packed rows are SDPA per row anyway
    assert packing_on(None, tiny, torch.device("cpu")) is True
    # fp32 passes on a GPU would run SDPA per row, slower than the padded pass's flash kernel: padded, logged
    with caplog.at_level("INFO", logger="rollart.training.packing"):
        assert packing_on(None, tiny, torch.device("cuda"), compute_bf16=False) is False
    assert "training padded" in caplog.text and "train.dtype: fp32" in caplog.text
    with caplog.at_level("WARNING", logger="rollart.training.packing"):
        assert packing_on(True, tiny, torch.device("cuda"), compute_bf16=False) is True  # asked for: packed, warned
    assert "slower than the padded pass" in caplog.text
