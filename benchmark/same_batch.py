"""Does a speed setting change the training step? One CRD micro batch, the same inputs, three paths.

    python benchmark/same_batch.py --model random-sd3.5-medium --out same_batch.json

One prompt group (6 images) at T = 9 timesteps, like crd.py's training step: the old adapter and the CFG-guided
base velocities without gradients, then the policy forward and backward over 3 timesteps at a time, crd_loss. Run
eager, then with compiled blocks (`--compile`), then also with gradient checkpointing; reports each path's loss and
LoRA gradient against the eager one (relative L2 error, cosine). The adapters are perturbed (a fresh LoRA is the
identity and has no gradient in A); rewards are random.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rollout  # noqa: E402
from crd import crd_loss  # noqa: E402


def training_step(transformer, batch, negative, group_size, timesteps_per_forward):
    """crd.py's micro batch: returns (loss, flat LoRA gradient of the policy)."""
    noisy, timesteps, embeds, pooled, target, advantages = batch
    autocast = torch.autocast(noisy.device.type, torch.bfloat16, enabled=noisy.device.type == "cuda")
    with torch.no_grad(), autocast:
        with rollout.use_adapter(transformer, "old"):
            v_old = rollout.predict_velocity(transformer, noisy, timesteps, embeds, pooled, max_batch_size=48)
        with rollout.use_adapter(transformer, None):
            v_ref = rollout.predict_velocity(transformer, noisy, timesteps, embeds, pooled, 4.5, *negative,
                                             max_batch_size=48)
    params = rollout.lora_parameters(transformer, "policy")
    rows, total = group_size * timesteps_per_forward, 0.0
    for chunk in (slice(i, i + rows) for i in range(0, len(noisy), rows)):
        with rollout.use_adapter(transformer, "policy"), autocast:
            v_theta = rollout.predict_velocity(transformer, noisy[chunk], timesteps[chunk], embeds[chunk], pooled[chunk])
        loss, _ = crd_loss(v_theta, v_old[chunk], v_ref[chunk], target[chunk], advantages[chunk], group_size)
        share = len(v_theta) / len(noisy)
        (loss * share).backward()
        total += float(loss.detach()) * share
    grad = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    return total, grad


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=rollout.RANDOM_MEDIUM)
    parser.add_argument("--device", default="cuda", help="cuda (bf16 autocast), or cpu for a smoke check (fp32)")
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--num-train-timesteps", type=int, default=9)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pipe = rollout.load_pipeline(args.model, device, torch.bfloat16 if cuda else torch.float32)
    transformer = pipe.transformer
    rollout.add_lora_adapters(transformer, 32, 64)
    with torch.no_grad():
        for name, scale in (("policy", 1e-3), ("old", 1e-3)):
            for p in rollout.lora_parameters(transformer, name):
                p.add_(scale * torch.randn_like(p))
    G, T = args.group_size, args.num_train_timesteps
    embeds, pooled = rollout.encode_prompts(pipe, ['a sign that says "same batch"'] * (G * T))  # (T*G, 333, 4096)
    negative = rollout.negative_embeddings(pipe)
    size = args.resolution // 8
    clean = torch.randn(G, 16, size, size, device=device).repeat(T, 1, 1, 1)  # (T*G, 16, h, w), timestep-major
    noise = torch.randn_like(clean)
    timesteps = torch.linspace(900, 100, T, device=device).repeat_interleave(G)  # (T*G,)
    sigma = (timesteps / 1000).view(-1, 1, 1, 1)
    advantages = torch.randn(G, device=device).repeat(T)  # (T*G,)
    batch = ((1 - sigma) * clean + sigma * noise, timesteps, embeds, pooled, noise - clean, advantages)

    results = {}
    for path in ("eager", "compiled", "compiled + checkpointing"):
        if path == "compiled":
            rollout.compile_blocks(transformer)
        if path == "compiled + checkpointing":
            transformer.enable_gradient_checkpointing()
        started = time.perf_counter()
        first_loss, first_grad = training_step(transformer, batch, negative, G, 3)  # a warm-up (compiling)
        sync()
        warmup_s, started = time.perf_counter() - started, time.perf_counter()
        loss, grad = training_step(transformer, batch, negative, G, 3)
        sync()
        results[path] = {"loss": loss, "grad": grad, "warmup_s": warmup_s, "step_s": time.perf_counter() - started}
        if path == "eager":  # the noise floor: the same path twice
            results["eager, first run"] = {"loss": first_loss, "grad": first_grad, "warmup_s": 0.0, "step_s": warmup_s}
    eager = results["eager"]
    report = {"model": args.model, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "paths": {}}
    for path, r in results.items():
        report["paths"][path] = {
            "loss": r["loss"], "loss_rel_diff": abs(r["loss"] - eager["loss"]) / abs(eager["loss"]),
            "grad_norm": float(r["grad"].norm()),
            "grad_rel_l2_diff": float((r["grad"] - eager["grad"]).norm() / eager["grad"].norm()),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(r["grad"], eager["grad"], dim=0)),
            "warmup_s": r["warmup_s"], "step_s": r["step_s"]}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
