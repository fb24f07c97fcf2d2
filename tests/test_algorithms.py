"""Policy losses and advantages against values computed by hand (formulas in rollart.algorithms)."""

import math

import pytest
import torch

from rollart.algorithms import (
    aggregate,
    gae,
    grpo_advantages,
    kl_penalty,
    loss_uses_proximal,
    policy_loss,
    reinforce_baseline_advantages,
    skip_observation_gae,
)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_ppo_clip_value_and_gradient_directions():
    # ratio = 0.5 / 0.4 = 1.25 > 1 + eps (1.2)
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    old = t([math.log(0.4)])
    mask = t([1.0])
    loss, m = policy_loss("ppo", lp, t([1.0]), mask, proximal_logprobs=old, eps=0.2)
    assert loss.item() == pytest.approx(-1.2)  # -min(1.25 * 1, 1.2 * 1)
    loss.backward()
    assert lp.grad.item() == 0.0  # clipped: no push further away from the old policy
    assert m["clip_frac"] == 1.0
    lp.grad = None
    loss, _ = policy_loss("ppo", lp, t([-1.0]), mask, proximal_logprobs=old, eps=0.2)
    assert loss.item() == pytest.approx(1.25)  # max(1.25, 1.2) for A = -1: the pessimistic side
    loss.backward()
    assert lp.grad.item() == pytest.approx(1.25)  # d/dlogp of r * 1 = r


def test_decoupled_ppo_centres_on_the_proximal_policy_and_reweights_the_behaviour_policy():
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    proximal, behaviour = t([math.log(0.4)]), t([math.log(0.2)])  # r = 1.25 (clipped to 1.2), w = 0.4/0.2 = 2
    loss, m = policy_loss(
        "decoupled_ppo", lp, t([1.0]), t([1.0]), proximal_logprobs=proximal, behaviour_logprobs=behaviour, eps=0.2
    )
    assert loss.item() == pytest.approx(-2.0 * 1.2) and m["behave_weight_mean"] == pytest.approx(2.0)
    assert m["ratio_mean"] == pytest.approx(1.25)  # ratio metrics against the proximal policy
    capped, _ = policy_loss(
        "decoupled_ppo",
        lp,
        t([1.0]),
        t([1.0]),
        proximal_logprobs=proximal,
        behaviour_logprobs=behaviour,
        eps=0.2,
        behave_cap=1.5,
    )
    assert capped.item() == pytest.approx(-1.5 * 1.2)


def test_tis_and_cispo_weights_carry_no_gradient():
    lp = torch.tensor([[math.log(0.9)]], dtype=torch.float64, requires_grad=True)
    old = t([math.log(0.3)])  # ratio 3
    loss, m = policy_loss("tis", lp, t([2.0]), t([1.0]), proximal_logprobs=old, cap=2.0)
    assert loss.item() == pytest.approx(-2.0 * 2.0 * math.log(0.9))  # -min(3, 2) * A * logp
    loss.backward()
    assert lp.grad.item() == pytest.approx(-4.0)  # only logp is differentiated: -w * A
    lp.grad = None
    loss, _ = policy_loss("cispo", lp, t([1.0]), t([1.0]), proximal_logprobs=old, eps_low=1.0, eps_high=0.28)
    loss.backward()
    assert lp.grad.item() == pytest.approx(-1.28)  # clip(3, 0, 1.28) = 1.28, stop-gradient


def test_dis_masks_tokens_outside_the_band_with_zero_gradient():
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    rollout = t([math.log(0.45), math.log(0.05)])  # rho = 1.11 (kept), 10 (masked)
    loss, m = policy_loss("dis", lp, t([1.0, 1.0]), t([1.0, 1.0]), behaviour_logprobs=rollout, low=0.5, high=2.0)
    loss.backward()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 0].item() == pytest.approx(-(0.5 / 0.45) / 2)
    assert m["mask_frac"] == pytest.approx(0.5)


def test_mismatch_tis_applies_to_any_loss():
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    old = t([math.log(0.5)])
    rollout = t([math.log(0.1)])  # old/rollout = 5, capped at 2
    base, _ = policy_loss("ppo", lp, t([1.0]), t([1.0]), proximal_logprobs=old)
    capped, m = policy_loss(
        "ppo", lp, t([1.0]), t([1.0]), proximal_logprobs=old, behaviour_logprobs=rollout, tis_cap=2.0
    )
    assert capped.item() == pytest.approx(2.0 * base.item()) and m["mismatch_is_mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="tis_cap=2.0.* needs behaviour_logprobs"):
        policy_loss("ppo", lp, t([1.0]), t([1.0]), proximal_logprobs=old, tis_cap=2.0)


def test_unknown_loss_and_parameters_are_clear_errors():
    x = t([0.0])
    with pytest.raises(ValueError, match="unknown policy loss 'pp0'"):
        policy_loss("pp0", x, x, x, proximal_logprobs=x)
    with pytest.raises(ValueError, match="epsilon"):
        policy_loss("ppo", x, x, x, proximal_logprobs=x, epsilon=0.1)
    with pytest.raises(ValueError, match="needs proximal_logprobs"):
        policy_loss("decoupled_ppo", x, x, x, behaviour_logprobs=x)
    with pytest.raises(ValueError, match="needs behaviour_logprobs"):
        policy_loss("decoupled_ppo", x, x, x, proximal_logprobs=x)
    with pytest.raises(ValueError, match="'dis'.* needs behaviour_logprobs"):
        policy_loss("dis", x, x, x, proximal_logprobs=x)  # DIS never falls back to the proximal policy
    with pytest.raises(ValueError, match="'ppo'.* needs proximal_logprobs"):
        policy_loss("ppo", x, x, x, behaviour_logprobs=x)
    assert loss_uses_proximal("ppo") and not loss_uses_proximal("dis")


def test_aggregation_modes():
    loss = t([1.0, 2.0, 3.0], [4.0, 0.0, 0.0])
    mask = t([1.0, 1.0, 1.0], [1.0, 0.0, 0.0])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "group-mean", torch.tensor([0, 1])).item() == pytest.approx((2 + 4) / 2)


def test_grpo_and_leave_one_out_baselines():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = grpo_advantages(r, g)
    # group 0: mean 0.5, std 0.5 -> +-1 ; group 1: all equal -> zeros, never NaN
    assert adv.tolist() == pytest.approx([1, -1, -1, 1, 0, 0], abs=1e-5)
    loo = reinforce_baseline_advantages(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0, 0, 0]))
    assert loo.tolist() == pytest.approx([1 - 1.0, 0 - 1.5, 2 - 0.5])


def test_gae_and_skip_observation_gae_by_hand():
    rewards = t([0.0, 0.0, 1.0])
    values = t([0.5, 0.25, 0.5])
    full = torch.ones(1, 3, dtype=torch.float64)
    adv, ret = gae(rewards, values, full, gamma=1.0, lam=0.5)
    # delta = [0 + .25 - .5, 0 + .5 - .25, 1 - .5] = [-.25, .25, .5]
    # A2 = .5 ; A1 = .25 + .5*.5 = .5 ; A0 = -.25 + .5*.5 = 0
    assert adv[0].tolist() == pytest.approx([0.0, 0.5, 0.5])
    assert ret[0].tolist() == pytest.approx([0.5, 0.75, 1.0])
    same, _ = skip_observation_gae(rewards, values, full, gamma=1.0, lam=0.5)
    assert torch.allclose(same, adv)
    # token 1 is an observation: the action at 0 links straight to the action at 2
    mask = t([1.0, 0.0, 1.0])
    skip, _ = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # delta0 = 0 + V2 - V0 = 0 ; A2 = .5 ; A0 = 0 + .5 * .5 = .25 ; observation token gets 0
    assert skip[0].tolist() == pytest.approx([0.25, 0.0, 0.5])


def test_kl_estimators():
    lp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    lr = math.log(2)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(lr)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * lr * lr)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + lr)
