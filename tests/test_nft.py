"""nft.py's loss against a float64 reference written in x0 space as the authors' code is, its
invariances, and its snapshot schedule (the run-level tests are tests/test_trainers.py's)."""

import pytest
import torch

import lora_adapters
import nft
from nft import Args, check_args, ema_decay, eval_ema_decay, nft_loss
import sd3

B, C, H, W = 6, 4, 3, 5


def batch(seed=0, dtype=torch.float64):
    """A clean latent, noise and timesteps, the path point x_t, and three velocities."""
    g = torch.Generator().manual_seed(seed)
    x0, noise = torch.randn(2, B, C, H, W, generator=g, dtype=dtype)
    sigma = torch.rand(B, generator=g, dtype=dtype) * 0.9 + 0.05
    v_theta, v_old, v_ref = torch.randn(3, B, C, H, W, generator=g, dtype=dtype)
    advantages = torch.randn(B, generator=g, dtype=dtype) * 3
    return x0, noise, sigma, v_theta, v_old, v_ref, advantages


def reference_loss(x0, noise, sigma, v_theta, v_old, v_ref, advantages, c, beta, kl_beta):
    """The loss as the authors write it, in float64: x0 predictions of the implicit policies from
    the noisy latent, their errors against the clean one, the adaptive weights."""
    t = sigma.view(-1, 1, 1, 1)
    x_t = (1 - t) * x0 + t * noise
    r = (advantages.clamp(-c, c) / c / 2 + 0.5).clamp(0, 1)
    positive = beta * v_theta + (1 - beta) * v_old
    negative = (1 + beta) * v_old - beta * v_theta
    terms = []
    for v in (positive, negative):
        x0_prediction = x_t - t * v
        weight = (x0_prediction - x0).detach().abs().mean((1, 2, 3), keepdim=True).clip(min=1e-5)
        terms.append(((x0_prediction - x0) ** 2 / weight).mean((1, 2, 3)))
    policy = (c * (r * terms[0] / beta + (1 - r) * terms[1] / beta)).mean()
    return policy + kl_beta * ((v_theta - v_ref) ** 2).mean((1, 2, 3)).mean()


@pytest.mark.parametrize("beta, kl_beta", [(0.1, 1e-4), (1.0, 0.0), (0.02, 0.5)])
def test_loss_and_gradient_match_the_float64_reference(beta, kl_beta):
    x0, noise, sigma, v_theta, v_old, v_ref, advantages = batch()
    mine = v_theta.clone().requires_grad_()
    theirs = v_theta.clone().requires_grad_()
    loss, info = nft_loss(mine, v_old, v_ref, noise - x0, sigma, advantages, 5.0, beta, kl_beta)
    expected = reference_loss(x0, noise, sigma, theirs, v_old, v_ref, advantages, 5.0, beta, kl_beta)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-9)
    kl = ((v_theta - v_ref) ** 2).mean()
    torch.testing.assert_close(info["kl"].double(), kl, rtol=1e-5, atol=0)
    torch.testing.assert_close(info["policy_loss"] + info["kl_loss"], loss.detach())


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0])
def test_at_the_old_adapter_the_gradient_is_2r_minus_1_times_weighted_flow_matching(beta):
    """Where the policy equals the old adapter, v+ = v- = v_old, so the two weights agree and the
    gradient is (2r - 1) times that of the adaptively weighted x0-space regression, whatever beta:
    r = 1 regresses toward the data, r = 0 away from it, r = 1/2 (A = 0) not at all."""
    x0, noise, sigma, _, v_old, v_ref, _ = batch(1)
    advantages = torch.tensor([-9.0, -5.0, -2.5, 0.0, 2.5, 5.0])  # r = 0, 0, 1/4, 1/2, 3/4, 1
    policy = v_old.clone().requires_grad_()
    nft_loss(policy, v_old, v_ref, noise - x0, sigma, advantages, 5.0, beta, 0.0)[0].backward()
    regressed = v_old.clone().requires_grad_()
    error = sigma.view(-1, 1, 1, 1) * (noise - x0 - regressed)  # x0 prediction minus x0
    weight = error.detach().abs().mean((1, 2, 3), keepdim=True)
    (5.0 * (error ** 2 / weight).mean((1, 2, 3))).mean().backward()
    two_r_minus_1 = torch.tensor([-1.0, -1.0, -0.5, 0.0, 0.5, 1.0]).view(-1, 1, 1, 1)
    torch.testing.assert_close(policy.grad, two_r_minus_1 * regressed.grad, rtol=1e-4, atol=1e-9)
    assert policy.grad[3].abs().max() == 0  # a neutral image teaches exactly nothing


def test_the_policy_term_scales_with_beta_as_the_paper_says():
    """Away from the old adapter the positive and negative terms no longer cancel: for A = 0 the
    policy gradient is of order beta (a trust region around old), zero at beta -> 0."""
    x0, noise, sigma, v_theta, v_old, v_ref, _ = batch(2)
    advantages = torch.zeros(B)
    norms = []
    for beta in (1e-1, 1e-2, 1e-3):
        policy = v_theta.clone().requires_grad_()
        nft_loss(policy, v_old, v_ref, noise - x0, sigma, advantages, 5.0, beta, 0.0)[0].backward()
        norms.append(policy.grad.norm().item())
    assert norms[1] / norms[0] == pytest.approx(0.1, rel=0.05)
    assert norms[2] / norms[1] == pytest.approx(0.1, rel=0.05)


def test_schedules_are_the_authors():
    """The old adapter's decay type 2: 0 before 75 optimizer steps, then 0.0075 a step up to 0.999;
    the validation EMA's decay min((1 + k) / (10 + k), 0.9)."""
    start, slope, maximum = Args().old_decay
    assert [ema_decay(k, start, slope, maximum) for k in (0, 74, 75, 76, 175, 300)] == \
        pytest.approx([0.0, 0.0, 0.0, 0.0075, 0.75, 0.999])
    assert [eval_ema_decay(k, 0.9) for k in (0, 1, 10, 80, 500)] == \
        pytest.approx([0.1, 2 / 11, 11 / 20, 0.9, 0.9])
    assert nft.ROLLOUT_ADAPTER == "old" and nft.OLD_MOVES_EVERY_STEP is False


def test_snapshots_move_the_sampling_ema_each_step_and_old_each_iteration(tiny_model_dir):
    transformer = sd3.load_pipeline(str(tiny_model_dir)).transformer
    lora_adapters.add_lora_adapters(transformer, 4, 4)
    policy, old, sampling = (lora_adapters.lora_parameters(transformer, n)
                             for n in ("policy", "old", "sampling"))
    with torch.no_grad():
        for p in policy:
            p.add_(1.0)
    before = {"old": [o.clone() for o in old], "sampling": [s.clone() for s in sampling]}
    args = Args()
    assert nft.snapshots_after_step(transformer, args, 1) == {"sampling": pytest.approx(2 / 11)}
    for s, b, p in zip(sampling, before["sampling"], policy):
        torch.testing.assert_close(s, 2 / 11 * b + 9 / 11 * p)
    assert all(torch.equal(o, b) for o, b in zip(old, before["old"]))  # old waits for the iteration
    assert nft.snapshots_after_iteration(transformer, args, 1, 2) == {"old": 0.0}
    assert all(torch.equal(o, p) for o, p in zip(old, policy))  # decay 0: a copy
    with torch.no_grad():
        for p in policy:
            p.add_(1.0)
    expected = [0.1875 * o + 0.8125 * p for o, p in zip(old, policy)]
    assert nft.snapshots_after_iteration(transformer, args, 50, 100) == \
        {"old": pytest.approx(0.1875)}
    for o, e in zip(old, expected):
        torch.testing.assert_close(o, e)


@pytest.mark.parametrize("flags, message", [
    (dict(nft_beta=0.0), "--nft-beta 0: must be a finite number > 0"),
    (dict(kl_beta=-1e-4), "--kl-beta -0.0001: must be a finite number >= 0"),
    (dict(kl_cfg=0.5), "--kl-cfg 0.5: must be a finite number >= 1"),
    (dict(old_decay=(75, 0.0075, 1.5)), "--old-decay 75 0.0075 1.5: needs a slope >= 0 and a max"),
    (dict(eval_ema_decay=1.1), "--eval-ema-decay 1.1: must lie in [0, 1]"),
    (dict(num_train_timesteps=11), "--num-train-timesteps 11 must lie in [1, 10]"),
])
def test_bad_settings_are_named(flags, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("+", r"\+")):
        check_args(Args(train_batch_size=6, **flags))
