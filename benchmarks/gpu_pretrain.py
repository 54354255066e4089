"""Pre-training on one GPU: the largest microbatch, images/s, MFU and the input wait.

Three measurements of the pre-training step (AdamW, weight decay, global-norm clip 1.0,
bf16 autocast, SDPA attention), for one variant at one resolution:

1. ``max_microbatch``: the largest per-device forward batch whose training step fits in
   memory, found by doubling then bisecting on out-of-memory errors.
2. ``step``: images/s and MFU at ``--batch`` on GPU-resident data (the compute ceiling),
   against ``vitcore.ReferenceViT`` in fp32 with explicit attention at the same batch
   (the baseline, skipped with ``--no-reference`` or when it does not fit).
3. ``input``: the same step fed from a shard set through ``training.data.ShardImageDataset``
   (decode + Inception crop + flip in DataLoader processes, pinned memory), for each
   ``--loader-workers`` count; ``input_wait`` is the fraction of step time spent waiting
   for the next batch. ``0`` workers decodes in the training process (the baseline).

    python benchmarks/gpu_pretrain.py --shards DIR                       # B/16 at 224
    python benchmarks/gpu_pretrain.py --variant L/16 --batch 128 --shards DIR --loader-workers 8,14

The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import vitcore  # noqa: E402
from training.data import ShardImageDataset, normalize, train_transform  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="B/16")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=256, help="microbatch for the throughput and input runs")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-search", type=int, default=4096, help="stop the microbatch search here")
    ap.add_argument("--shards", default=None, help="shard set for the input measurement (skipped without)")
    ap.add_argument("--loader-workers", default="0,4,8,14", help="DataLoader process counts to try")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the model")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU; the CPU figures come from benchmarks/vit_step.py")
    return args


def make_model(args, reference: bool = False):
    torch.manual_seed(0)
    model = vitcore.create_model(args.variant, img_size=args.img_size, num_classes=1000)
    if reference:
        ref = vitcore.ReferenceViT(model.config)
        ref.load_state_dict(model.state_dict())
        model = ref
    return model.cuda()


def make_step(model, bf16: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.03, fused=True)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def fits(args, batch: int) -> bool:
    model = make_model(args)
    step = make_step(model, True)
    try:
        x = torch.randn(batch, 3, args.img_size, args.img_size, device="cuda")
        y = torch.randint(0, 1000, (batch,), device="cuda")
        for _ in range(2):  # the optimiser state appears on the first step
            step(x, y)
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, step
        torch.cuda.empty_cache()


def max_microbatch(args) -> int:
    lo, hi = 0, 32
    while hi <= args.max_search and fits(args, hi):
        lo, hi = hi, hi * 2
    if hi > args.max_search:
        return lo
    while hi - lo > 8:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(args, mid) else (lo, mid)
    return lo


def time_steps(step, batches, args) -> tuple[float, float]:
    """(images/s, fraction of wall time spent waiting for input) over ``args.steps`` steps."""
    it = iter(batches)
    for _ in range(args.warmup):
        x, y = next(it)
        step(x.cuda(non_blocking=True), y.cuda(non_blocking=True))
    torch.cuda.synchronize()
    wait = 0.0
    n = 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tw = time.perf_counter()
        x, y = next(it)
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        # The previous step must be done before we can say the loader, not the GPU, held us up.
        wait += time.perf_counter() - tw
        step(x, y)
        n += x.shape[0]
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return n / total, wait / total


def resident(args, batch: int):
    x = torch.randn(batch, 3, args.img_size, args.img_size, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    while True:
        yield x, y


def loader(args, workers: int):
    ds = ShardImageDataset(args.shards, train_transform(args.img_size, uint8=True))
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=True, drop_last=True,
                                     num_workers=workers, pin_memory=True,
                                     persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    while True:
        for x, y in dl:
            yield normalize(x.cuda(non_blocking=True)), y


def main(argv=None) -> dict:
    args = parse_args(argv)
    name = torch.cuda.get_device_name()
    peak = vitcore.bf16_peak_flops(name)
    flop = vitcore.train_flops_per_image(vitcore.create_model(args.variant, img_size=args.img_size,
                                                               num_classes=1000))
    report = {"benchmark": "gpu_pretrain", "device": name, "torch": torch.__version__,
              "variant": args.variant, "img_size": args.img_size, "batch": args.batch,
              "train_gflop_per_img": round(flop / 1e9, 2),
              "bf16_peak_tflops": peak / 1e12 if peak else None}

    def mfu(img_s):
        return round(img_s * flop / peak, 4) if peak else None

    report["max_microbatch"] = max_microbatch(args)
    print(f"max microbatch {report['max_microbatch']}", file=sys.stderr, flush=True)

    torch.cuda.reset_peak_memory_stats()
    model = make_model(args)
    img_s, _ = time_steps(make_step(model, True), resident(args, args.batch), args)
    report["step"] = {"ours_img_s": round(img_s, 1), "ours_mfu": mfu(img_s),
                      "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)}
    print(f"step {report['step']}", file=sys.stderr, flush=True)
    if args.compile:
        try:
            compiled = torch.compile(model)
            c_img_s, _ = time_steps(make_step(compiled, True), resident(args, args.batch), args)
            report["step"].update(compiled_img_s=round(c_img_s, 1), compiled_mfu=mfu(c_img_s))
            del compiled
        except Exception as exc:  # a compiler failure is a finding, not a reason to lose the rest
            report["step"]["compiled_img_s"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    del model
    torch.cuda.empty_cache()
    if not args.no_reference:
        try:
            ref = make_model(args, reference=True)
            r_img_s, _ = time_steps(make_step(ref, False), resident(args, args.batch), args)
            report["step"].update(reference_img_s=round(r_img_s, 1), reference_mfu=mfu(r_img_s),
                                  speedup=round(img_s / r_img_s, 2))
            del ref
        except torch.OutOfMemoryError:
            report["step"]["reference_img_s"] = "out of memory"
        torch.cuda.empty_cache()
    print(f"step {report['step']}", file=sys.stderr, flush=True)

    if args.shards:
        report["input"] = {"cpus": os.cpu_count()}
        model = make_model(args)
        step = make_step(model, True)
        for workers in [int(w) for w in args.loader_workers.split(",") if w.strip()]:
            l_img_s, wait = time_steps(step, loader(args, workers), args)
            report["input"][f"workers_{workers}"] = {"img_s": round(l_img_s, 1), "input_wait": round(wait, 3),
                                                     "mfu": mfu(l_img_s)}
            print(f"loader workers={workers}: {report['input'][f'workers_{workers}']}", file=sys.stderr, flush=True)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
