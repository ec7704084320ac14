"""Where the time of one headloss call goes: host (Python) time per call and device time per kernel.

  python -m benchmarks.profile_head [--vocab 128256] [--rows 8192]

Prints, for the CE-only and full specs: host microseconds of head_loss(...) and of .backward(),
and the device time of each kernel from torch.profiler (median over the profiled steps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import headloss
from benchmarks.bench_head import CE_SPEC, FULL_SPEC, make_batch
from benchmarks.common import kernel_device_us
from headloss.kernels.launch import LAUNCH_OVERRIDES


def host_us(fn, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def kernel_times(step, reps: int = 10) -> dict[str, float]:
    """Median device time (us) of one launch of each kernel that ``step`` runs."""
    return {name: statistics.median(v) for name, v in kernel_device_us(step, reps).items()}


ABLATION = {
    "ce": CE_SPEC,
    "ce+z": headloss.LossSpec(z_loss={"weight": 1e-4}),
    "ce+entropy": headloss.LossSpec(entropy={"weight": 0.0}),
    "ce+accuracy": headloss.LossSpec(token_accuracy=True),
    "ce+entropy-grad": headloss.LossSpec(entropy={"weight": 0.1}),
    "ce+smoothing": headloss.LossSpec(cross_entropy={"label_smoothing": 0.1}),
    "ce+softcap": headloss.LossSpec(transform={"softcap": 30.0}),
    "full": FULL_SPEC,
}


def ablate(x: torch.Tensor, targets: torch.Tensor, configs: list[tuple[int, int]]) -> None:
    """Device time of the head kernel for each term added to CE alone, per launch config."""
    from headloss.kernels.head import head_kernel

    print(f"\n{'spec':<18}" + "".join(f"{f'B={b},w={w}':>16}" for b, w in configs) + "   (us, regs)")
    for name, spec in ABLATION.items():
        cells = []
        for block, warps in configs:
            LAUNCH_OVERRIDES.update(block_v=block, num_warps=warps)
            head_kernel.device_caches.clear()

            def step(spec=spec):
                x.grad = None
                headloss.head_loss(x, targets, spec, inplace_grad=True, validate=False).loss.backward()

            step()
            us = kernel_times(step, reps=5).get("head_kernel", float("nan"))
            compiled = [k for c in head_kernel.device_caches.values() for k in c[0].values()]
            regs = compiled[0].n_regs if compiled else -1
            cells.append(f"{us:10.0f} ({regs:3d})")
        print(f"{name:<18}" + "".join(f"{c:>16}" for c in cells))
    LAUNCH_OVERRIDES.update(block_v=None, num_warps=None)


def terms(configs: list[tuple[int, int]]) -> None:
    """Distillation and GRPO: device time per kernel and launch config, and host time per call."""
    from benchmarks.bench_terms import DISTILL_SPEC, GRPO_SPEC, V

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(8192, V, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    teacher = (torch.randn(8192, V, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    y = torch.randint(0, V, (8192,), device="cuda", generator=gen)
    x3 = x.detach().view(8, 1024, V).clone().requires_grad_()
    y3 = y.view(8, 1024)
    grpo_inputs = dict(
        advantages=torch.randn(8, device="cuda", generator=gen),
        old_logprobs=-torch.rand(8, 1024, device="cuda", generator=gen) * 5,
        ref_logprobs=-torch.rand(8, 1024, device="cuda", generator=gen) * 5,
        loss_mask=torch.ones(8, 1024, device="cuda"),
        num_items_in_batch=8192,
    )
    def fresh(fn):
        def step():
            x.grad = x3.grad = None  # else AccumulateGrad adds into the previous gradient
            fn()

        return step

    steps = {
        "distill": fresh(lambda: headloss.head_loss(x, y, DISTILL_SPEC, teacher_logits=teacher, inplace_grad=True,
                                                    validate=False).loss.backward()),
        "grpo": fresh(lambda: headloss.head_loss(x3, y3, GRPO_SPEC, inplace_grad=True, validate=False,
                                                 **grpo_inputs).loss.backward()),
    }
    for name, step in steps.items():
        for block, warps in configs:
            LAUNCH_OVERRIDES.update(block_v=block, num_warps=warps)
            x.grad = x3.grad = None
            step()
            times = kernel_times(step, reps=5)
            heads = {k: v for k, v in times.items() if "head_" in k}
            rest = sorted(((v, k) for k, v in times.items() if "head_" not in k), reverse=True)
            print(f"{name} B={block} w={warps}: " + ", ".join(f"{k} {v:.0f} us" for k, v in heads.items())
                  + f", {len(rest)} other kernels {sum(v for v, _ in rest):.0f} us; largest: "
                  + ", ".join(f"{k[:40]} {v:.0f}" for v, k in rest[:3]))
        torch.cuda.synchronize()
        host = host_us(step, reps=6)
        print(f"{name}: host time of one fwd+bwd call {host:.0f} us")
    LAUNCH_OVERRIDES.update(block_v=None, num_warps=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--ablate", action="store_true", help="kernel time per added term and launch config")
    parser.add_argument("--terms", action="store_true", help="distillation and GRPO kernels, host time")
    args = parser.parse_args()
    if args.terms:
        terms([(1024, 4), (2048, 4)])
        return
    pristine, targets = make_batch(args.rows, args.vocab)
    if args.ablate:
        ablate(pristine.clone().requires_grad_(), targets, [(512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8)])
        return
    x = pristine.clone().requires_grad_()
    for name, spec in (("ce", CE_SPEC), ("full", FULL_SPEC)):
        for validate in (False, True):
            holder = {}

            def fwd(spec=spec, validate=validate, holder=holder):
                x.grad = None
                holder["out"] = headloss.head_loss(x, targets, spec, inplace_grad=True, validate=validate)

            def bwd(holder=holder):
                holder["out"].loss.backward()

            def step():
                fwd()
                bwd()

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            f_us = host_us(fwd)
            bwd_times = []
            for _ in range(20):
                fwd()
                t0 = time.perf_counter()
                bwd()
                bwd_times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            print(f"\n{name} validate={validate}: host forward {f_us:.0f} us, "
                  f"host backward {statistics.median(bwd_times) * 1e6:.0f} us")
            if validate:
                continue
            for kname, us in sorted(kernel_times(step).items(), key=lambda kv: -kv[1]):
                print(f"   {us:9.1f} us  {kname[:90]}")


if __name__ == "__main__":
    main()
