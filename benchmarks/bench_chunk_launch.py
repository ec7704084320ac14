"""The head kernel's block and warps on the fused lm_head's chunks: fewer, wider programs keep fewer rows in
flight, so more of a row may still be in L2 when the gradient pass reads it again. In isolation and end to end.

  python -m benchmarks.bench_chunk_launch            # the head kernel alone (CE, gradient in place) over
                                                     # chunk sweeps of distinct [N, V] rows at each launch
                                                     # config, its gradient against the default config's, and
                                                     # the read+write / read rates of the same sweeps
  python -m benchmarks.bench_chunk_launch --whole    # linear_head_loss fwd+bwd at each config: CE, the full
                                                     # SFT spec, GRPO clip, per-token CE (4 GEMMs), forward KL
                                                     # from both heads' hidden states (16384 x 151936, H 4096);
                                                     # CE, the full spec and forward KL at 8192 x 128256;
                                                     # --rounds R (default 2), the configs interleaved
  python -m benchmarks.bench_chunk_launch --one CFG  # one sweep of 4 chunks of 768 x 151936 at CFG ("default"
                                                     # or "block,warps"), for a profiler: ncu -k regex:head_kernel

Prints its results (kept as benchmarks/results/*.log). The configs go through kernels.launch.LAUNCH_OVERRIDES.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import headloss
from benchmarks.bench_objectives import spec_of
from benchmarks.common import launch_forced, three_gemms_ms, time_ms
from headloss.linear import chunk_head_
from headloss.plan import compile_plan

CONFIGS = [None, (2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32), (8192, 32)]
WHOLE_CONFIGS = [None, (4096, 8), (8192, 8), (16384, 16)]
TEACHER_CONFIGS = [None, (4096, 8), (8192, 16), (16384, 32)]
H = 4096
FULL = headloss.LossSpec(z_loss={"weight": 1e-4}, entropy={"weight": 0.0}, token_accuracy=True,
                         outputs=("predicted_tokens",))


def with_config(cfg, fn):
    """``fn()`` at the launch config ``cfg`` ((block, warps), or None: the default's)."""
    with launch_forced(*(cfg or (None, None))):
        return fn()


def isolated(n: int, v: int, chunk: int, cfgs, reps: int = 10) -> None:
    """The head kernel over chunks of ``chunk`` rows of one [n, v] buffer (restored before each sweep)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    pristine = (torch.randn(n, v, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    x = torch.empty_like(pristine)
    y = torch.randint(0, v, (n,), device="cuda", generator=gen)
    plan = compile_plan(headloss.LossSpec(), has_targets=True)
    spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]

    def setup():
        x.copy_(pristine)

    def sweep():
        for s, e in spans:
            chunk_head_(plan, x[s:e], y[s:e])

    ref = None
    gb = 3 * n * v * 2 / 1e9
    print(f"== N {n} V {v} chunk {chunk}: 3 sweeps = {gb:.2f} GB", flush=True)
    for cfg in cfgs:
        try:
            with_config(cfg, lambda: (setup(), sweep()))
            torch.cuda.synchronize()
            if ref is None:
                ref = x[: min(n, 2048)].float().clone()
            err = (x[: min(n, 2048)].float() - ref).abs().max().item()
            ms = with_config(cfg, lambda: time_ms(sweep, setup, reps=reps)[0])
            print(f"  cfg {str(cfg):>14}: {ms:7.3f} ms  {gb / ms:6.2f} TB/s eff  max|dg| vs default {err:.2e}",
                  flush=True)
        except Exception as exc:  # a config that does not compile or launch is a result too
            print(f"  cfg {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    rw = time_ms(lambda: [x[s:e].mul_(1.0) for s, e in spans], setup, reps=reps)[0]
    rd = time_ms(lambda: [x[s:e].amax() for s, e in spans], setup, reps=reps)[0]
    print(f"  read+write in place: {rw:.3f} ms ({2 * n * v * 2 / 1e9 / rw:.2f} TB/s); read: {rd:.3f} ms "
          f"({n * v * 2 / 1e9 / rd:.2f} TB/s); 3 sweeps at the r+w rate {rw * 1.5:.3f} ms", flush=True)


def steps(n: int, v: int, names):
    """linear_head_loss fwd+bwd steps by name, their setup, and (hidden, weight)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, H, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, H, device="cuda", generator=gen) / H**0.5 * 2.0).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=gen)
    seq = 1024
    b = n // seq
    gen = torch.Generator(device="cuda").manual_seed(1)
    pol = dict(advantages=torch.randn(b, device="cuda", generator=gen),
               old_logprobs=-torch.rand(b, seq, device="cuda", generator=gen) * 5,
               ref_logprobs=-torch.rand(b, seq, device="cuda", generator=gen) * 5,
               loss_mask=torch.ones(b, seq, device="cuda"))
    th = torch.randn(n, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    tw = (torch.randn(v, H, device="cuda", generator=gen) / H**0.5 * 2.0).to(torch.bfloat16)
    fkl = headloss.LossSpec(cross_entropy=None, distillation={"divergence": "forward_kl"})
    table = {
        "ce": lambda: headloss.linear_head_loss(h, w, y).loss.backward(),
        "full": lambda: headloss.linear_head_loss(h, w, y, FULL).loss.backward(),
        "clip": lambda: headloss.linear_head_loss(h.view(b, seq, H), w, y.view(b, seq), spec_of("clip"),
                                                  **pol).loss.backward(),
        "none": lambda: headloss.linear_head_loss(h, w, y, headloss.LossSpec(reduction="none")).loss.sum().backward(),
        "fkl": lambda: headloss.linear_head_loss(h, w, None, fkl, teacher_hidden=th, teacher_weight=tw).loss.backward(),
    }

    def setup():
        h.grad = w.grad = None

    return {k: table[k] for k in names}, setup, (h, w)


def whole(n: int, v: int, names, rounds: int = 2, reps: int = 7) -> None:
    """Each case at each config, the configs interleaved within a round (the order reversed every other
    round), so that the card's clocks and heat reach every config alike; per config the median over the
    rounds, its ratio to the 3 GEMMs and to the default, and in how many rounds it beat the default."""
    table, setup, (h, w) = steps(n, v, names)
    floor = three_gemms_ms(h, w, reps)
    print(f"== N {n} V {v}: 3 GEMMs {floor:.2f} ms", flush=True)
    for name, step in table.items():
        cfgs = TEACHER_CONFIGS if name == "fkl" else WHOLE_CONFIGS
        ref = None
        for cfg in cfgs:
            with_config(cfg, lambda step=step: (setup(), step()))
            torch.cuda.synchronize()
            g = w.grad.float()
            ref = g if ref is None else ref
            err = ((g - ref).abs().max() / ref.abs().max()).item()
            print(f"  {name:5s} cfg {str(cfg):>13}: dW rel diff vs default {err:.1e}", flush=True)
        times: dict = {cfg: [] for cfg in cfgs}
        for r in range(rounds):
            for cfg in (cfgs if r % 2 == 0 else cfgs[::-1]):
                times[cfg].append(with_config(cfg, lambda step=step: time_ms(step, setup, reps=reps, warmup=1)[0]))
        base = statistics.median(times[None])
        for cfg in cfgs:
            med = statistics.median(times[cfg])
            wins = sum(a < b for a, b in zip(times[cfg], times[None]))
            against = "" if cfg is None else f", faster than default in {wins}/{rounds}"
            print(f"  {name:5s} {str(cfg):>13}: {med:8.2f} ms ({med / floor:.3f}x GEMMs, {med / base:.4f}x default; "
                  f"rounds {min(times[cfg]):.2f}-{max(times[cfg]):.2f}{against})", flush=True)
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--whole", action="store_true", help="linear_head_loss end to end at each config")
    parser.add_argument("--one", metavar="CFG", help="one sweep at CFG, for a profiler")
    parser.add_argument("--rounds", type=int, default=2, help="with --whole: rounds of every config, interleaved")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.one:
        cfg = None if args.one == "default" else tuple(int(t) for t in args.one.split(","))
        isolated(768 * 4, 151936, 768, [cfg], reps=1)
    elif args.whole:
        whole(16384, 151936, ["ce", "full", "clip", "none", "fkl"], args.rounds)
        whole(8192, 128256, ["ce", "full", "fkl"], args.rounds)
    else:
        isolated(16384, 151936, 768, CONFIGS)
        isolated(8192, 128256, 1024, CONFIGS)
        isolated(8192, 128256, 8192, CONFIGS)


if __name__ == "__main__":
    main()
