"""The fused lm_head's weight-gradient accumulation ``dW += g.T @ h`` (headloss.dw_gemm): quack-kernels'
Hopper GEMM at fixed configs against cuBLAS's addmm over chunk shapes, and the whole call with each.

  python -m benchmarks.bench_dw_gemm            # configs: quack's autotuner's best four at 768 x 151936 and
                                                # 1024 x 128256 (H 4096), its untuned default and five by
                                                # hand, each timed at chunks of 256-1536 rows of both
                                                # vocabularies (and 768 x 32000, 704 x 151936) against addmm;
                                                # then linear_head_loss fwd+bwd at 16384 x 151936 and
                                                # 8192 x 128256 with dW by cuBLAS, by quack untuned and at
                                                # the best config (three rounds)
  python -m benchmarks.bench_dw_gemm --costs    # quack's first call (compile, autotune) and its memory,
                                                # untuned and tuned, at 768 and 256 rows of V 151936

Needs quack-kernels (CuTe-DSL) and a Hopper GPU. Prints its results (kept as benchmarks/results/*.log);
``--costs`` and the config sweep write $OUT (or ./results)/best_config.txt (the best config's repr).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

import headloss
from benchmarks.common import dw_gemm_forced, out_dir_default, three_gemms_ms, time_ms
from headloss import dw_gemm

H = 4096


def config(tile_m, tile_n, pingpong, cluster_m, cluster_n, swap_ab=False):
    from quack.gemm_config import GemmConfig

    return GemmConfig(tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=cluster_m, cluster_n=cluster_n,
                      swap_ab=swap_ab, device_capacity=9, is_dynamic_persistent=False, use_tma_gather=False)


def fixed(cfg, a, b, out):
    """out += a @ b by quack's GEMM at ``cfg`` (as headloss.dw_gemm calls it)."""
    from quack.gemm_interface import gemm_tuned

    gemm_tuned.fn(a, b, out, None, alpha=1.0, beta=1.0, add_to_output=True, config=cfg)


def tensors(k, v, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = torch.randn(k, v, device="cuda", generator=gen, dtype=torch.bfloat16)
    h = torch.randn(k, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    dw = torch.randn(v, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    return g, h, dw


def tuned_best(k, v):
    """quack's autotuner at one chunk shape: its five fastest configs printed, the best four returned."""
    from quack.gemm_interface import gemm_add_inplace, gemm_tuned

    g, h, dw = tensors(k, v)
    t = time.time()
    gemm_add_inplace(g.t(), h, dw)
    torch.cuda.synchronize()
    timings = sorted(gemm_tuned.configs_timings.items(), key=lambda kv: kv[1][0])
    print(f"autotune K {k} V {v}: {time.time() - t:.1f} s; best five:", flush=True)
    for c, tm in timings[:5]:
        print(f"   {tm[0]:.3f} ms  {c}", flush=True)
    return [c.kwargs["config"] for c, _ in timings[:4]]


def sweep():
    """Each candidate config at every chunk shape of the grid, x cuBLAS's addmm; the best one by the mean."""
    from quack.gemm_config import _default_config_for_cap

    cands = {"default": _default_config_for_cap(9)}
    for k, v in ((768, 151936), (1024, 128256)):
        for c in tuned_best(k, v):
            cands[str(c)] = c
    for c in (config(128, 256, False, 2, 1), config(256, 128, False, 2, 1), config(256, 192, False, 2, 1),
              config(128, 192, True, 2, 1), config(256, 208, False, 1, 2)):
        cands.setdefault(str(c), c)
    for i, name in enumerate(cands):
        print(f"  [{i}] {name}", flush=True)
    grid = [(k, v) for v in (151936, 128256) for k in (256, 512, 640, 768, 1024, 1536)] + [(768, 32000),
                                                                                          (704, 151936)]
    totals = {name: 0.0 for name in cands}
    for k, v in grid:
        for name, ratio in grid_row(cands, k, v).items():
            totals[name] += ratio
        torch.cuda.empty_cache()
    print("candidates (x cuBLAS summed over the grid):", flush=True)
    for name, tot in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"  {tot / len(grid):.3f}  {name}", flush=True)
    best = min(totals, key=totals.get)
    out = out_dir_default()
    out.mkdir(parents=True, exist_ok=True)
    (out / "best_config.txt").write_text(repr(cands[best]))
    return cands[best]


def grid_row(cands: dict, k: int, v: int) -> dict[str, float]:
    """One chunk shape: addmm's time, each config's (inf where it fails or errs), printed; each x addmm."""
    g, h, dw0 = tensors(k, v, seed=k)
    ref = torch.addmm(dw0, g.t(), h).float()
    dw = dw0.clone()
    cub = time_ms(lambda: dw.addmm_(g.t(), h), reps=15)[0]
    line, ratios = [f"cuBLAS {cub:.3f}"], {}
    for name, c in cands.items():
        try:
            dw.copy_(dw0)
            fixed(c, g.t(), h, dw)
            torch.cuda.synchronize()
            err = ((dw.float() - ref).abs().max() / ref.abs().max()).item()
            ms = time_ms(functools.partial(fixed, c, g.t(), h, dw), reps=15)[0]
            if err > 1e-2:
                ms = float("inf")
        except Exception as exc:  # a config that does not run here
            print(f"   {name}: {type(exc).__name__} {str(exc)[:120]}", flush=True)
            ms = float("inf")
        ratios[name] = ms / cub
        line.append(f"{ms:.3f}")
    print(f"K {k:5d} V {v:6d}: " + " | ".join(line), flush=True)
    return ratios


def whole_calls(best):
    """linear_head_loss fwd+bwd with dW by cuBLAS, quack untuned, quack at ``best``: three rounds."""
    from quack.gemm_interface import gemm_add_inplace

    pinned = lambda a, b, out: fixed(best, a, b, out)  # noqa: E731
    untuned = functools.partial(gemm_add_inplace, tuned=False)
    original = dw_gemm.quack_gemm_add
    try:
        for n, v in ((16384, 151936), (8192, 128256)):
            whole_call_rounds(n, v, (("cublas", None), ("untuned", untuned), ("pinned", pinned)))
            torch.cuda.empty_cache()
    finally:
        dw_gemm.quack_gemm_add = original


def whole_call_rounds(n: int, v: int, variants) -> None:
    """linear_head_loss fwd+bwd at N x V with each (name, dW function or None for cuBLAS), three rounds; the
    first round prints each variant's dW against the first's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, H, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, H, device="cuda", generator=gen) / H**0.5 * 2.0).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=gen)

    def setup():
        h.grad = w.grad = None

    def step():
        headloss.linear_head_loss(h, w, y).loss.backward()

    floor = three_gemms_ms(h, w)
    ref = None
    for r in range(3):
        line = []
        for name, fn in variants:
            dw_gemm.quack_gemm_add = lambda major, fn=fn: fn
            with dw_gemm_forced("cublas" if fn is None else "quack"):
                if r == 0:
                    setup()
                    step()
                    g = w.grad.float()
                    ref = g if ref is None else ref
                    line.append(f"{name} dW rel diff {((g - ref).abs().max() / ref.abs().max()).item():.1e}")
                ms = time_ms(step, setup, reps=7)[0]
            line.append(f"{name}: {ms:.2f} ({ms / floor:.3f}x)")
        print(f"== N {n} V {v} floor {floor:.2f}, round {r}: " + "; ".join(line), flush=True)


def costs():
    """quack's first call and the memory it takes, untuned and autotuned, at 768 and 256 rows of V 151936."""
    for k in (768, 256):
        cost_rows(k, 151936)
        torch.cuda.empty_cache()


def cost_rows(k: int, v: int) -> None:
    from quack.gemm_interface import gemm_add_inplace

    g, h, dw0 = tensors(k, v, seed=k)
    dw = dw0.clone()
    ref = torch.addmm(dw0, g.t(), h)
    for tuned in (False, True):
        dw.copy_(dw0)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.time()
        gemm_add_inplace(g.t(), h, dw, tuned=tuned)
        torch.cuda.synchronize()
        first = time.time() - t
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        err = ((dw.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        ms = time_ms(functools.partial(gemm_add_inplace, g.t(), h, dw, tuned=tuned), reps=20)[0]
        print(f"  quack K {k} tuned={tuned}: first call {first:.1f} s, peak extra {peak:.2f} GiB, "
              f"{ms:.3f} ms, rel err vs addmm {err:.1e}", flush=True)
    ms = time_ms(lambda: dw.addmm_(g.t(), h), reps=20)[0]
    print(f"  cuBLAS addmm_ K {k}: {ms:.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", action="store_true", help="quack's first-call costs only")
    args = parser.parse_args()
    os.environ.setdefault("QUACK_PRINT_AUTOTUNING", "0")
    if args.costs:
        costs()
        return
    whole_calls(sweep())


if __name__ == "__main__":
    main()
