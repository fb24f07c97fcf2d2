"""Shared-prefix training (rollart.training.shared_prefix): the rows of one prompt train on its tokens
once, with the same log-probs, entropies and gradients as whole-row passes, and a train step takes the
same update with far fewer positions run through the model."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import rollart as ra
from rollart.cluster.worker import WorkerContext, host_class
from rollart.models import build_tiny
from rollart.training import columns as C
from rollart.training.microbatch import pad_right
from rollart.training.shared_prefix import (
    SharedPrefixForward,
    plan_shared_microbatches,
    prefix_length,
    shared_layout,
    shared_token_logprobs,
)
from rollart.training.torch_strategy import TorchTrainWorker, token_logprobs

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared") / "tiny"
    return str(build_tiny(path, hidden_size=32, num_layers=2, intermediate_size=64, seed=1))


def grouped_rows(seed: int, groups: int = 5, multi_turn: bool = True) -> tuple[list[list[int]], list[list[int]]]:
    """Rows of ``groups`` prompts of different lengths, 1-4 samples each; multi-turn rows carry an
    observation (loss mask 0) between two actions."""
    rng = random.Random(seed)
    rows, masks = [], []
    for _ in range(groups):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(3, 9))]
        for _ in range(rng.randint(1, 4)):
            answer = [rng.randrange(3, 200) for _ in range(rng.randint(1, 6))]
            obs = [rng.randrange(3, 200) for _ in range(rng.randint(0, 3))] if multi_turn else []
            second = [rng.randrange(3, 200) for _ in range(rng.randint(1, 3))] if obs else []
            rows.append(prompt + answer + obs + second)
            masks.append([0] * len(prompt) + [1] * len(answer) + [0] * len(obs) + [1] * len(second))
    return rows, masks


def test_shared_passes_give_the_whole_row_logprobs_entropies_and_gradients(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    rows, masks = grouped_rows(0)
    lengths = [len(r) for r in rows]
    ids = pad_right(rows, 0, torch.long)
    attention = pad_right([[1] * n for n in lengths], 0, torch.long)
    loss_mask = pad_right(masks, 0, torch.float32)

    whole_lp, whole_ent = token_logprobs(model, ids, attention, with_entropy=True)
    (whole_lp * loss_mask).sum().backward()
    whole_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    layout = shared_layout(rows, [prefix_length(m, n) for m, n in zip(masks, lengths)])
    assert layout["prefix_ids"].shape[0] == 5 < len(rows)  # each prompt once
    lp, ent = shared_token_logprobs(SharedPrefixForward(model), layout, ids.shape[1], with_entropy=True)
    (lp * loss_mask).sum().backward()

    torch.testing.assert_close(lp * loss_mask, whole_lp * loss_mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent * loss_mask, whole_ent * loss_mask, atol=1e-5, rtol=0)
    for p, g in zip(model.parameters(), whole_grads):
        assert g.abs().sum() > 0
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)


def test_plan_keeps_each_prompt_together_counts_it_once_and_uses_every_row_once():
    rows, masks = grouped_rows(1, groups=8, multi_turn=False)
    prefix = [prefix_length(m, len(r)) for m, r in zip(masks, rows)]
    budget = 40
    plans = plan_shared_microbatches(rows, prefix, budget)
    assert sorted(i for plan in plans for i in plan) == list(range(len(rows)))
    for plan in plans:
        keys = {tuple(rows[i][: prefix[i]]) for i in plan}
        cost = len(keys) * max(prefix[i] for i in plan) + len(plan) * max(len(rows[i]) - prefix[i] for i in plan)
        assert cost <= budget or len(plan) == 1
    groups = {}
    for b, plan in enumerate(plans):
        for i in plan:
            groups.setdefault(tuple(rows[i][: prefix[i]]), set()).add(b)
    # a prompt's rows are split only where they do not fit one budget together
    assert sum(len(b) == 1 for b in groups.values()) >= len(groups) - 2


def test_a_train_step_with_prefix_sharing_takes_the_same_update(tiny):
    def worker(**config):
        ctx = WorkerContext(cluster="local", job_id="test", rank=0, world_size=1, pool=None, hardware="CPU")
        # padded whole rows against the shared-prefix passes (train.packing would lay these rows out in as
        # few positions as the shared passes, and a step takes whichever runs fewer)
        cfg = {"model": tiny, "lr": 1e-2, "packing": False, **config}
        return host_class(TorchTrainWorker)(ctx, (), {"config": cfg})

    rows, masks = grouped_rows(2, groups=6)
    g = torch.Generator().manual_seed(0)
    adv = [[float(torch.randn(1, generator=g))] * len(r) for r in rows]
    behaviour = [[-4.0 - float(torch.rand(1, generator=g)) if m else 0.0 for m in mask] for mask in masks]
    batch = ra.Batch({C.INPUT_IDS: rows, C.LOSS_MASK: masks, C.ADVANTAGES: adv, C.BEHAVIOUR_LOGPROBS: behaviour})

    shared, whole = worker(max_tokens_per_microbatch=64), worker(max_tokens_per_microbatch=64, prefix_sharing=False)
    positions = {id(shared): 0, id(whole): 0}
    for w in (shared, whole):  # positions run through the model (both passes of the shared forward)
        w.module.register_forward_hook(
            lambda mod, args, kwargs, out, w=w: positions.__setitem__(
                id(w), positions[id(w)] + kwargs["input_ids"].numel()
            ),
            with_kwargs=True,
        )
    m_shared, m_whole = shared.train_step(batch), whole.train_step(batch)
    # the gradients the optimiser stepped with (Adam's first step is about lr * sign(grad), so the
    # weights themselves would differ wherever a gradient entry is float noise around 0)
    for (name, p), q in zip(shared.module.named_parameters(), whole.module.parameters()):
        assert q.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)
    for key in ("entropy", "grad_norm", "rollout_abs_logprob_diff"):
        assert m_shared[key] == pytest.approx(m_whole[key], rel=1e-4), key
    assert m_shared["tokens"] == m_whole["tokens"] and m_shared["rows"] == m_whole["rows"] == len(rows)
    assert positions[id(shared)] < positions[id(whole)]
