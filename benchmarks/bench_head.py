"""headloss vs torch eager, torch.compile and Liger-Kernel on the logits, fwd+bwd, one run.

Cases (bf16 logits [N, V], 5% of targets ignored):
  full     CE + z-loss + token accuracy + predicted tokens + entropy (metric)
  ce       CE only
Every provider computes the same values; Liger has no entropy, so it gets a chunked entropy
pass (no grad) before its CE, which overwrites the logits with their gradient.

  python -m benchmarks.bench_head                      # N=8192, V in {32000,128256,151936,262144}
  python -m benchmarks.bench_head --vocab 128256 --tune   # also sweep BLOCK_V x num_warps

Writes $OUT (or ./results)/bench_head.{json,csv,png} and prints a table with the ratio to the
bandwidth floor: 2 reads + 1 write of the logits at the measured copy rate.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

import headloss
from benchmarks.common import Row, copy_bandwidth_gbs, measure, out_dir_default, pyplot, write_rows
from headloss.kernels.launch import LAUNCH_OVERRIDES

IGNORE = -100
Z_WEIGHT = 1e-4

FULL_SPEC = headloss.LossSpec(
    cross_entropy={"weight": 1.0},
    z_loss={"weight": Z_WEIGHT},
    entropy={"weight": 0.0},
    token_accuracy=True,
    outputs=("predicted_tokens",),
)
CE_SPEC = headloss.LossSpec()


# --- the same computation in plain torch ------------------------------------------------------


def torch_full(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """CE + z-loss (differentiable), accuracy, argmax, entropy (metrics) the way a trainer writes it."""
    xf = x.float()
    valid = y != IGNORE
    n = valid.sum().clamp(min=1)
    lse = torch.logsumexp(xf, dim=-1)
    ce = F.cross_entropy(xf, y, ignore_index=IGNORE, reduction="sum") / n
    z = ((lse * lse) * valid).sum() / n
    loss = ce + Z_WEIGHT * z
    with torch.no_grad():
        logp = torch.log_softmax(xf, dim=-1)
        entropy = (-(logp.exp() * logp).sum(-1) * valid).sum() / n
        pred = torch.where(valid, xf.argmax(-1), -1)
        acc = ((pred == y) & valid).sum() / n
    return loss, z, entropy, acc, pred


def torch_ce(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(x.float(), y, ignore_index=IGNORE)


def chunked_entropy(x: torch.Tensor, y: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The extra pass a Liger user pays for the entropy metric."""
    valid = y != IGNORE
    total = torch.zeros((), device=x.device)
    with torch.no_grad():
        for xc, vc in zip(x.split(chunk), valid.split(chunk)):
            logp = torch.log_softmax(xc.float(), dim=-1)
            total += (-(logp.exp() * logp).sum(-1) * vc).sum()
    return total / valid.sum().clamp(min=1)


def liger_ce_fn() -> Callable | None:
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except Exception as exc:  # not installed: the table says so
        print(f"liger-kernel unavailable: {exc}")
        return None
    return LigerCrossEntropyFunction.apply


# --- providers --------------------------------------------------------------------------------


Step = Callable[[torch.Tensor, torch.Tensor], object]


def providers(case: str, compile_cache: dict, with_compile: bool) -> dict[str, Step]:
    """name -> step(x, y) running forward + backward for ``case``."""
    liger = liger_ce_fn()
    spec = FULL_SPEC if case == "full" else CE_SPEC

    def eager(x, y):
        out = torch_full(x, y) if case == "full" else (torch_ce(x, y),)
        out[0].backward()

    def compiled(x, y):
        key = case
        if key not in compile_cache:
            compile_cache[key] = torch.compile(torch_full if case == "full" else torch_ce)
        out = compile_cache[key](x, y)
        (out[0] if isinstance(out, tuple) else out).backward()

    def liger_step(x, y):
        if case == "full":
            chunked_entropy(x.detach(), y)
            loss, _z, _acc, _pred = liger(x, y, None, IGNORE, Z_WEIGHT, 0.0, "mean", None, True, True, True)
        else:
            loss = liger(x, y, None, IGNORE, 0.0, 0.0, "mean", None, False, False, False)[0]
        loss.backward()

    def ours(inplace: bool, validate: bool = True):
        def step(x, y):
            headloss.head_loss(x, y, spec, inplace_grad=inplace, validate=validate).loss.backward()

        return step

    table = {"torch-eager": eager, **({"torch-compile": compiled} if with_compile else {})}
    if liger is not None:
        table["liger" + ("+entropy" if case == "full" else "")] = liger_step
    table["headloss"] = ours(inplace=True)
    table["headloss-outofplace"] = ours(inplace=False)
    table["headloss-novalidate"] = ours(inplace=True, validate=False)
    return table


def make_batch(rows: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen) * 2.0
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    targets[torch.rand(rows, device="cuda", generator=gen) < 0.05] = IGNORE
    return logits, targets


def restorable_leaf(pristine: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A leaf to run steps on, and the setup that restores it (in-place gradients destroy it)."""
    x = torch.empty_like(pristine).requires_grad_()

    def setup():
        x.grad = None
        with torch.no_grad():
            x.copy_(pristine)

    return x, setup


def run_case(
    rows_out: list[Row], case: str, n: int, vocab: int, names: list[str] | None, cfg: dict, with_compile: bool
) -> None:
    pristine, targets = make_batch(n, vocab)
    x, setup = restorable_leaf(pristine)
    compile_cache: dict = {}
    for name, fn in providers(case, compile_cache, with_compile).items():
        if names and name not in names:
            continue
        measure(rows_out, case, name, "V", vocab, lambda fn=fn: fn(x, targets), setup, config={**cfg, "N": n})
        torch.cuda.empty_cache()


def tune(rows_out: list[Row], n: int, vocab: int) -> None:
    """Sweep the launch configuration of the full case."""
    pristine, targets = make_batch(n, vocab)
    x, setup = restorable_leaf(pristine)

    def step():
        headloss.head_loss(x, targets, FULL_SPEC, inplace_grad=True).loss.backward()

    for block in (512, 1024, 2048, 4096):
        for warps in (2, 4, 8):
            LAUNCH_OVERRIDES.update(block_v=block, num_warps=warps)
            measure(rows_out, "tune-full", f"headloss[B={block},w={warps}]", "V", vocab, step, setup,
                    config={"N": n, "BLOCK_V": block, "num_warps": warps})
    LAUNCH_OVERRIDES.update(block_v=None, num_warps=None)


def floor_ms(n: int, vocab: int, copy_gbs: float) -> float:
    return 3 * n * vocab * 2 / (copy_gbs * 1e9) * 1e3


def print_table(rows: list[Row], copy_gbs: float, n: int) -> None:
    mem = {(r.case, r.provider, r.x): r.p50 for r in rows if r.metric == "memory"}
    print(f"\ncopy rate {copy_gbs:.0f} GB/s; floor = 2 reads + 1 write of bf16 [N={n}, V] at that rate")
    print(f"{'case':<12}{'V':>8}  {'provider':<30}{'p50 ms':>9}{'x floor':>9}{'extra GB':>10}  note")
    for r in rows:
        if r.metric != "time":
            continue
        t = f"{r.p50:9.3f}" if r.p50 is not None else f"{'-':>9}"
        ratio = f"{r.p50 / floor_ms(n, r.x, copy_gbs):9.2f}" if r.p50 is not None else f"{'-':>9}"
        m = mem.get((r.case, r.provider, r.x))
        ms = f"{m:10.3f}" if m is not None else f"{'-':>10}"
        print(f"{r.case:<12}{r.x:>8}  {r.provider:<30}{t}{ratio}{ms}  {r.note}")


def plot(rows: list[Row], copy_gbs: float, n: int, path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, case in zip(axes, ("full", "ce")):
        times = [r for r in rows if r.case == case and r.metric == "time" and r.p50 is not None]
        vocabs = sorted({r.x for r in times})
        for prov in sorted({r.provider for r in times}):
            pts = sorted((r.x, r.p50) for r in times if r.provider == prov)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=prov)
        ax.plot(vocabs, [floor_ms(n, v, copy_gbs) for v in vocabs], "k--", label="floor (2R+1W)")
        ax.set_yscale("log")
        ax.set_xlabel("vocabulary V")
        ax.set_ylabel("fwd+bwd ms (median)")
        ax.set_title(f"{case}: N={n}, bf16" + (" (CE+z+acc+argmax+entropy)" if case == "full" else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256, 151936, 262144])
    parser.add_argument("--cases", nargs="+", default=["full", "ce"], choices=["full", "ce"])
    parser.add_argument("--providers", nargs="*", help="subset of provider names")
    parser.add_argument("--tune", action="store_true", help="sweep BLOCK_V x num_warps on the full case")
    parser.add_argument("--compile-vocab", type=int, nargs="*", default=[128256],
                        help="vocab sizes at which torch.compile is timed (each costs a compile)")
    parser.add_argument("--stem", default="bench_head")
    args = parser.parse_args()

    copy_gbs = copy_bandwidth_gbs()
    rows: list[Row] = []
    cfg = {"dtype": "bf16", "copy_GBps": round(copy_gbs, 1), "headloss": headloss.__version__}
    if args.tune:
        tune(rows, args.rows, 128256)
    for vocab in args.vocab:
        for case in args.cases:
            run_case(rows, case, args.rows, vocab, args.providers, cfg, vocab in args.compile_vocab)
    out = out_dir_default()
    js, cs = write_rows(rows, out, args.stem)
    plot(rows, copy_gbs, args.rows, out / f"{args.stem}.png")
    print_table(rows, copy_gbs, args.rows)
    print(f"\nwrote {js}, {cs}, {out / (args.stem + '.png')}")


if __name__ == "__main__":
    main()
