"""Pre-training on one GPU: the step's options, the largest microbatch, images/s, MFU and the input wait.

Measurements of the pre-training step (AdamW from ``training.step.adamw``, weight decay,
global-norm clip 1.0, bf16 autocast, SDPA attention), for one variant at one resolution:

1. ``max_microbatch``: the largest per-device forward batch whose eager training step fits in
   memory, found by doubling then bisecting on out-of-memory errors (``--max-search 0``: skipped).
2. ``options``: images/s, MFU and peak memory at ``--batch`` on GPU-resident data (the compute
   ceiling) for each ``--options`` entry: ``eager``, ``eager+fused`` (AdamW's fused kernel),
   ``compiled`` (``torch.compile``, the trainer's GPU default), ``compiled+fused``,
   ``reduce-overhead`` (compiled with CUDA graphs) and ``max-autotune``; a failure is recorded, not fatal.
3. ``microbatch_sweep``: the ``--sweep-option`` step at each ``--microbatches`` size ("out of
   memory" where it does not fit).
4. ``reference``: ``vitcore.ReferenceViT`` in fp32 with explicit attention at ``--batch`` (the
   baseline; ``--no-reference`` skips it).
5. ``input``: the ``--input-option`` step fed from a shard set through DataLoader processes, for
   each ``--loader-workers`` count, the train input split as ``--augment`` says (``device``: the
   trainer's GPU default, ``training.data.ShardCropDataset`` and ``training.augment.device_batch``;
   ``item``: ``ShardImageDataset`` with ``train_transform``); ``input_wait`` is the fraction of step
   time spent waiting for the next batch. ``0`` workers decodes in the training process.

    python benchmarks/gpu_pretrain.py --shards DIR                       # B/16 at 224, every option
    python benchmarks/gpu_pretrain.py --variant L/16 --batch 128 --shards DIR --loader-workers 8,12
    python benchmarks/gpu_pretrain.py --device cpu --variant Ti/16 --img-size 32 --batch 4 --steps 2 \
        --warmup 1 --max-search 0 --microbatches 2,4 --options eager,compiled --no-reference  # smoke test

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
from training.augment import device_batch  # noqa: E402
from training.data import (  # noqa: E402
    ShardCropDataset,
    ShardImageDataset,
    collate_crops,
    normalize,
    release_canvases,
    train_transform,
)
from training.step import adamw, compile_mode, compile_model  # noqa: E402

#: ``--options``: (``--compile`` value of pretrain, ``--fused-adamw``).
OPTIONS = {
    "eager": ("eager", False),
    "eager+fused": ("eager", True),
    "compiled": ("default", False),
    "compiled+fused": ("default", True),
    "reduce-overhead": ("reduce-overhead", False),
    "max-autotune": ("max-autotune", False),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="B/16")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=256, help="microbatch for the option, reference and input runs")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    ap.add_argument("--max-search", type=int, default=4096, help="stop the microbatch search here; 0 skips it")
    ap.add_argument("--options", default=",".join(OPTIONS), help=f"step options to time, of {', '.join(OPTIONS)}")
    ap.add_argument("--microbatches", default="128,256,512,1024", help="microbatch sizes of the sweep; empty skips it")
    ap.add_argument("--sweep-option", default="compiled", choices=list(OPTIONS), help="the step the sweep times")
    ap.add_argument("--shards", default=None, help="shard set for the input measurement (skipped without)")
    ap.add_argument("--loader-workers", default="0,4,8,12", help="DataLoader process counts to try")
    ap.add_argument("--augment", default="device", choices=["device", "item"], help="train input split for the input runs")
    ap.add_argument("--input-option", default="compiled", choices=list(OPTIONS), help="the step the input runs feed")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (figures mean nothing)")
    args = ap.parse_args(argv)
    unknown = [o for o in _names(args.options) if o not in OPTIONS]
    if unknown:
        ap.error(f"--options: unknown {', '.join(unknown)}; use some of {', '.join(OPTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --device cpu for a smoke test); the CPU figures come from benchmarks/vit_step.py")
    return args


def _names(csv: str) -> list[str]:
    return [x.strip() for x in csv.split(",") if x.strip()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_model(args, reference: bool = False):
    torch.manual_seed(0)
    model = vitcore.create_model(args.variant, img_size=args.img_size, num_classes=1000)
    if reference:
        ref = vitcore.ReferenceViT(model.config)
        ref.load_state_dict(model.state_dict())
        model = ref
    return model.to(args.device)


def make_step(model, args, option: str = "eager", bf16: bool = True):
    """The trainer's step with ``option``'s compile mode and AdamW kernel: (x, y) on the device → loss."""
    compile_option, fused = OPTIONS[option]
    device = torch.device(args.device)
    opt = adamw(model, lr=1e-3, weight_decay=0.03, fused=fused)
    forward = compile_model(model, compile_mode(compile_option, device.type))

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and device.type == "cuda"):
            loss = F.cross_entropy(forward(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def fits(args, batch: int) -> bool:
    model = make_model(args)
    step = make_step(model, args)
    try:
        x = torch.randn(batch, 3, args.img_size, args.img_size, device=args.device)
        y = torch.randint(0, 1000, (batch,), device=args.device)
        for _ in range(2):  # the optimiser state appears on the first step
            step(x, y)
        _sync(torch.device(args.device))
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
    """(images/s, fraction of wall time spent waiting for input) over ``args.steps`` steps.
    ``batches`` yields (x, y) on the device, or a crop batch for ``device_batch``."""
    device = torch.device(args.device)

    def on_device(b):
        return device_batch(b, args.img_size, device) if isinstance(b, dict) else b

    it = iter(batches)
    for _ in range(args.warmup):
        step(*on_device(next(it)))
    _sync(device)
    wait = 0.0
    n = 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tw = time.perf_counter()
        b = next(it)
        # The previous step is done (synchronised below), so the time here is the loader's, not the GPU's.
        wait += time.perf_counter() - tw
        x, y = on_device(b)
        step(x, y)
        n += x.shape[0]
        _sync(device)
    total = time.perf_counter() - t0
    return n / total, wait / total


def resident(args, batch: int):
    x = torch.randn(batch, 3, args.img_size, args.img_size, device=args.device)
    y = torch.randint(0, 1000, (batch,), device=args.device)
    while True:
        yield x, y


def timed_option(args, option: str, batch: int, mfu) -> dict:
    """One option's step at ``batch`` on resident data; a failure (out of memory, a compiler
    error) is recorded as the figure, so that one option cannot lose the others."""
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
    model = make_model(args)
    try:
        img_s, _ = time_steps(make_step(model, args, option), resident(args, batch), args)
        out = {"img_s": round(img_s, 1), "mfu": mfu(img_s)}
        if args.device == "cuda":
            out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        return out
    except torch.OutOfMemoryError:
        return "out of memory"
    except Exception as exc:  # a compiler failure is a finding, not a reason to lose the rest
        return f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        del model
        torch.cuda.empty_cache()


def loader(args, workers: int):
    """Batches from the shards as the trainer's ShardStream makes them, endlessly."""
    kw = dict(batch_size=args.batch, shuffle=True, drop_last=True, num_workers=workers,
              pin_memory=args.device == "cuda", persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    if args.augment == "device":
        dl = torch.utils.data.DataLoader(ShardCropDataset(args.shards, args.img_size), collate_fn=collate_crops, **kw)
    else:
        dl = torch.utils.data.DataLoader(ShardImageDataset(args.shards, train_transform(args.img_size, uint8=True)), **kw)
    while True:
        if args.augment == "device":
            yield from release_canvases(dl)
        else:
            for x, y in dl:
                yield normalize(x.to(args.device, non_blocking=True)), y.to(args.device, non_blocking=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test)"
    peak = vitcore.bf16_peak_flops(name) if args.device == "cuda" else None
    flop = vitcore.train_flops_per_image(vitcore.create_model(args.variant, img_size=args.img_size,
                                                               num_classes=1000))
    report = {"benchmark": "gpu_pretrain", "device": name, "torch": torch.__version__,
              "variant": args.variant, "img_size": args.img_size, "batch": args.batch,
              "train_gflop_per_img": round(flop / 1e9, 2),
              "bf16_peak_tflops": peak / 1e12 if peak else None, "cpus": os.cpu_count()}

    def mfu(img_s):
        return round(img_s * flop / peak, 4) if peak else None

    def progress(key):
        print(f"{key} {report[key]}", file=sys.stderr, flush=True)

    if args.max_search:
        report["max_microbatch"] = max_microbatch(args)
        progress("max_microbatch")
    report["options"] = {}
    for option in _names(args.options):
        report["options"][option] = timed_option(args, option, args.batch, mfu)
        print(f"option {option}: {report['options'][option]}", file=sys.stderr, flush=True)
    report["microbatch_sweep"] = {"option": args.sweep_option}
    for mb in [int(b) for b in _names(args.microbatches)]:
        report["microbatch_sweep"][str(mb)] = timed_option(args, args.sweep_option, mb, mfu)
    progress("microbatch_sweep")
    if not args.no_reference:
        ref = make_model(args, reference=True)
        try:
            r_img_s, _ = time_steps(make_step(ref, args, bf16=False), resident(args, args.batch), args)
            report["reference"] = {"img_s": round(r_img_s, 1), "mfu": mfu(r_img_s)}
        except torch.OutOfMemoryError:
            report["reference"] = "out of memory"
        del ref
        torch.cuda.empty_cache()
        progress("reference")

    if args.shards:
        report["input"] = {"augment": args.augment, "option": args.input_option}
        torch._dynamo.reset()
        step = make_step(make_model(args), args, args.input_option)
        for workers in [int(w) for w in _names(args.loader_workers)]:
            l_img_s, wait = time_steps(step, loader(args, workers), args)
            report["input"][f"workers_{workers}"] = {"img_s": round(l_img_s, 1), "input_wait": round(wait, 3),
                                                     "mfu": mfu(l_img_s)}
            print(f"loader workers={workers}: {report['input'][f'workers_{workers}']}", file=sys.stderr, flush=True)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
