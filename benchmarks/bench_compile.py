"""Eager, torch.compile and CUDA-graph mode side by side, and the fused distillation head against its
GEMM floor: fwd+bwd, bf16, medians of CUDA events, back-to-back.

Modes (each case's loss function, returning the loss and every metric, as a trainer logs them):

  eager            head_loss(...) / linear_head_loss(...), then loss.backward()
  compile          torch.compile(fn, fullgraph=True) (Inductor; the kernels run as torch.library ops)
  reduce-overhead  torch.compile(fn, fullgraph=True, mode="reduce-overhead") (Inductor's CUDA graphs), the
                   inputs marked static (mark_static_address), as a model's activations and weights are
  cuda-graph       eager headloss, forward and backward captured once in a torch.cuda.CUDAGraph (static
                   inputs, as above); a step is one replay -- the host cost without torch.compile's
                   per-replay bookkeeping (small shape only: the large one is device-bound)
  graphed-callables torch.cuda.make_graphed_callables(fn, inputs): forward and backward each captured
                   once behind an autograd.Function, called and backpropagated as eager is (the
                   inputs copied into the graphs' own when they are other tensors); the metrics come
                   out stacked in one tensor, as out.packed_metrics() gives them; small shape only

Cases, at a small shape (B 4 x L 256, V 32000, H 2048: an RL micro-batch) and a large one
(B 8 x L 1024, V 128256, H 4096):

  sft        CE + z-loss + accuracy + predicted tokens + entropy metric on [B L, V] logits
  grpo       TRL's dapo loss with a k3 KL, shift=True on the model's [B, L + 1, V] logits
  gspo       the same with sequence-level ratios (GSPO): deferred mode, the sequence kernels
  distill    forward KL (temperature 2) to teacher logits + CE, [B L, V]
  lm_head    CE on the fused lm_head, hidden [B L, H]
  bare       no headloss: torch alone, one logsumexp of [64, 1000] logits and its backward -- what each
             mode costs around any call on this host (small shape only: its size does not change)

Each case runs eager first (the reference of --check), then the two captured modes, then the two
compiled modes. Before a capture the eager step's outputs are dropped: a loss whose autograd graph is
still alive keeps the input's gradient accumulator, made by the first eager call on the default stream;
the captured backward reuses it and torch makes the default stream wait on the capture
(cudaErrorStreamCaptureImplicit) -- the same with no headloss in the step (the bare case).

``--distill`` (the large shape, N = 8192): the fused distillation head with both heads from hidden
states (student and teacher lm_head, H 4096), forward KL, reverse KL and JSD, against the 4 GEMMs
it cannot avoid (student logits, teacher logits, dh, dW at full size, the floor), the same 4 GEMMs cut
as the head cuts them at its default budget (student chunks and teacher parts, back to back, no head
kernel: what this chunking costs before any softmax) and TRL's ChunkedDivergenceFunction (when trl is
installed); time and peak memory.

``--check``: every mode's outputs and gradients against eager (max abs difference printed and
recorded in the rows' note). ``--profile CASE``: torch.profiler tables (host and device) of eager and
compiled steps of one case at the small shape. ``--profile-distill``: where the distillation head's
time goes (see profile_distill). ``--trace DIR``: both profiles' traces.

  python -m benchmarks.bench_compile [--shapes small large] [--cases sft grpo ...] [--distill] [--check]

Writes $OUT (or ./results)/bench_compile.{json,csv,png}; prints a table.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import pstats
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

import headloss
from benchmarks.bench_head import FULL_SPEC, IGNORE
from benchmarks.bench_host import GRPO_SPEC, GSPO_SPEC
from benchmarks.bench_terms import grpo_batch
from benchmarks.common import (
    Row,
    gpu_name,
    import_trl,
    out_dir_default,
    peak_extra_gb,
    pyplot,
    time_ms,
    write_rows,
)
from headloss.output import pack_metrics

SHAPES = {
    "small": dict(batch=4, length=256, vocab=32000, hidden=2048),
    "large": dict(batch=8, length=1024, vocab=128256, hidden=4096),
}
CASES = ("sft", "grpo", "gspo", "distill", "lm_head", "bare")
MODES = ("eager", "compile", "reduce-overhead", "cuda-graph", "graphed-callables")
CAPTURED = ("cuda-graph", "graphed-callables")  # run at the small shape only
RUN_ORDER = ("eager", "cuda-graph", "graphed-callables", "compile", "reduce-overhead")  # eager first: the reference
DISTILL_SPEC = headloss.LossSpec(cross_entropy={"weight": 0.5}, distillation={"weight": 0.5, "temperature": 2.0})
DIVERGENCES = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5}  # TRL's beta of each


def case_inputs(case: str, shape: dict, seed: int = 0):
    """(loss function of the differentiable inputs, those inputs) of one case at one shape."""
    batch, length, vocab, hidden = shape["batch"], shape["length"], shape["vocab"], shape["hidden"]
    n = batch * length
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def targets():
        y = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
        y[torch.rand(n, device="cuda", generator=gen) < 0.05] = IGNORE
        return y

    if case in ("grpo", "gspo"):
        logits, ids, adv, old, ref, mask = grpo_batch(seed, batch, length, vocab)
        spec = GRPO_SPEC if case == "grpo" else GSPO_SPEC
        extra = dict(ref_logprobs=ref) if case == "grpo" else {}
        n_items = mask.sum()

        def fn(x):
            out = headloss.head_loss(x, ids, spec, shift=True, advantages=adv, old_logprobs=old, loss_mask=mask,
                                     num_items_in_batch=n_items, **extra)
            return out.loss, out.metrics

        return fn, [logits.requires_grad_()]
    if case in ("sft", "distill"):
        x = (torch.randn(n, vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
        y = targets()
        if case == "sft":
            def fn(x):
                out = headloss.head_loss(x, y, FULL_SPEC)
                return out.loss, out.metrics

            return fn, [x]
        teacher = (torch.randn(n, vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16)

        def fn(x):
            out = headloss.head_loss(x, y, DISTILL_SPEC, teacher_logits=teacher)
            return out.loss, out.metrics

        return fn, [x]
    if case == "bare":
        x = (torch.randn(64, 1000, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()

        def fn(x):
            return x.float().logsumexp(-1).mean(), {}

        return fn, [x]
    if case == "lm_head":
        h = (torch.randn(n, hidden, device="cuda", generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16).requires_grad_()
        y = targets()

        def fn(h, w):
            out = headloss.linear_head_loss(h, w, y, FULL_SPEC)
            return out.loss, out.metrics

        return fn, [h, w]
    raise ValueError(f"case: {case!r}")


def graphed(fn: Callable, inputs: list[torch.Tensor]) -> Callable[[], tuple]:
    """fn's forward and backward captured once in a CUDA graph (after a warmup on a side stream); a step
    replays it into the same outputs and gradient buffers."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in inputs:
                t.grad = None
            fn(*inputs)[0].backward()
    torch.cuda.current_stream().wait_stream(side)
    for t in inputs:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, metrics = fn(*inputs)
        loss.backward()
    grads = [t.grad for t in inputs]

    def step():
        for t, g in zip(inputs, grads):  # (another mode's steps clear them)
            t.grad = g
        graph.replay()
        return loss, metrics

    return step


def graphed_callable(fn: Callable, inputs: list[torch.Tensor]) -> Callable[[], tuple]:
    """fn through torch.cuda.make_graphed_callables, returning the loss and the metrics stacked in one
    tensor by HeadLossOutput.packed_metrics()'s pack_metrics (fn hands out the dict; the graphed callable
    pays host time per output, ~25 us each on the lent host); a step calls it, runs the backward as
    eager does and makes the metrics' dict of views of that tensor (valid until the next replay)."""
    names: list[str] = []

    def flat(*args):
        loss, metrics = fn(*args)
        names[:] = list(metrics)
        return (loss, pack_metrics(metrics, loss.device)) if metrics else (loss,)

    call = torch.cuda.make_graphed_callables(flat, tuple(inputs))

    def step():
        for t in inputs:
            t.grad = None
        loss, *packed = call(*inputs)
        loss.backward()
        return loss, dict(zip(names, packed[0].unbind(0))) if packed else {}

    return step


def stepper(fn: Callable, inputs: list[torch.Tensor], mode: str) -> Callable[[], tuple]:
    """A zero-argument fwd+bwd step of ``fn`` in ``mode``; returns (loss, metrics)."""
    if mode == "cuda-graph":
        return graphed(fn, inputs)
    if mode == "graphed-callables":
        return graphed_callable(fn, inputs)
    if mode == "eager":
        call = fn
    elif mode == "compile":
        call = torch.compile(fn, fullgraph=True)
    else:
        call = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
        for t in inputs:  # as a model's own activations and weights are: no copy into the graphs' inputs
            torch._dynamo.mark_static_address(t)

    def step():
        for t in inputs:
            t.grad = None
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        loss, metrics = call(*inputs)
        loss.backward()
        return loss, metrics

    return step


def max_difference(got: tuple, want: tuple, grads_got: list, grads_want: list) -> float:
    """Largest absolute difference over the loss, every metric and every input gradient."""
    diffs = [(got[0] - want[0]).abs().max().item()]
    diffs += [(got[1][k].float() - want[1][k].float()).abs().max().item() for k in want[1]]
    diffs += [(a.float() - b.float()).abs().max().item() for a, b in zip(grads_got, grads_want)]
    return max(d for d in diffs if not math.isnan(d)) if diffs else 0.0


def mode_rows(rows: list[Row], table: list, shapes: list[str], cases: list[str], check: bool, rounds: int = 5,
              save: Callable[[], None] | None = None) -> None:
    """Each case in every mode: compiled and warmed up first, then timed in ``rounds`` rounds that
    take the modes in turn (a small shape's step is host-bound: the host's drift over a run then
    falls on every mode alike); each mode's time is the median of its rounds' medians. ``save``
    writes the rows so far, after each case."""
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        config = {**shape, "dtype": "bf16"}
        for case in cases:
            if case == "bare" and shape_name != "small":
                continue
            torch._dynamo.reset()
            fn, inputs = case_inputs(case, shape)
            want = grads = got = got_grads = step = None
            steps, notes = {}, {}
            for mode in RUN_ORDER:
                notes[mode] = ""
                got = None  # the last step's outputs and their autograd graph (see the module's docstring)
                if mode in CAPTURED and shape_name != "small":  # device-bound: a graph changes nothing
                    notes[mode] = None
                    continue
                try:
                    step = stepper(fn, inputs, mode)
                    for _ in range(3):
                        got = step()  # compile, warm up, record the CUDA graphs
                    if check:
                        got_grads = [t.grad.clone() for t in inputs]
                        if mode == "eager":
                            want = (got[0].detach().clone(), {k: v.clone() for k, v in got[1].items()})
                            grads = got_grads
                        else:
                            notes[mode] = f"max |{mode} - eager| {max_difference(got, want, got_grads, grads):.2e}"
                    steps[mode] = step
                except Exception as exc:  # a mode failing is a result
                    notes[mode] = f"error: {type(exc).__name__}: {exc}"[:300]
            steps = {mode: steps[mode] for mode in MODES if mode in steps}  # timed in the table's order
            timed: dict[str, list[float]] = {mode: [] for mode in steps}
            for _ in range(rounds):
                for mode, step in steps.items():
                    timed[mode].append(time_ms(step, reps=20, warmup=2)[0])
            times = {}
            for mode in MODES:
                ms = sorted(timed[mode])[len(timed[mode]) // 2] if mode in timed else None
                times[mode] = ms
                if notes[mode] is None:  # not run at this shape
                    continue
                rows.append(Row(case=case, provider=f"headloss-{mode}", metric="time", unit="ms", x_name="shape",
                                x=shape["batch"] * shape["length"], p50=ms, note=notes[mode], config=config,
                                gpu=gpu_name()))
                print(f"{case:8s} {shape_name:5s} {mode:16s} {ms if ms is None else round(ms, 4)} {notes[mode]}",
                      flush=True)
            table.append((case, shape_name, times))
            if save is not None:
                save()
            for t in inputs:
                t.grad = None
            del fn, inputs, steps, step, got, got_grads, want, grads  # the CUDA graphs' pools with them
            torch._dynamo.reset()
            torch._inductor.cudagraph_trees.reset_cudagraph_trees()
            gc.collect()
            torch.cuda.empty_cache()


class DistillHead(NamedTuple):
    """The fused distillation head's inputs (student and teacher from hidden states, bf16) and steps."""

    h: torch.Tensor
    w: torch.Tensor
    th: torch.Tensor
    tw: torch.Tensor

    def clear(self) -> None:
        self.h.grad = self.w.grad = None

    def floor(self) -> None:
        """The 4 GEMMs the head cannot avoid, at full size: student and teacher logits, dh, dW."""
        logits = self.h.detach() @ self.w.detach().t()
        teacher = self.th @ self.tw.t()
        del teacher
        logits @ self.w.detach()  # dh
        logits.t() @ self.h.detach()  # dW

    def chunked_floor(self, rows: int | None = None, part: int | None = None) -> tuple[Callable[[], None], str]:
        """The same 4 GEMMs cut as the head cuts them (student chunks of ``rows``, each chunk's teacher
        logits in parts of ``part`` rows; by default headloss.chunks' split of its default budget), back
        to back into one buffer each, dW accumulated: the chunking's cost before any softmax. Returns
        (step, a label naming the cut)."""
        import headloss.chunks as chunks

        budget = chunks.DEFAULT_CHUNK_BYTES
        h, w = self.h.detach(), self.w.detach()
        n, vocab, elem = h.shape[0], w.shape[0], h.element_size()
        rows = rows or chunks.chunk_rows_for(int(budget * (1.0 - chunks.TEACHER_SHARE)), vocab, elem)
        part = min(rows, part or chunks.chunk_rows_for(int(budget * chunks.TEACHER_SHARE), vocab, elem))  # as the head

        def step():
            dh, dw = torch.empty_like(h), torch.empty_like(w)
            logits, teacher = h.new_empty(rows, vocab), h.new_empty(part, vocab)
            for start in range(0, n, rows):
                end = min(n, start + rows)
                z = torch.mm(h[start:end], w.t(), out=logits[: end - start])
                for t in range(start, end, part):
                    torch.mm(self.th[t:min(end, t + part)], self.tw.t(), out=teacher[: min(end, t + part) - t])
                torch.mm(z, w, out=dh[start:end])
                if start == 0:
                    torch.mm(z.t(), h[start:end], out=dw)
                else:
                    dw.addmm_(z.t(), h[start:end])

        return step, f"4 GEMMs cut {rows} + {part} rows"

    def step_of(self, divergence: str, beta: float, chunk_bytes: int | None = None) -> Callable[[], None]:
        """One fwd+bwd of headloss's fused head with ``divergence``."""
        spec = headloss.LossSpec(cross_entropy=None, distillation={"divergence": divergence, "beta": beta})
        extra = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}

        def step():
            self.clear()
            headloss.linear_head_loss(self.h, self.w, None, spec, teacher_hidden=self.th, teacher_weight=self.tw,
                                      **extra).loss.backward()

        return step


def distill_head(n: int, hidden: int, vocab: int) -> DistillHead:
    gen = torch.Generator(device="cuda").manual_seed(7)

    def randn(*shape, scale, grad=False):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16).requires_grad_(grad)

    return DistillHead(randn(n, hidden, scale=0.5, grad=True), randn(vocab, hidden, scale=0.02, grad=True),
                       randn(n, hidden, scale=0.5), randn(vocab, hidden, scale=0.02))


def distill_rows(rows: list[Row], n: int = 8192, hidden: int = 4096, vocab: int = 128256) -> list[tuple]:
    """The fused distillation head from hidden states: headloss's three divergences, the 4-GEMM
    floor and TRL's chunked divergence; time and peak memory."""
    head = distill_head(n, hidden, vocab)
    config = {"N": n, "H": hidden, "V": vocab, "dtype": "bf16"}
    steps: dict[str, Callable[[], None]] = {"floor (4 GEMMs)": head.floor}
    cut, label = head.chunked_floor()
    steps[label] = cut
    for name, beta in DIVERGENCES.items():
        steps[f"headloss {name}"] = head.step_of(name, beta)
    try:
        chunked = import_trl("trl.kernels.chunked_divergence").ChunkedDivergenceFunction
        for name, beta in DIVERGENCES.items():
            def trl(beta=beta):
                head.clear()
                divergence, _ = chunked.apply(head.h, head.w, None, head.th, head.tw, None, beta, 1.0)
                divergence.mean().backward()

            steps[f"trl {name}"] = trl
    except Exception as exc:  # a missing peer is a result
        print(f"trl chunked divergence unavailable: {exc}")
    results = []
    floor_ms = None
    for name, step in steps.items():
        step()
        mem = peak_extra_gb(step, head.clear, cold_blas=True)  # the gradients dh and dW count
        ms = time_ms(step, reps=10, warmup=2)[0]
        floor_ms = ms if name.startswith("floor") else floor_ms
        note = "" if floor_ms is None or name.startswith("floor") else f"{ms / floor_ms:.3f} x floor"
        for metric, unit, value in (("time", "ms", ms), ("memory", "GB", mem)):
            rows.append(Row(case="distill-hidden", provider=name, metric=metric, unit=unit, x_name="N", x=n, p50=value,
                            note=note, config=config, gpu=gpu_name()))
        results.append((name, ms, mem, note))
        print(f"distill-hidden {name:22s} {ms:8.2f} ms  {mem / 1.073741824:6.3f} GiB  {note}", flush=True)
    return results


def gemm_table(h: torch.Tensor, w: torch.Tensor) -> None:
    """Each GEMM of the floor cut in chunks of M rows (the chunked head's GEMMs), ms for all rows."""
    n = h.shape[0]
    g = torch.randn(n, w.shape[0], device=h.device, dtype=h.dtype)
    dw = torch.zeros_like(w)
    print("each GEMM of the floor in chunks of M rows, ms for all N rows (M = N: one GEMM)")
    print(f"{'M':>6s} {'logits':>8s} {'dh':>8s} {'dW +=':>8s}")
    for m in (128, 192, 256, 384, 512, 640, 768, 1024, 2048, n):
        gemms = (lambda m=m: h[:m] @ w.t(), lambda m=m: g[:m] @ w,
                 lambda m=m: torch.addmm(dw, g[:m].t(), h[:m], out=dw))
        cells = [time_ms(fn, reps=5, warmup=2)[0] * n / m for fn in gemms]  # the share of all N rows
        print(f"{m:6d} " + " ".join(f"{c:8.2f}" for c in cells), flush=True)


def profile_distill(n: int = 8192, hidden: int = 4096, vocab: int = 128256, trace: Path | None = None) -> None:
    """Where the fused distillation head's time goes: the 4-GEMM floor and each of its GEMMs cut in
    chunks of rows (the chunk's share of the full GEMM's time: how the chunk size costs); device time
    per kernel (summed over one call's chunks), the device's idle time and the host's launch time for
    each divergence, and any call that waits for the device; forward KL against the teacher's share
    of the chunk budget (chunks.TEACHER_SHARE), the budget, and the head kernel's block and warps with a
    teacher. ``trace``: a folder for each divergence's torch.profiler trace (two steps, host and
    device)."""
    import time
    import warnings

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profile

    import headloss.chunks
    from headloss.kernels.launch import LAUNCH_OVERRIDES

    head = distill_head(n, hidden, vocab)
    step_of = head.step_of
    floor_ms = time_ms(head.floor, reps=5)[0]
    print(f"floor (4 GEMMs) {floor_ms:.2f} ms")
    gemm_table(head.h.detach(), head.w.detach())
    print("the 4 GEMMs cut as the head cuts them, back to back (no head kernel), for splits near the "
          "default budget's 1024 rows")
    for rows, part in ((1024, 128), (896, 128), (768, 256), (640, 384), (640, 256), (512, 512), (512, 256)):
        cut, label = head.chunked_floor(rows, part)
        cut()
        mem = peak_extra_gb(cut, cold_blas=True)
        ms = time_ms(cut, reps=5)[0]
        print(f"{label:30s} {ms:8.2f} ms  {ms / floor_ms:6.3f} x floor  {mem / 1.073741824:6.3f} GiB", flush=True)

    def timed(step, label: str) -> None:
        step()
        mem = peak_extra_gb(step, head.clear, cold_blas=True)
        ms = time_ms(step, reps=5)[0]
        print(f"{label:44s} {ms:8.2f} ms  {ms / floor_ms:6.3f} x floor  {mem / 1.073741824:6.3f} GiB", flush=True)

    for name, beta in DIVERGENCES.items():
        step = step_of(name, beta)
        step()
        torch.cuda.synchronize()
        with run_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):  # two steps back to back: what falls between them shows
                step()
            torch.cuda.synchronize()
        if trace is not None:
            prof.export_chrome_trace(str(trace / f"distill_{name}.json.gz"))
        torch.cuda.synchronize()
        launched = time.perf_counter()
        step()
        launched = (time.perf_counter() - launched) * 1e3
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as waits:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step()
            torch.cuda.set_sync_debug_mode("default")
        waits = sorted({str(w.message)[:120] for w in waits if "prototype feature" not in str(w.message)})
        print(f"\n{name}: the host returns from a step after {launched:.2f} ms; calls that wait for the device: "
              f"{waits or 'none'}")
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        per: dict[str, list[float]] = {}
        for e in kernels:
            per.setdefault(e.name, []).append(e.device_time)
        busy = sum(e.device_time for e in kernels) / 2e3
        span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 2e3
        gaps = sorted(((round(b.time_range.start - a.time_range.end), a.name[:40], b.name[:40])
                       for a, b in zip(kernels, kernels[1:])), reverse=True)[:4]
        print(f"\n===== distill-hidden {name}: step {time_ms(step, reps=5)[0]:.2f} ms, device busy {busy:.2f} ms "
              f"over a span of {span:.2f} ms a step; largest gaps (us, after, before): {gaps}")
        for kernel, times in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:8]:
            print(f"{sum(times) / 2e3:9.3f} ms {len(times) // 2:4d}x  {kernel[:100]}")
    print()
    default_share = headloss.chunks.TEACHER_SHARE
    for share in (0.5, 0.25, 0.125):
        headloss.chunks.TEACHER_SHARE = share
        timed(step_of("forward_kl", 0.0), f"forward_kl, teacher share {share}")
    headloss.chunks.TEACHER_SHARE = default_share
    for mib in (192, 320, 512):
        timed(step_of("forward_kl", 0.0, mib << 20), f"forward_kl, chunk_bytes {mib} MiB")
    for block, warps in ((2048, 8), (2048, 4), (4096, 8), (1024, 8)):
        LAUNCH_OVERRIDES.update(block_v=block, num_warps=warps)
        try:
            timed(step_of("forward_kl", 0.0), f"forward_kl, block {block} x {warps} warps")
            timed(step_of("jsd", 0.5), f"jsd, block {block} x {warps} warps")
        finally:
            LAUNCH_OVERRIDES.update(block_v=None, num_warps=None)


def profile(case: str, modes: tuple[str, ...] = MODES, trace: Path | None = None) -> None:
    """Host and device tables of eager and compiled steps of ``case`` at the small shape; ``trace``: a
    folder for each mode's torch.profiler trace."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profile

    fn, inputs = case_inputs(case, SHAPES["small"])
    for mode in modes:
        torch._dynamo.reset()
        step = stepper(fn, inputs, mode)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with run_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        if trace is not None:
            prof.export_chrome_trace(str(trace / f"{case}_{mode}.json.gz"))
        print(f"\n===== {case} {mode}: time_ms {time_ms(step, reps=30)[0]:.4f}")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70))
        # the host's Python, the backward included (on the calling thread)
        torch.autograd.set_multithreading_enabled(False)
        stats = cProfile.Profile()
        stats.enable()
        for _ in range(50):
            step()
        stats.disable()
        torch.cuda.synchronize()
        torch.autograd.set_multithreading_enabled(True)
        pstats.Stats(stats).sort_stats("tottime").print_stats(30)
        pstats.Stats(stats).sort_stats("cumulative").print_stats(40)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument("--distill", action="store_true", help="also the fused distillation head from hidden")
    parser.add_argument("--check", action="store_true", help="compare compiled outputs and gradients with eager")
    parser.add_argument("--profile", choices=CASES, help="profile one case (small shape) and exit")
    parser.add_argument("--profile-distill", action="store_true",
                        help="device time per kernel of the fused distillation head, and its chunk budget; exit")
    parser.add_argument("--modes", nargs="+", default=list(RUN_ORDER), choices=MODES, help="--profile's modes")
    parser.add_argument("--name", default="bench_compile", help="results file name")
    parser.add_argument("--trace", type=Path, help="--profile / --profile-distill: write torch.profiler traces here")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds over the modes")
    parser.add_argument("--replot", type=Path, help="draw the PNG of a results JSON again and exit")
    args = parser.parse_args(argv)
    if args.replot:
        replot(args.replot)
        return
    if args.profile:
        profile(args.profile, tuple(args.modes), args.trace)
        return
    if args.profile_distill:
        profile_distill(trace=args.trace)
        return
    rows: list[Row] = []
    table: list = []
    out = out_dir_default()
    mode_rows(rows, table, args.shapes, args.cases, args.check, args.rounds,
              save=lambda: write_rows(rows, out, args.name))
    distill = distill_rows(rows) if args.distill else []
    write_rows(rows, out, args.name)
    _plot(rows, out / f"{args.name}.png")
    print(f"\none {gpu_name()}, bf16, fwd+bwd, medians in ms")
    short = {"compile": "compile", "reduce-overhead": "r-o", "cuda-graph": "graph", "graphed-callables": "callables"}
    print(f"{'case':8s} {'shape':5s} " + " ".join(f"{m:>17s}" for m in MODES) + "  " +
          " ".join(f"{short[m] + '/eager':>15s}" for m in MODES[1:]))
    for case, shape, times in table:
        cells = " ".join(f"{times[m]:17.4f}" if times.get(m) else f"{'-':>17s}" for m in MODES)
        ratios = [times[m] / times["eager"] if times.get(m) and times.get("eager") else float("nan")
                  for m in MODES[1:]]
        print(f"{case:8s} {shape:5s} {cells}  " + " ".join(f"{r:15.3f}" for r in ratios))
    if distill:
        print(f"\n{'distill-hidden (N 8192, H 4096, V 128256)':42s} {'ms':>8s} {'GiB':>7s}")
        for name, ms, mem, note in distill:
            print(f"{name:42s} {ms:8.2f} {mem / 1.073741824:7.3f}  {note}")


def _plot(rows: list[Row], path) -> None:
    """One panel per vocabulary: each case's time in every mode; and one for the distillation
    head from hidden states (time against its 4-GEMM floor) when it was measured."""
    plt = pyplot()
    timed = [r for r in rows if r.metric == "time" and r.case != "distill-hidden" and r.p50]
    distill = [r for r in rows if r.metric == "time" and r.case == "distill-hidden" and r.p50]
    shapes = sorted({r.config.get("vocab") for r in timed})
    panels = len(shapes) + (1 if distill else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    for ax, vocab in zip(axes[0], shapes):
        cases = [c for c in CASES if any(r.case == c and r.config.get("vocab") == vocab for r in timed)]
        for i, mode in enumerate(MODES):
            vals = [next((r.p50 for r in timed if r.case == c and r.provider == f"headloss-{mode}"
                          and r.config.get("vocab") == vocab), 0.0) for c in cases]
            width = 0.8 / len(MODES)
            ax.bar([j + width * (i - (len(MODES) - 1) / 2) for j in range(len(cases))], vals, width=width, label=mode)
        ax.set_xticks(range(len(cases)), cases)
        ax.set_ylabel("ms (fwd+bwd)")
        ax.set_title(f"V {vocab}")
        ax.legend(ncol=len(MODES), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    if distill:
        ax = axes[0][-1]
        colour = {"floor": "grey", "4 GEMMs": "grey", "headloss": "C0"}
        ax.barh([r.provider for r in distill], [r.p50 for r in distill],
                color=[next((c for k, c in colour.items() if r.provider.startswith(k)), "C1") for r in distill])
        ax.invert_yaxis()
        ax.set_xlabel("ms (fwd+bwd)")
        ax.set_title("distillation from hidden, N 8192, H 4096, V 128256", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replot(path: Path) -> None:
    """Draw ``path``'s PNG again from its JSON rows."""
    rows = [Row(**row) for row in json.loads(path.read_text())]
    _plot(rows, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
