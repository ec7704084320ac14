"""Where the fused lm_head's time goes, per chunk size: each GEMM and the head kernel, summed over
all chunks of N rows, and the variants tried for the small-chunk GEMMs.

  python -m benchmarks.profile_linear [--rows 8192] [--hidden 4096] [--vocab 128256]
                                      [--chunks 256 320 384 512 1024] [--dw-gemm] [--no-variants]

``--dw-gemm``: also quack-kernels' GEMM for the dW accumulation (the sweep, and the whole call with
``dw_gemm.DW_GEMM["impl"] = "quack"``, its kernels listed; the other whole calls force ``cublas``);
``--no-variants``: only the chunk loop's own ops (no cuBLASLt, kernel launch configs, split-K or streams).

Every number is the median (CUDA events, 10 runs) of one whole sweep over the N rows, so each
op is timed at the shape and the memory traffic the chunked loop gives it. Writes
$OUT (or ./results)/profile_linear.{json,csv} and prints a table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import headloss
from benchmarks.common import (
    Row,
    dw_gemm_forced,
    gpu_name,
    kernel_device_us,
    launch_forced,
    out_dir_default,
    peak_extra_gb,
    time_ms,
    write_rows,
)
from headloss.api import linear_head_loss
from headloss.chunks import chunk_rows_for
from headloss.dw_gemm import quack_gemm_add
from headloss.linear import chunk_head_
from headloss.plan import compile_plan


def blas(name: str) -> None:
    torch.backends.cuda.preferred_blas_library(name)


def split_k_dh(g: torch.Tensor, w: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    """out = g @ w with the V reduction cut into ``splits`` batched GEMMs summed in fp32."""
    c, v = g.shape
    part = torch.bmm(g.view(c, splits, v // splits).transpose(0, 1), w.view(splits, v // splits, -1),
                     out_dtype=torch.float32)
    out.copy_(part.sum(0))


KERNEL_CONFIGS = ["2048,4", "2048,8", "4096,8", "8192,16"]


def with_launch(block: int, warps: int, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the head kernel's block size and warps forced."""
    def run() -> None:
        with launch_forced(block, warps):
            step()

    return run


def kernel_totals(step: Callable[[], None], reps: int = 3) -> dict[str, tuple[float, float]]:
    """Per kernel name: (device ms, launches) per call of ``step``."""
    return {name: (sum(us) / 1e3 / reps, len(us) / reps) for name, us in kernel_device_us(step, reps).items()}


@torch.no_grad()
def gemm_floor_ms(hidden: torch.Tensor, weight: torch.Tensor) -> list[float]:
    """The 3 GEMMs of an lm_head forward + backward on the whole batch, each timed alone."""
    logits = hidden @ weight.t()
    steps = (lambda: torch.mm(hidden, weight.t(), out=logits), lambda: torch.mm(logits, weight),
             lambda: torch.mm(logits.t(), hidden))
    return [time_ms(f, reps=10)[0] for f in steps]


def ops(hidden, weight, targets, rows: int, dw_gemm: bool = False, variants: bool = True
        ) -> dict[str, Callable[[], None]]:
    """One sweep over all chunks of ``rows`` rows for each op and (``variants``) each variant tried;
    ``dw_gemm``: quack's dW accumulation too."""
    n, h = hidden.shape
    v = weight.shape[0]
    buf = torch.empty(rows, v, dtype=hidden.dtype, device="cuda").normal_()
    dh = torch.empty_like(hidden)
    dw = torch.zeros_like(weight)
    plan = compile_plan(headloss.LossSpec(), has_targets=True)
    starts = range(0, n, rows)
    side = torch.cuda.Stream()

    def sweep(fn):
        def step():
            for s in starts:
                e = min(s + rows, n)
                fn(s, e, buf[: e - s])

        return step

    def two_streams(s, e, g):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.mm(g, weight, out=dh[s:e])
        dw.addmm_(g.t(), hidden[s:e])
        torch.cuda.current_stream().wait_stream(side)

    def chunk_all(s, e, g):
        torch.mm(hidden[s:e], weight.t(), out=g)
        chunk_head_(plan, g, targets[s:e])
        torch.mm(g, weight, out=dh[s:e])
        dw.addmm_(g.t(), hidden[s:e])

    second = torch.empty_like(buf)

    def pipelined():
        """The chunk loop with the next chunk's logits GEMM on a side stream, into a second buffer,
        beside this chunk's head kernel and gradient GEMMs (one chunk of memory more)."""
        main = torch.cuda.current_stream()
        bufs = (buf, second)
        spans = [(s, min(s + rows, n)) for s in starts]
        s0, e0 = spans[0]
        torch.mm(hidden[s0:e0], weight.t(), out=buf[: e0 - s0])
        for i, (s, e) in enumerate(spans):
            g = bufs[i % 2][: e - s]
            if i + 1 < len(spans):
                s1, e1 = spans[i + 1]
                side.wait_stream(main)  # (the buffer's last reader, chunk i - 1's GEMMs, is done)
                with torch.cuda.stream(side):
                    torch.mm(hidden[s1:e1], weight.t(), out=bufs[(i + 1) % 2][: e1 - s1])
            chunk_head_(plan, g, targets[s:e])
            torch.mm(g, weight, out=dh[s:e])
            dw.addmm_(g.t(), hidden[s:e])
            main.wait_stream(side)

    table = {
        "chunk loop (logits, head, dh, dW)": sweep(chunk_all),
        "chunk loop, next logits on a side stream": pipelined,
        "logits h@W^T": sweep(lambda s, e, g: torch.mm(hidden[s:e], weight.t(), out=g)),
        "head kernel (CE, grad in place)": sweep(lambda s, e, g: chunk_head_(plan, g, targets[s:e])),
        "dh = g@W": sweep(lambda s, e, g: torch.mm(g, weight, out=dh[s:e])),
        "dW += g^T@h": sweep(lambda s, e, g: dw.addmm_(g.t(), hidden[s:e])),
        "dW = g^T@h (beta 0, no read of dW)": sweep(lambda s, e, g: torch.mm(g.t(), hidden[s:e], out=dw)),
        "dh || dW (2 streams)": sweep(two_streams),
    }
    if dw_gemm:
        quack = quack_gemm_add(torch.cuda.get_device_capability()[0])
        table["dW += g^T@h [quack, headloss's pinned config]"] = sweep(lambda s, e, g: quack(g.t(), hidden[s:e], dw))
    if not variants:
        for name in ("chunk loop, next logits on a side stream", "dh || dW (2 streams)"):
            del table[name]
        return table
    for cfg in KERNEL_CONFIGS:
        block, warps = cfg.split(",")
        table[f"head kernel {cfg}"] = with_launch(int(block), int(warps), table["head kernel (CE, grad in place)"])
    for splits in (2, 4, 8):
        if v % splits == 0:
            table[f"dh split-K {splits}"] = sweep(lambda s, e, g, k=splits: split_k_dh(g, weight, dh[s:e], k))
    return table


def whole_call(hidden, weight, targets, rows: int, floor_ms: float, record, label: str) -> None:
    """linear_head_loss fwd+bwd at ``rows``-row chunks: time, peak, and the device time of its kernels."""
    v = weight.shape[0]
    h_ = hidden.clone().requires_grad_()
    w_ = weight.clone().requires_grad_()
    chunk_bytes = rows * v * hidden.element_size()
    used = chunk_rows_for(chunk_bytes, v, hidden.element_size())  # cut to the 128-row tile

    def clear():
        h_.grad = w_.grad = None

    def whole():
        clear()
        linear_head_loss(h_, w_, targets, chunk_bytes=chunk_bytes, validate=False).loss.backward()

    whole()
    peak = peak_extra_gb(whole, clear, cold_blas=True)
    ms = time_ms(whole, reps=10)[0]
    record(label, rows, ms, f"{used}-row chunks, {ms / floor_ms:.3f} x GEMMs, "
                            f"peak {peak:.3f} GB = {peak * 1e9 / 2**30:.3f} GiB (cold cuBLAS)")
    totals = kernel_totals(whole, reps=3)
    print(f"        device busy {sum(t for t, _ in totals.values()):.2f} ms of {ms:.2f} ms per call:")
    for name, (t, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"        {t:8.3f} ms in {count:4.0f} launches  {name[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 320, 384, 512, 1024])
    parser.add_argument("--dw-gemm", action="store_true", help="quack-kernels' dW accumulation beside cuBLAS's")
    parser.add_argument("--no-variants", action="store_true", help="only the chunk loop's own ops")
    args = parser.parse_args()
    libs = ("cublas",) if args.no_variants else ("cublas", "cublaslt")
    n, h, v = args.rows, args.hidden, args.vocab
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5 * 2.0).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    rows_out: list[Row] = []

    def record(provider: str, chunk: int, ms: float, note: str = "") -> None:
        rows_out.append(Row(case="profile-linear", provider=provider, metric="time", unit="ms", x_name="chunk_rows",
                            x=chunk, p50=ms, note=note, config={"N": n, "H": h, "V": v}, gpu=gpu_name()))
        print(f"{chunk:>6}  {provider:<40}{ms:9.2f}  {note}", flush=True)

    floor = {}
    for lib in libs:
        blas(lib)
        parts = gemm_floor_ms(hidden, weight)
        floor[lib] = sum(parts)
        record(f"logits, dh, dW alone [{lib}]", n, floor[lib], " + ".join(f"{p:.2f}" for p in parts))
        torch.cuda.empty_cache()

    print(f"\n{'chunk':>6}  {'op':<40}{'ms':>9}")
    for rows in args.chunks:
        for lib in libs:
            blas(lib)
            with torch.no_grad():
                for name, step in ops(hidden, weight, targets, rows, args.dw_gemm and lib == "cublas",
                                      not args.no_variants).items():
                    if lib == "cublaslt" and "kernel" in name:
                        continue
                    try:
                        record(f"{name} [{lib}]", rows, time_ms(step, reps=10)[0])
                    except Exception as exc:  # a variant the library cannot run is a result too
                        print(f"{rows:>6}  {name} [{lib}]: {type(exc).__name__}: {exc}"[:200])
            torch.cuda.empty_cache()
        blas("cublas")
        for impl in ("cublas", "quack") if args.dw_gemm else ("cublas",):
            with dw_gemm_forced(impl):
                whole_call(hidden, weight, targets, rows, floor["cublas"], record,
                           "linear_head_loss fwd+bwd" + (" [dW: quack]" if impl == "quack" else ""))
            torch.cuda.empty_cache()
    out = out_dir_default()
    js, cs = write_rows(rows_out, out, "profile_linear")
    print(f"\nwrote {js}, {cs}")


if __name__ == "__main__":
    main()
