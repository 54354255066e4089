"""Training-step throughput of vitcore's ViT against a plain reference implementation.

For each variant, one run builds the project's model (fused SDPA attention; bf16 autocast
on GPU, optionally torch.compile) and `vitcore.ReferenceViT` holding the same weights
(explicit softmax attention, fp32, nothing fused), checks that both compute the same
function, then times SGD training steps of the two alternately so that load from other
processes hits both alike, and reports the best step of each. On a GPU it also reports model FLOP utilisation against the
device's dense bf16 peak (the reference's MFU is against the same peak, although it runs
in fp32).

The last line printed is one JSON object with all figures, e.g.

    python benchmarks/vit_step.py                       # CPU, Ti/16, S/16, B/16 at 224 px
    python benchmarks/vit_step.py --device cuda --batch 256 --steps 20 --compile
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import vitcore  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="Ti/16,S/16,B/16", help="comma-separated, e.g. Ti/16,B/16")
    ap.add_argument("--batch", type=int, default=None, help="images per step (default: 2 on CPU, 128 on GPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per model (default: 3 on CPU, 20 on GPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 1 on CPU, 5 on GPU)")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the project's model")
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--no-reference", action="store_true", help="skip the reference baseline")
    args = ap.parse_args(argv)
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        ap.error("--device cuda given but torch sees no GPU; use --device cpu")
    args.batch = args.batch or (128 if gpu else 2)
    args.steps = args.steps or (20 if gpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    return args


def make_step(model, optimizer, x, y, autocast_bf16: bool):
    ctx = (torch.autocast(device_type=x.device.type, dtype=torch.bfloat16)
           if autocast_bf16 else contextlib.nullcontext())

    def step():
        with ctx:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def timed(step, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def bench_variant(variant: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    gpu = device.type == "cuda"
    ours = vitcore.create_model(variant, img_size=args.img_size, grad_checkpointing=args.grad_checkpointing)
    # The head starts at zero (Section 3.2); randomise it so the equivalence check sees
    # more than constant logits.
    torch.nn.init.normal_(ours.head.weight, std=0.02)
    ours.to(device)
    x = torch.rand(args.batch, 3, args.img_size, args.img_size, device=device) * 2 - 1
    y = torch.randint(0, ours.config.num_classes, (args.batch,), device=device)
    result = {"train_gflop_per_img": vitcore.train_flops_per_image(ours) / 1e9,
              "params_m": sum(p.numel() for p in ours.parameters()) / 1e6}

    ref = None
    if not args.no_reference:
        ref = vitcore.ReferenceViT(ours.config).to(device)
        ref.load_state_dict(ours.state_dict(), strict=True)
        with torch.no_grad():
            ours.eval()
            a, b = ours(x[:2]), ref(x[:2])
            ours.train()
        result["max_abs_logit_diff_fp32"] = float((a - b).abs().max())

    model = torch.compile(ours) if args.compile else ours
    steps = {"ours": make_step(model, torch.optim.SGD(ours.parameters(), lr=1e-3, momentum=0.9), x, y, gpu)}
    if ref is not None:
        steps["reference"] = make_step(ref, torch.optim.SGD(ref.parameters(), lr=1e-3, momentum=0.9), x, y, False)
    for step in steps.values():
        for _ in range(args.warmup):
            timed(step, device)
    times = {k: [] for k in steps}
    for _ in range(args.steps):  # alternate, so background load affects both alike
        for k, step in steps.items():
            times[k].append(timed(step, device))
    if gpu:
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    peak = vitcore.bf16_peak_flops(torch.cuda.get_device_name(device)) if gpu else None
    for k, ts in times.items():
        # Best step, as timeit does: other processes on a shared machine only ever add time.
        img_s = args.batch / min(ts)
        result[f"{k}_img_s"] = round(img_s, 3)
        if peak:
            result[f"{k}_mfu"] = round(img_s * result["train_gflop_per_img"] * 1e9 / peak, 4)
    if ref is not None:
        result["speedup"] = round(result["ours_img_s"] / result["reference_img_s"], 3)
    result["train_gflop_per_img"] = round(result["train_gflop_per_img"], 2)
    result["params_m"] = round(result["params_m"], 2)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else f"cpu ({torch.get_num_threads()} threads)"
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference is honest fp32
    report = {
        "benchmark": "vit_step", "device": name, "torch": torch.__version__,
        "batch": args.batch, "steps": args.steps, "img_size": args.img_size,
        "ours": ("bf16 autocast + SDPA" if gpu else "fp32 + SDPA") + (" + compile" if args.compile else "")
                + (" + grad checkpointing" if args.grad_checkpointing else ""),
        "reference": None if args.no_reference else "fp32, explicit softmax attention, no fusion",
        "bf16_peak_tflops": (vitcore.bf16_peak_flops(name) or 0) / 1e12 if gpu else None,
        "results": {},
    }
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        r = bench_variant(variant, args, device)
        report["results"][variant] = r
        print(f"{variant}: " + ", ".join(f"{k}={v}" for k, v in r.items()), file=sys.stderr, flush=True)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
