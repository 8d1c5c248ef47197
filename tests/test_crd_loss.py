"""crd.py's loss, advantages and EMA schedules against plain float64 references."""

import pytest
import torch

import crd
from crd import crd_loss, ema_decay, group_advantages
import lora_adapters
import rollout
import sd3

G = 4


def reference_crd_loss(v_theta, v_old, v_ref, u, adv, group_size, c=5.0, beta=1.0, kl_beta=0.1, kl_floor=1e-4):
    """SPEC §4 written out sample by sample in float64."""
    v_theta, v_old, v_ref, u, adv = (x.double() for x in (v_theta, v_old, v_ref, u, adv))
    n = len(adv)
    r, a, kl = [], [], []
    for i in range(n):
        w_theta = max(float((v_theta[i] - u[i]).abs().mean()), 1e-5)
        w_old = max(float((v_old[i] - u[i]).abs().mean()), 1e-5)
        r.append(float((-(v_theta[i] - u[i]) ** 2 / w_theta + (v_old[i] - u[i]) ** 2 / w_old).mean()))
        a.append(min(max(float(adv[i]), -c), c) / (2 * c) + 0.5)
        kl.append(float(((v_theta[i] - v_ref[i]) ** 2).mean()))
    policy, kl_term = 0.0, 0.0
    for i in range(n):
        g = range(i // group_size * group_size, (i // group_size + 1) * group_size)
        dr = r[i] - sum(r[j] for j in g) / group_size
        da = a[i] - sum(a[j] for j in g) / group_size
        policy += (c / beta) * (beta * dr - da) ** 2 / n
        kl_term += (kl_floor + a[i] * (kl_beta - kl_floor)) * kl[i] / n
    return policy + kl_term


def random_inputs(n_groups=3, seed=0, shape=(2, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    n = n_groups * G
    u = torch.randn(n, *shape, generator=g)
    v_old = u + 0.3 * torch.randn(n, *shape, generator=g)
    v_theta = v_old + 0.1 * torch.randn(n, *shape, generator=g)
    v_ref = u + 0.5 * torch.randn(n, *shape, generator=g)
    adv = 3 * torch.randn(n, generator=g)
    return v_theta, v_old, v_ref, u, adv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kwargs", [{}, {"adv_clip": 2.0, "beta": 0.5, "kl_beta": 0.3, "kl_floor": 0.01}])
def test_matches_float64_reference(seed, kwargs):
    inputs = random_inputs(seed=seed)
    loss, info = crd_loss(*inputs, G, **kwargs)
    ref_kwargs = {"c": kwargs.get("adv_clip", 5.0), **{k: v for k, v in kwargs.items() if k != "adv_clip"}}
    expected = reference_crd_loss(*inputs, G, **ref_kwargs)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected, rel=1e-5)
    assert (info["policy_loss"] + info["kl_loss"]).item() == pytest.approx(loss.item(), rel=1e-6)


def test_gradient_matches_float64_reference():
    v_theta, v_old, v_ref, u, adv = random_inputs(seed=3)
    ours = v_theta.clone().requires_grad_()
    crd_loss(ours, v_old, v_ref, u, adv, G)[0].backward()
    # Reference gradient: autograd through the float64 reference with the adaptive weight w_theta and the
    # group mean of r held fixed, which is exactly the stop-gradient of SPEC §4.
    theirs = v_theta.double().clone().requires_grad_()
    w = (theirs - u).abs().mean((1, 2, 3), keepdim=True).clamp_min(1e-5).detach()
    w_old = (v_old.double() - u).abs().mean((1, 2, 3), keepdim=True).clamp_min(1e-5)
    r = (-(theirs - u) ** 2 / w + (v_old.double() - u) ** 2 / w_old).mean((1, 2, 3)).view(-1, G)
    a = (adv.double().clamp(-5, 5) / 10 + 0.5).view(-1, G)
    policy = 5 * ((r - r.mean(1, keepdim=True).detach()) - (a - a.mean(1, keepdim=True))).pow(2).mean()
    kl = ((1e-4 + a.flatten() * (0.1 - 1e-4)) * (theirs - v_ref.double()).pow(2).mean((1, 2, 3))).mean()
    (policy + kl).backward()
    torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-9)


def test_invariant_to_a_constant_added_to_a_groups_rewards():
    v_theta, v_old, v_ref, u, _ = random_inputs(seed=4)
    rewards = torch.rand(3 * G)
    per_group = torch.tensor([0.3, -2.0, 7.0]).repeat_interleave(G)
    loss = lambda r, global_std: crd_loss(v_theta, v_old, v_ref, u, group_advantages(r, G, global_std), G)[0]
    # per-group std: any constant per group cancels; global std: a constant shared by all groups cancels
    torch.testing.assert_close(loss(rewards + per_group, False), loss(rewards, False))
    torch.testing.assert_close(loss(rewards + 0.7, True), loss(rewards, True))
    assert not torch.allclose(loss(rewards.roll(1), False), loss(rewards, False))


def test_policy_loss_invariant_to_a_constant_added_to_a_groups_advantages():
    v_theta, v_old, v_ref, u, adv = random_inputs(seed=8)
    adv = adv.clamp(-3, 3)
    shifted = adv + torch.tensor([1.0, -1.5, 0.5]).repeat_interleave(G)  # stays inside the clip range
    base = crd_loss(v_theta, v_old, v_ref, u, adv, G)[1]["policy_loss"]
    torch.testing.assert_close(crd_loss(v_theta, v_old, v_ref, u, shifted, G)[1]["policy_loss"], base)


def test_policy_loss_invariant_to_a_constant_added_to_a_groups_implicit_rewards():
    v_theta, v_old, v_ref, u, adv = random_inputs(seed=5)
    # Scaling the old error of image i by s_i scales its old term m_i = mean((v_old-u)^2)/w_old by s_i, so
    # s_i = (m_i + k_g) / m_i adds the constant k_g to the implicit reward of every image of group g.
    old_error = v_old - u
    m = (old_error**2).mean((1, 2, 3)) / old_error.abs().mean((1, 2, 3))
    k = torch.tensor([0.5, 1.5, 3.0]).repeat_interleave(G)
    shifted_old = u + old_error * ((m + k) / m).view(-1, 1, 1, 1)
    base = crd_loss(v_theta, v_old, v_ref, u, adv, G)[1]["policy_loss"]
    shifted = crd_loss(v_theta, shifted_old, v_ref, u, adv, G)[1]["policy_loss"]
    assert base.item() > 1e-4 and shifted.item() == pytest.approx(base.item(), rel=1e-4)
    # a shift that is not constant within a group does change it
    uneven_old = u + old_error * ((m + k.roll(1)) / m).view(-1, 1, 1, 1)
    assert crd_loss(v_theta, uneven_old, v_ref, u, adv, G)[1]["policy_loss"].item() != pytest.approx(base.item(), rel=1e-3)


def test_zero_advantages_and_identical_old_policy_give_zero_policy_loss():
    v_theta, _, v_ref, u, _ = random_inputs(seed=6)
    loss, info = crd_loss(v_theta, v_theta.clone(), v_ref, u, torch.zeros(len(u)), G)
    assert info["policy_loss"].item() == pytest.approx(0.0, abs=1e-10)
    assert info["kl_loss"].item() > 0  # the anchor remains
    same_in_group = torch.tensor([1.0, -3.0, 0.5]).repeat_interleave(G)  # constant within each group: nothing to learn
    assert crd_loss(v_theta, v_theta.clone(), v_ref, u, same_in_group, G)[1]["policy_loss"].item() == pytest.approx(0, abs=1e-10)


def test_kl_weight_follows_the_advantage():
    v_theta, v_old, v_ref, u, _ = random_inputs(n_groups=1, seed=7)
    high = crd_loss(v_theta, v_old, v_ref, u, torch.full((G,), 5.0), G)[1]["kl_loss"]
    low = crd_loss(v_theta, v_old, v_ref, u, torch.full((G,), -5.0), G)[1]["kl_loss"]
    kl = (v_theta - v_ref).pow(2).mean()
    assert high.item() == pytest.approx(0.1 * kl.item(), rel=1e-5) and low.item() == pytest.approx(1e-4 * kl.item(), rel=1e-5)


def test_group_advantages_reference():
    rewards = torch.tensor([0.1, 0.5, 0.9, 0.9, 0.0, 0.0, 1.0, 0.2], dtype=torch.float64)
    std = rewards.numpy().std()
    expected = [(r - rewards[i // G * G : i // G * G + G].mean()) / (std + 1e-4) for i, r in enumerate(rewards)]
    torch.testing.assert_close(group_advantages(rewards, G), torch.stack(expected).clamp(-5, 5))
    assert group_advantages(torch.tensor([0.0, 0, 0, 1]), G, clip=1.0).max() == 1.0


@pytest.mark.parametrize("step, expected", [(0, 0.25), (10, 0.30), (100, 0.75), (150, 0.999), (10_000, 0.999)])
def test_old_adapter_schedule(step, expected):
    assert ema_decay(step, 0, 0.25, 0.005, 0.999) == pytest.approx(expected)


@pytest.mark.parametrize("step, expected", [(0, 0.0), (74, 0.0), (75, 0.0), (76, 0.0075), (175, 0.75), (300, 0.999)])
def test_sampling_adapter_schedule(step, expected):
    assert ema_decay(step, 75, 0.0, 0.0075, 0.999) == pytest.approx(expected)


def test_decay_before_the_start_is_the_initial_decay():
    """As Flow-Factory's compute_decay: the initial value holds until the start step, then the ramp begins there."""
    assert [ema_decay(k, 10, 0.4, 0.01, 0.9) for k in (0, 9, 10, 11, 1000)] == pytest.approx([0.4, 0.4, 0.4, 0.41, 0.9])


def paper_decay(k, start, initial, slope, maximum):
    """The schedule of the paper's Table 3 written out: flat at `initial` until `start`, then a capped linear ramp."""
    if k < start:
        return initial
    return min(initial + slope * (k - start), maximum)


@pytest.fixture
def lora_transformer(tiny_model_dir):
    """The tiny transformer with its three adapters, the policy moved away from the other two."""
    transformer = sd3.load_pipeline(str(tiny_model_dir)).transformer
    lora_adapters.add_lora_adapters(transformer, 4, 4)
    with torch.no_grad():
        for p in lora_adapters.lora_parameters(transformer, "policy"):
            p.add_(1.0)
    return transformer


@pytest.mark.parametrize("iteration", [1, 19, 38, 53, 75, 100])
def test_snapshot_decays_are_the_papers_schedules_at_two_steps_per_iteration(lora_transformer, iteration):
    """The update the loop makes after an iteration, given the recipe's 4 optimizer steps per iteration: each adapter
    blends toward the policy with its schedule evaluated at k = 2 x iterations done, the paper's step count."""
    args = crd.Args()
    before = {name: [p.clone() for p in lora_adapters.lora_parameters(lora_transformer, name)] for name in ("old", "sampling")}
    decays = crd.snapshots_after_iteration(lora_transformer, args, iteration, 4 * iteration)
    expected = {"old": paper_decay(2 * iteration, 0, 0.25, 0.005, 0.999),
                "sampling": paper_decay(2 * iteration, 75, 0.0, 0.0075, 0.999)}
    assert decays == pytest.approx(expected, abs=1e-12)
    policy = lora_adapters.lora_parameters(lora_transformer, "policy")
    for name, decay in expected.items():
        for now, then, p in zip(lora_adapters.lora_parameters(lora_transformer, name), before[name], policy):
            torch.testing.assert_close(now, decay * then + (1 - decay) * p)


def test_schedule_milestones_in_iterations():
    """The calibration the issue names: the sampling adapter copies the policy through iteration 37 and ramps from
    38 on; the old adapter reaches 0.999 at iteration 75, the sampling adapter at 105."""
    args = crd.Args()
    k = {n: 2 * n for n in range(1, 120)}
    sampling = [n for n in k if ema_decay(k[n], *args.sampling_decay) > 0]
    assert sampling[0] == 38
    assert min(n for n in k if ema_decay(k[n], *args.old_decay) >= 0.999) == 75
    assert min(n for n in k if ema_decay(k[n], *args.sampling_decay) >= 0.999) == 105


def test_snapshot_decays_can_count_optimizer_steps(lora_transformer):
    args = crd.Args(ema_counts_optimizer_steps=True)
    decays = crd.snapshots_after_iteration(lora_transformer, args, 25, 100)
    assert decays == pytest.approx({"old": paper_decay(100, 0, 0.25, 0.005, 0.999),
                                    "sampling": paper_decay(100, 75, 0.0, 0.0075, 0.999)})


def test_gradients_reach_only_the_policy_lora(tiny_model_dir):
    """The three velocities of crd.py's training step on the tiny transformer: only policy LoRA tensors get gradients."""
    pipe = sd3.load_pipeline(str(tiny_model_dir))
    transformer = pipe.transformer
    lora_adapters.add_lora_adapters(transformer, 4, 8)
    with torch.no_grad():  # make the adapters differ from the base and from each other
        for name, scale in (("policy", 0.1), ("old", 0.05)):
            for p in lora_adapters.lora_parameters(transformer, name):
                p.add_(scale * torch.randn_like(p))
    embeds, pooled = sd3.encode_prompts(pipe, ['a "cat"'] * G)
    negative = sd3.negative_embeddings(pipe)
    noisy, target = torch.randn(G, 16, 8, 8), torch.randn(G, 16, 8, 8)
    with torch.no_grad():
        with lora_adapters.use_adapter(transformer, "old"):
            v_old = rollout.predict_velocity(transformer, noisy, 700.0, embeds, pooled)
        with lora_adapters.use_adapter(transformer, None):
            v_ref = rollout.predict_velocity(transformer, noisy, 700.0, embeds, pooled, 4.5, *negative)
    with lora_adapters.use_adapter(transformer, "policy"):
        v_theta = rollout.predict_velocity(transformer, noisy, 700.0, embeds, pooled)
    crd_loss(v_theta, v_old, v_ref, target, torch.tensor([2.0, -1.0, 0.5, -1.5]), G)[0].backward()
    policy = {id(p) for p in lora_adapters.lora_parameters(transformer, "policy")}
    with_grad = [n for n, p in transformer.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert with_grad and all(id(dict(transformer.named_parameters())[n]) in policy for n in with_grad)
    assert len(with_grad) >= len(policy) - 2  # all but the LoRA pair whose output SD3's last block discards
    assert not any(p.requires_grad for n, p in transformer.named_parameters() if id(p) not in policy)


def test_micro_batch_rows_are_timestep_major_within_each_micro_batch():
    from crd import micro_batch_rows

    T, B, b = 3, 4, 2
    per_image = 10 * torch.arange(T).view(T, 1) + torch.arange(B)  # (T, B): 10 k + image
    expected = [10 * k + m * b + j for m in range(B // b) for k in range(T) for j in range(b)]
    assert micro_batch_rows(per_image, b).tolist() == expected
    latents = torch.randn(T, B, 2, 3)
    assert torch.equal(micro_batch_rows(latents, b)[(1 * T + 2) * b + 1], latents[2, 1 * b + 1])


@pytest.mark.parametrize("trainer, every_step", [("crd", False), ("dgpo", True), ("nft", False)])
def test_snapshots_move_the_old_adapter_when_the_trainer_says(trainer, every_step, tiny_model_dir):
    """The trainers run the old adapter's passes before the reward arrives as long as it cannot
    have moved: a whole iteration for CRD and DiffusionNFT (old moves once an iteration), until the
    first optimizer step for DGPO (after every step). OLD_MOVES_EVERY_STEP says which hook moves it."""
    import importlib

    module = importlib.import_module(trainer)
    assert module.OLD_MOVES_EVERY_STEP is every_step
    args = module.Args()
    transformer = sd3.load_pipeline(str(tiny_model_dir)).transformer
    lora_adapters.add_lora_adapters(transformer, 4, 4)
    with torch.no_grad():
        for p in lora_adapters.lora_parameters(transformer, "policy"):
            p.add_(1.0)
    old = lora_adapters.lora_parameters(transformer, "old")
    before = [p.clone() for p in old]
    module.snapshots_after_step(transformer, args, 100)
    assert every_step is not all(torch.equal(o, b) for o, b in zip(old, before))
    before = [p.clone() for p in old]
    module.snapshots_after_iteration(transformer, args, 50, 100)
    assert every_step is all(torch.equal(o, b) for o, b in zip(old, before))
