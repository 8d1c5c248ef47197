"""dgpo.py's loss and EMA schedule, and the rule that dgpo.py stays a sibling copy of crd.py."""

import difflib
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import crd
from dgpo import Args, check_args, dgpo_loss, ema_decay, snapshots_after_step, train_timestep_grid
import lora_adapters
import sd3
import zygote

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data" / "ocr"
TINY_RUN = ["--model", "tiny", "--reward", "brightness", "--device", "cpu", "--train-data", str(DATA / "train.txt"),
            "--eval-data", str(DATA / "test.txt"), "--resolution", "64", "--prompts-per-rank", "2", "--group-size", "4",
            "--num-iterations", "1", "--eval-every", "0", "--run-name", "run", "--max-sequence-length", "96"]
G = 4


def reference_dgpo_loss(v_theta, v_old, v_ref, u, adv, group_size, beta=100.0, eps=1e-3, kl_coef=0.02):
    """SPEC §5 written out sample by sample in float64 (the value; stop-gradients do not change it)."""
    v_theta, v_old, v_ref, u, adv = (x.double() for x in (v_theta, v_old, v_ref, u, adv))
    n = len(adv)
    d = [float(((u[i] - v_theta[i]) ** 2).mean()) for i in range(n)]
    d_ref = [float(((u[i] - v_ref[i]) ** 2).mean()) for i in range(n)]
    total = 0.0
    for i in range(n):
        g = range(i // group_size * group_size, (i // group_size + 1) * group_size)
        s = beta / group_size * sum(float(adv[j]) * (d[j] - d_ref[j]) for j in g)
        total += 1 / (1 + torch.exp(torch.tensor(-s)).item()) * float(adv[i]) * d[i] / n
        total += kl_coef * float(((v_theta[i] - v_ref[i]) ** 2).mean()) / n
    return total


def random_inputs(n_groups=3, seed=0, shape=(2, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    n = n_groups * G
    u = torch.randn(n, *shape, generator=g)
    v_ref = u + 0.5 * torch.randn(n, *shape, generator=g)
    v_theta = v_ref + 0.02 * torch.randn(n, *shape, generator=g)  # near the reference, so the sigmoids are not saturated
    v_old = v_theta + 0.05 * torch.randn(n, *shape, generator=g)
    adv = torch.randn(n, generator=g)
    return v_theta, v_old, v_ref, u, adv - adv.view(-1, G).mean(1).repeat_interleave(G)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference(seed):
    inputs = random_inputs(seed=seed)
    loss, _ = dgpo_loss(*inputs, G)
    assert loss.item() == pytest.approx(reference_dgpo_loss(*inputs, G), rel=1e-5, abs=1e-7)
    loss, _ = dgpo_loss(*inputs, G, beta_dpo=7.0, clip_range=0.2, ref_kl_coef=0.5)
    assert loss.item() == pytest.approx(reference_dgpo_loss(*inputs, G, 7.0, 0.2, 0.5), rel=1e-5, abs=1e-7)


def test_gradient_is_the_papers_group_preference_gradient_up_to_scale():
    v_theta, _, v_ref, u, adv = random_inputs(seed=3)
    beta = 100.0
    ours = v_theta.clone().requires_grad_()
    dgpo_loss(ours, ours.detach(), v_ref, u, adv, G, beta_dpo=beta, ref_kl_coef=0.0)[0].backward()  # ratio 1: no clip
    theirs = v_theta.double().clone().requires_grad_()
    d = ((u.double() - theirs) ** 2).mean((1, 2, 3))
    d_ref = ((u.double() - v_ref.double()) ** 2).mean((1, 2, 3))
    score = (adv.double() * (d - d_ref)).view(-1, G).sum(1)  # S_g = sum_g A_i (d_i - d_ref_i)
    (-torch.nn.functional.logsigmoid(-(beta / G) * score)).sum().backward()  # the paper's -log sigmoid(-beta' S_g)
    scale = len(adv) * beta / G  # ours averages over the B images and leaves beta' out of the gradient
    torch.testing.assert_close(ours.grad.double() * scale, theirs.grad, rtol=1e-4, atol=1e-10)
    assert theirs.grad.abs().max() > 1e-6


def test_clip_masks_exactly_the_specified_samples():
    v_theta, _, v_ref, u, _ = random_inputs(n_groups=2, seed=4)
    eps = 0.01
    d = ((u - v_theta) ** 2).mean((1, 2, 3))
    # choose the old error so that log ratio = d_old - d takes these values
    log_ratio = torch.tensor([0.05, -0.05, 0.005, -0.005, 0.05, -0.05, 0.0, 0.02])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0])
    clipped = torch.tensor([True, False, False, False, False, True, False, False])  # A>0 & rho>1+eps | A<=0 & rho<1-eps
    v_old = u + (v_theta - u) * ((d + log_ratio) / d).sqrt().view(-1, 1, 1, 1)
    theta = v_theta.clone().requires_grad_()
    loss, info = dgpo_loss(theta, v_old, v_ref, u, adv, G, clip_range=eps, ref_kl_coef=0.0)
    loss.backward()
    trained = theta.grad.flatten(1).abs().amax(1) > 0
    assert torch.equal(~trained[adv != 0], clipped[adv != 0])
    assert info["clip_frac"].item() == pytest.approx(clipped.float().mean().item())


def test_old_adapter_ema_per_step_and_sampling_switch(tiny_model_dir):
    """Official train_sd3_dgpo.py: after optimizer step s + 1 the old EMA uses decay min(0.3, 0.001 s), s counted
    before its increment; rollouts switch to the old EMA once more than switch_ema_ref (200) steps are done."""
    transformer = sd3.load_pipeline(str(tiny_model_dir)).transformer
    lora_adapters.add_lora_adapters(transformer, 4, 4)
    assert [ema_decay(s, 0.001, 0.3) for s in (0, 100, 250, 300, 5000)] == pytest.approx([0, 0.1, 0.25, 0.3, 0.3])
    args = Args()
    policy, old, sampling = (lora_adapters.lora_parameters(transformer, n) for n in ("policy", "old", "sampling"))

    def move_apart():
        with torch.no_grad():
            for p, o in zip(policy, old):
                p.add_(1.0), o.sub_(1.0)

    move_apart()
    snapshots_after_step(transformer, args, 1)  # the first step: decay 0, an exact copy
    assert all(torch.equal(o, p) for o, p in zip(old, policy))
    move_apart()
    expected_old = [0.1 * o + 0.9 * p for o, p in zip(old, policy)]
    assert snapshots_after_step(transformer, args, 101) == {"old": pytest.approx(0.1), "sampling": 0.0}
    for o, e in zip(old, expected_old):
        torch.testing.assert_close(o, e)  # lerp and the written-out blend round differently near zero
    assert all(torch.equal(s, p) for s, p in zip(sampling, policy))  # before the switch: rollouts use the policy
    move_apart()
    snapshots_after_step(transformer, args, 200)
    assert all(torch.equal(s, p) for s, p in zip(sampling, policy))  # 200 steps done: still the policy
    snapshots_after_step(transformer, args, 201)
    assert all(torch.equal(s, o) for s, o in zip(sampling, old))  # from the 201st on: the old adapter
    assert not all(torch.equal(s, p) for s, p in zip(sampling, policy))


def algorithm_lines(path):
    """Indices of the lines of a trainer that may differ between crd.py and a sibling: the module docstring, the
    algorithm Args, the loss and EMA functions, and the loss call."""
    lines = Path(path).read_text().splitlines()
    allowed = set(range(next(i for i, l in enumerate(lines) if l.startswith("import "))))
    start = next(i for i, l in enumerate(lines) if l.startswith("    # Algorithm: "))
    allowed |= set(range(start, next(i for i, l in enumerate(lines) if l.startswith("# ALGO LOGIC: the loss"))))
    start = next(i for i, l in enumerate(lines) if l.startswith("# ALGO LOGIC: the loss"))
    allowed |= set(range(start, next(i for i, l in enumerate(lines) if l.startswith("def group_advantages"))))
    call = next(i for i, l in enumerate(lines) if re.match(r"\s+loss, info = \w+_loss\(", l))
    allowed |= set(range(call, next(i for i in range(call, len(lines)) if lines[i].rstrip().endswith(")")) + 1))
    return lines, allowed


@pytest.mark.parametrize("sibling", ["dgpo.py", "nft.py"])
def test_a_sibling_differs_from_crd_only_in_docstring_algorithm_args_loss_and_ema(sibling):
    crd_lines, crd_allowed = algorithm_lines(ROOT / "crd.py")
    lines, allowed = algorithm_lines(ROOT / sibling)
    drift = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, crd_lines, lines, autojunk=False).get_opcodes():
        if tag != "equal":
            drift += [f"crd.py:{i + 1}: {crd_lines[i]}" for i in range(i1, i2) if i not in crd_allowed]
            drift += [f"{sibling}:{j + 1}: {lines[j]}" for j in range(j1, j2) if j not in allowed]
    assert not drift, f"crd.py and {sibling} drifted apart outside the algorithm:\n" + "\n".join(drift)


def test_timestep_window_is_the_grid_steps_at_or_above_shift_0_3(tiny_pipe):
    """Official DGPO trains the first trunc_steps + 1 = 7 grid steps, which its config calls t >= shift(0.3); on
    the 10-step grid of SD3's shifted scheduler those are exactly the steps with t >= 1000 shift(0.3)."""
    scheduler = tiny_pipe.scheduler
    scheduler.set_timesteps(10)
    grid, shift = scheduler.timesteps.float(), scheduler.config.shift
    t_min = 1000 * shift * 0.3 / (1 + (shift - 1) * 0.3)  # 562.5 at shift 3
    assert torch.equal(train_timestep_grid(grid, Args(timestep_window=7)), grid[grid >= t_min])
    assert torch.equal(train_timestep_grid(grid, Args()), grid[:-1])  # the default: CRD's 9 timesteps
    assert torch.equal(train_timestep_grid(grid, Args()), crd.train_timestep_grid(grid, crd.Args()))


@pytest.mark.parametrize("flags, message", [
    (dict(timestep_window=7, num_train_timesteps=8), "--num-train-timesteps 8 must lie in [1, 7]"),
    (dict(timestep_window=11), "--timestep-window 11 must lie in [0, --num-steps = 10]"),
    (dict(timestep_window=-1), "--timestep-window -1 must lie in [0, --num-steps = 10]"),
])
def test_bad_timestep_window_is_named(flags, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        check_args(Args(train_batch_size=6, **flags))  # as resolved from 0 before the check


# Runs dgpo.py unchanged as __main__, then saves the last training step's inputs and reference velocities.
# Usage: python WRAPPER ROOT OUT_FILE [dgpo.py arguments...]
STEP_DUMP = """
import runpy, sys
from pathlib import Path
from safetensors.torch import save_file
root, out = Path(sys.argv[1]), sys.argv[2]
sys.argv = [str(root / "dgpo.py"), *sys.argv[3:]]
sys.path.insert(0, str(root))
run = runpy.run_path(str(root / "dgpo.py"), run_name="__main__")
rows = run["rows"]
save_file({"grid": run["samples"]["timesteps"], "timesteps": rows.timesteps, "noisy": rows.noisy,
           "embeds": run["embeds"][rows.image_index],
           "pooled": run["pooled"][rows.image_index], "v_ref": run["v_ref"]}, out)
"""


def test_the_loop_trains_the_window_against_the_cfg_guided_base(tiny_model_dir, tiny_pipe, tmp_path):
    """One iteration of dgpo.py with the official window: each group trains the first 7 grid steps (all of them here,
    so that any step outside the window shows), and the reference velocities (d_ref and the MSE) are the base
    model's at CFG 4.5 with negative ""."""
    wrapper = tmp_path / "step_dump.py"
    wrapper.write_text(STEP_DUMP)
    cmd = [sys.executable, str(wrapper), str(ROOT), str(tmp_path / "step.safetensors"), *TINY_RUN,
           "--output-dir", str(tmp_path), "--timestep-window", "7", "--num-train-timesteps", "7"]
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    result = zygote.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    step = load_file(tmp_path / "step.safetensors")
    per_group = step["timesteps"].view(-1, 7, G)  # micro_batch_rows: (groups, T, G) with one group per micro batch
    assert (per_group == per_group[..., :1]).all()  # shared by the members of a group
    for group in per_group[..., 0]:
        assert sorted(group.tolist(), reverse=True) == step["grid"][:7].tolist()
    base, n = tiny_pipe.transformer, len(step["noisy"])
    empty, empty_pooled = sd3.encode_prompts(tiny_pipe, [""] * n, 96)  # the run's --max-sequence-length
    with torch.no_grad():
        v_cond = base(hidden_states=step["noisy"], timestep=step["timesteps"], encoder_hidden_states=step["embeds"],
                      pooled_projections=step["pooled"], return_dict=False)[0]
        v_unc = base(hidden_states=step["noisy"], timestep=step["timesteps"], encoder_hidden_states=empty,
                     pooled_projections=empty_pooled, return_dict=False)[0]
    torch.testing.assert_close(step["v_ref"], v_unc + 4.5 * (v_cond - v_unc), rtol=1e-4, atol=1e-4)
