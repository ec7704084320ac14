"""Fused lm_head + loss, fwd+bwd, bf16: headloss vs Liger's fused linear CE, cut-cross-entropy,
quack-kernels' chunked linear cross-entropy (where installed), torch eager and the 3 bare cuBLAS GEMMs
(the floor), in one run.

  python -m benchmarks.bench_linear              # H=4096; N in {2048, 8192, 32768} at V=128256,
                                                 # V in {32000, 151936} at N=8192, chunk sweep, dW accuracy
  python -m benchmarks.bench_linear --frontier 16384 151936 --stem bench_linear_frontier
                                                 # time against peak memory at one shape: the chunk
                                                 # budgets beside the floor and the peers
                                                 # (--dw-gemm: each budget again with dW accumulated
                                                 # by cuBLAS and by quack, beside the default's pick)
  python -m benchmarks.bench_linear --frontier 16384 151936 --main-grad --budgets 256 1024 1408
                                                 # the caller's fp32 main_grad given (Megatron's gradient
                                                 # accumulation fusion): the scalar loss and the per-token
                                                 # loss at each budget, against the 3 GEMMs accumulating
                                                 # dW into an fp32 main_grad

Writes $OUT (or ./results)/bench_linear.{json,csv,png}; prints a table with the ratio to the GEMM
floor and the peak memory above the inputs (gradients dW and dh included, for every provider).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

import headloss
from benchmarks.common import Row, dw_gemm_forced, measure, out_dir_default, pyplot, write_rows
from headloss import linear_head_loss

IGNORE = -100
FULL_SPEC = headloss.LossSpec(
    z_loss={"weight": 1e-4}, entropy={"weight": 0.0}, token_accuracy=True, outputs=("predicted_tokens",)
)


def make_inputs(n: int, h: int, v: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5 * 2.0).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


QUACK_LCE_ROWS = (1024, 2048, 8192)
"""quack-kernels' chunk rows. Its default, 4096, is left out: 0.6.5 raises where a chunk's rows equal H
(``operand 'v': m == n``), which 4096-row chunks do at H 4096."""


def providers() -> dict[str, Callable]:
    table: dict[str, Callable] = {}

    def gemms(h, w, y):
        with torch.no_grad():
            logits = h @ w.t()
            h.grad = logits @ w
            w.grad = logits.t() @ h

    table["3-gemm-floor"] = gemms

    def eager(h, w, y):
        F.cross_entropy((h @ w.t()).float(), y, ignore_index=IGNORE).backward()

    table["torch-eager"] = eager
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def liger(h, w, y):
            LigerFusedLinearCrossEntropyFunction.apply(h, w, y, None, None, IGNORE)[0].backward()

        table["liger-flce"] = liger
    except Exception as exc:
        print(f"liger-kernel unavailable: {exc}")
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce(h, w, y):
            linear_cross_entropy(h, w, y, ignore_index=IGNORE).backward()

        table["cce"] = cce
    except Exception as exc:
        print(f"cut-cross-entropy unavailable: {exc}")

    try:
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        def quack_lce(rows):
            def step(h, w, y):  # (its scaled-exp pipeline where eligible: Hopper, bf16, V % 128 == 0; fp32 dW)
                chunked_linear_cross_entropy(h, w, y, chunk_size=rows, ignore_index=IGNORE).backward()

            return step

        for rows in QUACK_LCE_ROWS:
            table[f"quack-lce chunk={rows}"] = quack_lce(rows)
    except Exception as exc:
        print(f"quack-kernels' linear cross-entropy unavailable: {exc}")

    def ours(spec, **kw):
        def step(h, w, y):
            linear_head_loss(h, w, y, spec, **kw).loss.backward()

        return step

    table["headloss"] = ours(headloss.LossSpec())
    table["headloss-full"] = ours(FULL_SPEC)
    return table


def run(rows: list[Row], case: str, n: int, h: int, v: int, names: list[str] | None, extra: dict | None = None):
    hidden, weight, targets = make_inputs(n, h, v)

    def setup():
        hidden.grad = None
        weight.grad = None

    table = providers()
    table.update(extra or {})
    for name, fn in table.items():
        if names and name not in names:
            continue
        measure(rows, case, name, "N" if case in ("sweep-N", "frontier") else "V",
                n if case in ("sweep-N", "frontier") else v,
                lambda fn=fn: fn(hidden, weight, targets), setup, config={"N": n, "H": h, "V": v}, cold_blas=True)
        torch.cuda.empty_cache()


FRONTIER_MIB = (128, 192, 256, 384, 512, 1024, 2048)
DW_MIB = (256, 384, 1024)


def frontier(rows: list[Row], n: int, v: int, h: int, dw_gemm: bool = False, budgets=None) -> None:
    """The chunk budget's trade at one shape: headloss at each budget (its peak memory counts dW and
    dh), the 3 GEMMs and the peers, one run; ``dw_gemm``: also each budget with dW accumulated by cuBLAS's
    addmm and by quack-kernels' GEMM (dw_gemm.DW_GEMM), beside the default's choice (``auto``: quack where
    it is installed and runs). ``budgets`` (MiB): these budgets only (default FRONTIER_MIB, and DW_MIB for
    the forced GEMMs)."""
    extra = {f"headloss chunk={mib}MiB": (lambda h_, w_, y_, mib=mib: linear_head_loss(
        h_, w_, y_, chunk_bytes=mib << 20).loss.backward()) for mib in budgets or FRONTIER_MIB}
    if dw_gemm:
        for impl in ("cublas", "quack"):
            extra.update({f"headloss dW={impl} chunk={mib}MiB": (lambda h_, w_, y_, mib=mib, impl=impl: _with_dw_gemm(
                impl, lambda: linear_head_loss(h_, w_, y_, chunk_bytes=mib << 20).loss.backward()))
                for mib in budgets or DW_MIB})
    peers = ["liger-flce", "cce", *(f"quack-lce chunk={r}" for r in QUACK_LCE_ROWS)]
    run(rows, "frontier", n, h, v, ["3-gemm-floor", *peers, *extra], extra)


def main_grad_frontier(rows: list[Row], n: int, v: int, h: int, budgets=None) -> None:
    """``weight_grad="main_grad"`` (Megatron's gradient accumulation fusion) at each budget: the scalar CE
    (gradients computed in forward, dW added into main_grad in backward) and the per-token CE summed (deferred:
    each chunk's dW goes into main_grad, no dW buffer), each beside the same call without main_grad; the
    floor is the 3 GEMMs with dW accumulated into the fp32 main_grad, as Megatron's fused wgrad GEMM does.
    main_grad is the caller's buffer, allocated before the measurement (not in the peak)."""
    main_grad = torch.zeros(v, h, dtype=torch.float32, device="cuda")
    per_token = headloss.LossSpec(reduction="none")

    def with_main_grad(w):  # (no grad_added_to_main_grad: autograd gets None, not Megatron's V x H dummy,
        w.main_grad = main_grad  # which its DDP hook would drop at once)
        return w

    def floor(h_, w_, y_):
        with torch.no_grad():
            logits = h_ @ w_.t()
            h_.grad = logits @ w_
            torch.addmm(main_grad, logits.t(), h_, out_dtype=torch.float32, out=main_grad)

    extra: dict[str, Callable] = {"3-gemm-floor main_grad": floor}
    for mib in budgets or (256, 1024):
        extra[f"headloss chunk={mib}MiB"] = lambda h_, w_, y_, mib=mib: linear_head_loss(
            h_, w_, y_, chunk_bytes=mib << 20).loss.backward()
        extra[f"headloss main_grad chunk={mib}MiB"] = lambda h_, w_, y_, mib=mib: linear_head_loss(
            h_, with_main_grad(w_), y_, chunk_bytes=mib << 20, weight_grad="main_grad").loss.backward()
        extra[f"headloss per-token chunk={mib}MiB"] = lambda h_, w_, y_, mib=mib: linear_head_loss(
            h_, w_, y_, per_token, chunk_bytes=mib << 20).loss.sum().backward()
        extra[f"headloss per-token main_grad chunk={mib}MiB"] = lambda h_, w_, y_, mib=mib: linear_head_loss(
            h_, with_main_grad(w_), y_, per_token, chunk_bytes=mib << 20, weight_grad="main_grad").loss.sum().backward()
    run(rows, "frontier", n, h, v, ["3-gemm-floor", "liger-flce", *extra], extra)


def _with_dw_gemm(impl: str, step: Callable) -> None:
    """``step`` with dW accumulated by ``impl`` (dw_gemm.DW_GEMM: cublas or quack)."""
    with dw_gemm_forced(impl):
        step()


def dw_accuracy(rows: list[Row], n: int, h: int, v: int) -> None:
    """Relative error of dW and dh against fp64, per provider (bf16 inputs)."""
    hidden, weight, targets = make_inputs(n, h, v, seed=1)
    with torch.no_grad():
        h64, w64 = hidden.double(), weight.double()
        logits = h64 @ w64.t()
        g = torch.softmax(logits, dim=-1)
        del logits
        g[torch.arange(n, device="cuda"), targets] -= 1.0
        g /= n
        ref_dw, ref_dh = g.t() @ h64, g @ w64
        del g
    cases = {
        "headloss (bf16 dW accumulation)": lambda: linear_head_loss(hidden, weight, targets).loss.backward(),
        "headloss (fp32 dW accumulation)": lambda: linear_head_loss(
            hidden, weight, targets, fp32_weight_grad=True).loss.backward(),
    }
    table = providers()
    for peer in ("liger-flce", "cce", f"quack-lce chunk={QUACK_LCE_ROWS[0]}", "torch-eager"):
        if peer in table:
            cases[peer] = lambda peer=peer: table[peer](hidden, weight, targets)
    for name, step in cases.items():
        hidden.grad = weight.grad = None
        step()
        for what, got, ref in (("dW", weight.grad, ref_dw), ("dh", hidden.grad, ref_dh)):
            err = ((got.double() - ref).norm() / ref.norm()).item()
            rows.append(Row(case="accuracy", provider=name, metric=f"rel_err_{what}", unit="", x_name="N", x=n,
                            p50=err, config={"N": n, "H": h, "V": v}))


def print_table(rows: list[Row]) -> None:
    floor = {(r.case, r.x): r.p50 for r in rows if r.provider == "3-gemm-floor" and r.metric == "time"}
    mem = {(r.case, r.provider, r.x): r.p50 for r in rows if r.metric == "memory"}
    print(f"\n{'case':<10}{'x':>8}  {'provider':<36}{'p50 ms':>9}{'x GEMMs':>9}{'peak GB':>9}{'GiB':>7}  note")
    for r in rows:
        if r.metric != "time":
            continue
        t = f"{r.p50:9.2f}" if r.p50 is not None else f"{'-':>9}"
        f = floor.get((r.case, r.x))
        ratio = f"{r.p50 / f:9.3f}" if r.p50 is not None and f else f"{'-':>9}"
        m = mem.get((r.case, r.provider, r.x))
        ms = f"{m:9.3f}{m * 1e9 / 2**30:7.3f}" if m is not None else f"{'-':>9}{'-':>7}"
        print(f"{r.case:<10}{r.x:>8}  {r.provider:<36}{t}{ratio}{ms}  {r.note}")
    acc = [r for r in rows if r.case == "accuracy"]
    if acc:
        print(f"\nrelative error against fp64 (N = {acc[0].x}):")
        for r in acc:
            print(f"  {r.provider:<36}{r.metric:<12}{r.p50:.2e}")


def plot(rows: list[Row], path) -> None:
    plt = pyplot()

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    sweep = [r for r in rows if r.case == "sweep-N" and r.p50 is not None]
    for prov in sorted({r.provider for r in sweep}):
        for ax, metric in ((ax_t, "time"), (ax_m, "memory")):
            pts = sorted((r.x, r.p50) for r in sweep if r.provider == prov and r.metric == metric)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=prov)
    for ax, label in ((ax_t, "fwd+bwd ms (median)"), (ax_m, "peak memory above inputs (GB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_title("lm_head + CE, H=4096, V=128256, bf16")
    ax_m.set_title("memory (dW and dh included)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--providers", nargs="*")
    parser.add_argument("--no-sweep-chunks", action="store_true")
    parser.add_argument("--stem", default="bench_linear")
    parser.add_argument("--frontier", type=int, nargs=2, metavar=("N", "V"),
                        help="only the time / memory frontier of the chunk budgets at N rows, V words")
    parser.add_argument("--dw-gemm", action="store_true",
                        help="with --frontier: each budget again with dW accumulated by cuBLAS and by quack")
    parser.add_argument("--main-grad", action="store_true",
                        help="with --frontier: weight_grad='main_grad' at each budget (the caller's fp32 main_grad)")
    parser.add_argument("--budgets", type=int, nargs="+", metavar="MIB",
                        help="with --frontier: only these chunk budgets (MiB)")
    args = parser.parse_args()
    rows: list[Row] = []
    h = args.hidden
    if args.frontier:
        if args.main_grad:
            main_grad_frontier(rows, *args.frontier, h, budgets=args.budgets)
        else:
            frontier(rows, *args.frontier, h, dw_gemm=args.dw_gemm, budgets=args.budgets)
        out = out_dir_default()
        js, cs = write_rows(rows, out, args.stem)
        print_table(rows)
        print(f"\nwrote {js}, {cs}")
        return
    for n in args.rows:
        run(rows, "sweep-N", n, h, 128256, args.providers)
    for v in args.vocab:
        run(rows, "sweep-V", 8192, h, v, args.providers)
    if not args.no_sweep_chunks:
        extra = {}
        for mib in (32, 64, 96, 128, 192, 256, 512):  # 128, 256, 384, 512, 768, 1024, 2048 rows
            extra[f"headloss chunk={mib}MiB"] = (
                lambda h_, w_, y_, mib=mib: linear_head_loss(h_, w_, y_, chunk_bytes=mib << 20).loss.backward()
            )
        extra["headloss-full chunk=128MiB"] = lambda h_, w_, y_: linear_head_loss(
            h_, w_, y_, FULL_SPEC, chunk_bytes=128 << 20).loss.backward()
        extra["headloss fp32-dW"] = lambda h_, w_, y_: linear_head_loss(
            h_, w_, y_, fp32_weight_grad=True).loss.backward()
        run(rows, "chunks", 8192, h, 128256, ["3-gemm-floor", *extra], extra)
    dw_accuracy(rows, 8192, h, 128256)
    out = out_dir_default()
    js, cs = write_rows(rows, out, args.stem)
    plot(rows, out / f"{args.stem}.png")
    print_table(rows)
    print(f"\nwrote {js}, {cs}, {out / (args.stem + '.png')}")


if __name__ == "__main__":
    main()
