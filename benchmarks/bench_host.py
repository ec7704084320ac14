"""What one call costs the host: three timings of the same fwd+bwd step, beside Liger-Kernel.

  back-to-back  the host runs ahead of the GPU (do_bench-style loop; the median of events)
  synced        one call at a time: synchronize, call, synchronize (a step that logs with .item(),
                a validation wait, an RL rollout loop); wall time
  host          wall time from the call to its return (the GPU may still be working), then sync
                (synced and host: medians of 100 calls of one provider in a row -- its best case:
                other Python between calls, or another provider's calls interleaved, makes every
                provider's host time longer, the floor's included)
  graph         replay of the step captured in a CUDA graph, back-to-back

Cases (bf16 logits [N, V], 5% of targets ignored): ``ce`` (CE only) and ``full`` (CE + z-loss +
token accuracy + predicted tokens + entropy metric; Liger: its CE with z-loss, accuracy and
predicted tokens, without entropy). N in {512, 1024, 2048, 8192}, V in {32000, 128256, 151936}.
``floor``: an autograd Function with one Triton launch in forward and one in backward, computing
nothing -- what any autograd-based fused loss pays per call on this host (hosts differ ~2x).
``headloss-1t``: the same call inside ``torch.autograd.set_multithreading_enabled(False)``, which
runs the backward on the calling thread (no hand-off to autograd's CUDA device thread).

  python -m benchmarks.bench_host [--rows 1024 8192] [--vocab 32000]
  taskset -c 4,5 python -m benchmarks.bench_host   # the results file: host times vary ~2x run to run unpinned

Writes $OUT (or ./results)/bench_host.{json,csv,png}; prints a table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import headloss
from benchmarks.bench_head import CE_SPEC, FULL_SPEC, IGNORE, Z_WEIGHT, liger_ce_fn
from benchmarks.common import Row, gpu_name, out_dir_default, pyplot, time_ms, write_rows

ROWS = (512, 1024, 2048, 8192)
VOCABS = (32000, 128256, 151936)


def synced_ms(step: Callable[[], object], reps: int = 100) -> float:
    """Median wall time of one call between two synchronisations."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def host_ms(step: Callable[[], object], reps: int = 100) -> float:
    """Median wall time from the call to its return (the GPU may still run), synchronised between calls."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[reps // 2] * 1e3


def graph_ms(step: Callable[[], object]) -> float | None:
    """Back-to-back replay time of ``step`` captured in a CUDA graph (None if capture fails)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as exc:  # a provider that cannot be captured is a result
        print(f"    capture failed: {type(exc).__name__}: {str(exc)[:120]}")
        return None
    p50, _, _ = time_ms(graph.replay, reps=50)
    return p50


@triton.jit
def _one_store(out):
    tl.store(out, 0.0)


class _Floor(torch.autograd.Function):
    """What any autograd-based fused loss pays per call at least: the autograd Function's forward and
    backward, one Triton launch in each, the loss and the N x V gradient allocated (nothing computed)."""

    @staticmethod
    def forward(ctx, logits):
        loss = torch.empty((), dtype=torch.float32, device=logits.device)
        _one_store[(1,)](loss)
        ctx.like = logits
        return loss

    @staticmethod
    def backward(ctx, d_loss):
        grad = torch.empty_like(ctx.like)
        _one_store[(1,)](grad)
        return grad


def providers(case: str) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    spec = FULL_SPEC if case == "full" else CE_SPEC
    liger = liger_ce_fn()

    def ours(x, y):
        x.grad = None
        headloss.head_loss(x, y, spec).loss.backward()

    def floor(x, y):
        x.grad = None
        _Floor.apply(x).backward()

    def ours_one_thread(x, y):  # the backward on the calling thread: no hand-off to autograd's device thread
        with torch.autograd.set_multithreading_enabled(False):
            ours(x, y)

    table = {"headloss": ours}
    if case == "ce":  # (the floor does not depend on the spec)
        table["headloss-1t"] = ours_one_thread
        table["floor"] = floor
    if liger is not None:
        def liger_step(x, y):
            x.grad = None
            if case == "full":
                loss = liger(x, y, None, IGNORE, Z_WEIGHT, 0.0, "mean", None, True, True, True)[0]
            else:
                loss = liger(x, y, None, IGNORE, 0.0, 0.0, "mean", None, False, False, False)[0]
            loss.backward()

        table["liger"] = liger_step
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--cases", nargs="+", default=["ce", "full"])
    parser.add_argument("--no-graph", action="store_true")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    table: list[tuple] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for vocab in args.vocab:
        for n in args.rows:
            x = (torch.randn(n, vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
            y = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
            y[torch.rand(n, device="cuda", generator=gen) < 0.05] = IGNORE
            for case in args.cases:
                for name, fn in providers(case).items():
                    step = lambda fn=fn, x=x, y=y: fn(x, y)  # noqa: E731
                    for _ in range(3):
                        step()  # compile, warm up
                    b2b, _, _ = time_ms(step, reps=50)
                    sync = synced_ms(step)
                    host = host_ms(step)
                    graph = None if args.no_graph else graph_ms(step)
                    config = {"rows": n, "vocab": vocab, "dtype": "bf16"}
                    for metric, value in (("back-to-back", b2b), ("synced", sync), ("host", host), ("graph", graph)):
                        rows.append(Row(case=case, provider=name, metric=metric, unit="ms", x_name="rows", x=n,
                                        p50=value, config=config, gpu=gpu_name()))
                    table.append((case, name, n, vocab, b2b, sync, host, graph))
                    print(f"{case:5s} {name:9s} N={n:5d} V={vocab:6d}  b2b {b2b:7.3f}  synced {sync:7.3f}  "
                          f"host {host:7.3f}  graph {graph if graph is None else round(graph, 3)}", flush=True)
            del x, y
            torch.cuda.empty_cache()
    out = out_dir_default()
    write_rows(rows, out, "bench_host")
    _plot(rows, out / "bench_host.png")
    print(f"\n{'case':5s} {'provider':9s} {'N':>5s} {'V':>6s} {'b2b ms':>8s} {'synced':>8s} {'host':>8s} "
          f"{'graph':>8s} {'sync/b2b':>8s}")
    for case, name, n, vocab, b2b, sync, host, graph in table:
        g = f"{graph:8.3f}" if graph is not None else "       -"
        print(f"{case:5s} {name:9s} {n:5d} {vocab:6d} {b2b:8.3f} {sync:8.3f} {host:8.3f} {g} {sync / b2b:8.2f}")


def _plot(rows: list[Row], path) -> None:
    try:
        plt = pyplot()
    except Exception as exc:
        print(f"no plot: {exc}")
        return
    vocabs = sorted({r.config["vocab"] for r in rows})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(5 * len(vocabs), 4), squeeze=False)
    for ax, vocab in zip(axes[0], vocabs):
        for (case, provider, metric) in sorted({(r.case, r.provider, r.metric) for r in rows}):
            pts = sorted((r.x, r.p50) for r in rows if r.config["vocab"] == vocab and r.case == case
                         and r.provider == provider and r.metric == metric and r.p50 is not None)
            if pts and metric in ("synced", "host", "graph"):
                ax.plot(*zip(*pts), marker="o", label=f"{provider} {case} {metric}",
                        linestyle="-" if provider == "headloss" else "--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"V = {vocab}")
        ax.set_xlabel("rows N")
        ax.set_ylabel("ms per fwd+bwd call")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
