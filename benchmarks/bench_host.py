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
``ce-group`` / ``full-group``: the same calls with ``group=`` a one-rank NCCL process group (started
here), the vocab-parallel call's whole host path -- layout, shard statistics, the all_gather, the
merge -- on one GPU (Liger: LigerVocabParallelCrossEntropy with the same group).
RL-shaped cases, N = B x 256 completion tokens (the model's [B, 257, V] output, TRL's completion ids,
per-sequence advantages, a loss mask ending each sequence at 90%):
  ``grpo``         TRL's dapo loss with a k3 KL on the logits (shift=True; Liger: triton_grpo_loss)
  ``gspo``         the same with sequence-level ratios (TRL's GSPO): deferred mode, the objective and its
                   metrics in two small kernels after the head kernel
  ``score``        per-token log-probs and entropy without gradient (a rollout's scoring pass)
  ``linear``       CE on the fused lm_head, H = 2048, hidden [N, H] (Liger: fused linear CE)
  ``linear-grpo``  the grpo case on the fused lm_head from hidden [B, 257, H]
  ``linear-gspo``  the gspo case on the fused lm_head (chunks of whole sequences, gradient in forward)
``floor``: an autograd Function with one Triton launch in forward and one in backward, computing
nothing -- what any autograd-based fused loss pays per call on this host (hosts differ ~2x).
``headloss-1t``: the same call inside ``torch.autograd.set_multithreading_enabled(False)``, which
runs the backward on the calling thread (no hand-off to autograd's CUDA device thread).
``--handoff``: also a trivial torch backward's host time with the GPU idle and busy, through autograd's
device thread and on the calling thread (rows of case ``handoff``): the hand-off's cost on this host.

  python -m benchmarks.bench_host [--rows 1024 8192] [--vocab 32000] [--cases ce grpo linear] [--handoff]
  taskset -c 4,5 python -m benchmarks.bench_host   # the results file: host times vary ~2x run to run unpinned

Writes $OUT (or ./results)/bench_host.{json,csv,png} (``--name``: another name); prints a table.
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
from benchmarks.bench_terms import grpo_batch
from benchmarks.common import Row, gpu_name, host_ms, out_dir_default, pyplot, time_ms, write_rows

ROWS = (512, 1024, 2048, 8192)
VOCABS = (32000, 128256, 151936)
CASES = ("ce", "full", "ce-group", "full-group", "grpo", "gspo", "score", "linear", "linear-grpo", "linear-gspo")
RL_CASES = ("grpo", "gspo", "score", "linear", "linear-grpo", "linear-gspo")
COMPLETION = 256  # tokens per sequence of the RL-shaped cases
HIDDEN = 2048  # the lm_head cases' hidden size
BETA, EPS = 0.04, 0.2
GRPO_SPEC = headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": BETA, "kl_estimator": "k3",
                                                          "eps_low": EPS, "eps_high": EPS})
GSPO_SPEC = headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "importance_sampling": "sequence",
                                                          "eps_low": 3e-4, "eps_high": 4e-4})
SCORE_SPEC = headloss.LossSpec(cross_entropy=None, outputs=("logprobs", "entropy"))


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


def rl_batch(n: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """The RL-shaped cases' inputs: B = n / COMPLETION sequences (at least 1), bench_terms.grpo_batch's
    logits and policy inputs, and hidden states and an lm_head weight for the lm_head cases."""
    batch, length = max(1, n // COMPLETION), COMPLETION
    logits, ids, adv, old, ref, mask = grpo_batch(seed, batch, length, vocab)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    return dict(
        logits=logits.requires_grad_(), ids=ids, adv=adv, old=old, ref=ref, mask=mask, n_items=mask.sum(),
        hidden=(torch.randn(batch, length + 1, HIDDEN, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        .requires_grad_(),
        weight=(torch.randn(vocab, HIDDEN, device="cuda", generator=gen) * 0.02).to(torch.bfloat16).requires_grad_(),
    )


def rl_providers(case: str, b: dict[str, torch.Tensor], y: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The RL-shaped cases' steps (zero-argument closures over ``b``, ``rl_batch``'s inputs)."""
    x, ids, h, w = b["logits"], b["ids"], b["hidden"], b["weight"]
    policy = dict(advantages=b["adv"], old_logprobs=b["old"], ref_logprobs=b["ref"], loss_mask=b["mask"],
                  num_items_in_batch=b["n_items"])
    table: dict[str, Callable[[], None]] = {}
    if case == "grpo":
        def ours():
            x.grad = None
            headloss.head_loss(x, ids, GRPO_SPEC, shift=True, **policy).loss.backward()

        table["headloss"] = ours
        try:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss

            def liger():
                x.grad = None
                triton_grpo_loss(x, b["old"], b["ref"], ids, b["adv"], b["mask"], temperature=1.0, beta=BETA,
                                 eps_low=EPS, eps_high=EPS, inplace=False, loss_type="dapo", reduce=True,
                                 num_items_in_batch=b["n_items"])[0].backward()

            table["liger"] = liger
        except Exception as exc:  # a missing peer is a result
            print(f"liger grpo unavailable: {exc}")
    elif case == "gspo":
        def ours():
            x.grad = None
            headloss.head_loss(x, ids, GSPO_SPEC, shift=True, advantages=b["adv"], old_logprobs=b["old"],
                               loss_mask=b["mask"]).loss.backward()

        table["headloss"] = ours
    elif case == "score":
        def ours():
            with torch.no_grad():
                out = headloss.head_loss(x, ids, SCORE_SPEC, shift=True)
                out.logprobs, out.entropy  # noqa: B018 (what a scorer reads)

        table["headloss"] = ours
    elif case == "linear":
        flat = h.detach()[:, :-1].reshape(-1, HIDDEN).contiguous().requires_grad_()
        flat_y = y[: flat.shape[0]]

        def ours():
            flat.grad = w.grad = None
            headloss.linear_head_loss(flat, w, flat_y).loss.backward()

        table["headloss"] = ours
        try:
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

            def liger():
                flat.grad = w.grad = None
                LigerFusedLinearCrossEntropyFunction.apply(flat, w, flat_y, None, None, IGNORE)[0].backward()

            table["liger"] = liger
        except Exception as exc:
            print(f"liger fused linear CE unavailable: {exc}")
    elif case == "linear-grpo":
        def ours():
            h.grad = w.grad = None
            headloss.linear_head_loss(h, w, ids, GRPO_SPEC, shift=True, **policy).loss.backward()

        table["headloss"] = ours
    elif case == "linear-gspo":
        def ours():
            h.grad = w.grad = None
            headloss.linear_head_loss(h, w, ids, GSPO_SPEC, shift=True, advantages=b["adv"], old_logprobs=b["old"],
                                      loss_mask=b["mask"]).loss.backward()

        table["headloss"] = ours
    return table


def one_rank_group():
    """torch.distributed's default group, started here with NCCL and one rank if it is not yet."""
    import os
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    return dist.group.WORLD


def providers(case: str) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    spec = FULL_SPEC if case.startswith("full") else CE_SPEC
    group = one_rank_group() if case.endswith("-group") else None
    liger = liger_ce_fn()

    def ours(x, y):
        x.grad = None
        headloss.head_loss(x, y, spec, group=group).loss.backward()

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
    if case == "ce-group":
        try:
            from liger_kernel.transformers import LigerVocabParallelCrossEntropy

            vocab_parallel = LigerVocabParallelCrossEntropy()

            def liger_vp(x, y):
                x.grad = None
                vocab_parallel(x[None], y[None], tp_group=group).mean().backward()

            table["liger"] = liger_vp
        except Exception as exc:  # a missing peer is a result
            print(f"liger vocab-parallel CE unavailable: {exc}")
        return table
    if group is not None:
        return table
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


def handoff_rows(reps: int = 40) -> list[Row]:
    """Host time of a trivial torch backward (``(z * 2).sum()`` of 4 elements), with the GPU idle and
    with it busy (two 8192 x 8192 fp32 matmuls queued first), through autograd's CUDA device thread
    (the default) and on the calling thread (``set_multithreading_enabled(False)``): what autograd's
    hand-off costs on this host, whatever the loss."""
    z = torch.randn(4, device="cuda", requires_grad=True)
    busy = torch.randn(8192, 8192, device="cuda")
    out: list[Row] = []
    for threads in ("multithreaded", "one-thread"):
        for state in ("idle", "busy"):
            times = []
            for _ in range(reps):
                torch.cuda.synchronize()
                if state == "busy":
                    busy @ busy, busy @ busy  # noqa: B018 (queued GPU work)
                start = time.perf_counter()
                with torch.autograd.set_multithreading_enabled(threads == "multithreaded"):
                    (z * 2).sum().backward()
                times.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            p50 = sorted(times)[reps // 2] * 1e3
            out.append(Row(case="handoff", provider=threads, metric=f"host-{state}", unit="ms", x_name="rows", x=4,
                           p50=p50, config={"what": "trivial torch backward"}, gpu=gpu_name()))
            print(f"handoff     {threads:13s} GPU {state}: trivial backward host {p50:.3f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--no-graph", action="store_true")
    parser.add_argument("--name", default="bench_host", help="results file name (default bench_host)")
    parser.add_argument("--handoff", action="store_true",
                        help="also time a trivial torch backward with the GPU idle and busy (autograd's hand-off)")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    table: list[tuple] = []
    if args.handoff:
        rows += handoff_rows()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for vocab in args.vocab:
        for n in args.rows:
            x = (torch.randn(n, vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
            y = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
            y[torch.rand(n, device="cuda", generator=gen) < 0.05] = IGNORE
            batch = rl_batch(n, vocab, seed=1) if set(args.cases) & set(RL_CASES) else None
            for case in args.cases:
                if case in RL_CASES:
                    steps = rl_providers(case, batch, y)
                else:
                    steps = {name: (lambda fn=fn, x=x, y=y: fn(x, y)) for name, fn in providers(case).items()}
                for name, step in steps.items():
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
                    print(f"{case:11s} {name:11s} N={n:5d} V={vocab:6d}  b2b {b2b:7.3f}  synced {sync:7.3f}  "
                          f"host {host:7.3f}  graph {graph if graph is None else round(graph, 3)}", flush=True)
            del x, y, batch
            torch.cuda.empty_cache()
    out = out_dir_default()
    write_rows(rows, out, args.name)
    _plot(rows, out / f"{args.name}.png")
    print(f"\n{'case':11s} {'provider':11s} {'N':>5s} {'V':>6s} {'b2b ms':>8s} {'synced':>8s} {'host':>8s} "
          f"{'graph':>8s} {'sync/b2b':>8s}")
    for case, name, n, vocab, b2b, sync, host, graph in table:
        g = f"{graph:8.3f}" if graph is not None else "       -"
        print(f"{case:11s} {name:11s} {n:5d} {vocab:6d} {b2b:8.3f} {sync:8.3f} {host:8.3f} {g} {sync / b2b:8.2f}")


def _plot(rows: list[Row], path) -> None:
    """One panel per case and vocabulary: synchronised and host time per call against N, each provider."""
    try:
        plt = pyplot()
    except Exception as exc:
        print(f"no plot: {exc}")
        return
    rows = [r for r in rows if r.case in CASES]  # (not the --handoff probe)
    vocabs = sorted({r.config["vocab"] for r in rows})
    cases = [c for c in CASES if any(r.case == c for r in rows)]
    fig, axes = plt.subplots(len(cases), len(vocabs), figsize=(5 * len(vocabs), 3.2 * len(cases)), squeeze=False)
    for axes_row, case in zip(axes, cases):
        for ax, vocab in zip(axes_row, vocabs):
            for provider, metric in sorted({(r.provider, r.metric) for r in rows if r.case == case}):
                pts = sorted((r.x, r.p50) for r in rows if r.config["vocab"] == vocab and r.case == case
                             and r.provider == provider and r.metric == metric and r.p50 is not None)
                if pts and metric in ("synced", "host", "graph"):
                    ax.plot(*zip(*pts), marker="o", label=f"{provider} {metric}",
                            linestyle={"synced": "-", "host": "--", "graph": ":"}[metric])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{case}, V = {vocab}")
            ax.set_xlabel("rows N")
            ax.set_ylabel("ms per call")
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
