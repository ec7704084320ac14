"""The student's top-k head kernel's time against its registers per thread (``maxnreg``), one process.

    python -m benchmarks.bench_topk_registers --k 8 --caps 0 96 88 80 72 64 --stem bench_topk_registers_k8

The CE call with ``student_topk`` (fwd+bwd, bf16, N 8192, V 128256, 5% of the targets ignored, the gradient
in place, as ``bench_terms --cases topk``) beside the same call without it. Each cap compiles the head kernel
with Triton's ``maxnreg`` (0: as ptxas allocates), bypassing the launch's own fit (headloss.kernels.launch._fitted,
to the registers of the call without the top-k) so every cap is measured; each cap's ids are checked equal to
the uncapped kernel's. Prints registers, Triton's spill count and warps per build; two rounds.
Writes $OUT (or ./results)/<stem>.{json,csv,png}.
"""

from __future__ import annotations

import argparse

import torch

import headloss
import headloss.kernels.head as kernels_head
from benchmarks.bench_head import restorable_leaf
from benchmarks.common import Row, measure, out_dir_default, pyplot, write_rows

N, V = 8192, 128256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--caps", type=int, nargs="*", default=[0, 96, 88, 80, 72, 64])
    parser.add_argument("--stem", default="bench_topk_registers")
    args = parser.parse_args()
    cap: dict = {"n": 0, "tag": ""}
    builds: dict[str, tuple[int, int, int]] = {}
    launch = kernels_head.launch

    def capped(kernel, grid, num_warps, registers_of=None, fit_spills=0, **kw):
        if kernel.fn.__name__ != "head_kernel":
            return launch(kernel, grid, num_warps, registers_of=registers_of, fit_spills=fit_spills, **kw)
        compiled = kernel[(grid,)](**kw, num_warps=num_warps, **({"maxnreg": cap["n"]} if cap["n"] else {}))
        if compiled is not None:
            builds[cap["tag"]] = (compiled.n_regs, compiled.n_spills, num_warps)

    kernels_head.launch = capped
    gen = torch.Generator(device="cuda").manual_seed(0)
    pristine = torch.randn(N, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    y = torch.randint(0, V, (N,), device="cuda", generator=gen)
    y[torch.rand(N, device="cuda", generator=gen) < 0.05] = -100
    x, setup = restorable_leaf(pristine)
    plain = headloss.LossSpec()
    top = headloss.LossSpec(student_topk=args.k, outputs=("topk_ids", "topk_logprobs"))
    cases = [("plain", plain, 0)] + [(f"top-{args.k} maxnreg={c or 'none'}", top, c) for c in args.caps]
    rows: list[Row] = []
    ids: dict[str, torch.Tensor] = {}
    for round_ in range(2):
        for tag, spec, c in cases:
            cap.update(n=c, tag=tag)
            step = lambda spec=spec: headloss.head_loss(x, y, spec, inplace_grad=True).loss.backward()  # noqa: E731
            measure(rows, f"round {round_ + 1}", tag, "k", args.k, step, setup, config={"N": N, "V": V, "maxnreg": c})
            if round_ == 0 and spec is top:
                setup()
                ids[tag] = headloss.head_loss(x, y, spec, inplace_grad=True).topk_ids.clone()
    first = ids[cases[1][0]]
    times = {}
    for r in rows:
        if r.metric == "time":
            times.setdefault(r.provider, []).append(r.p50)
    base = min(times["plain"])
    print(f"{'build':28s}{'round 1':>9}{'round 2':>9}{'x plain':>9}  regs spills warps  ids as uncapped")
    for tag, _, _ in cases:
        regs, spills, warps = builds.get(tag, (0, 0, 0))
        same = "" if tag == "plain" else str(torch.equal(ids[tag], first))
        t = times[tag]
        print(f"{tag:28s}{t[0]:9.3f}{t[1]:9.3f}{min(t) / base:9.3f}  {regs:4d} {spills:6d} {warps:5d}  {same}")
    out = out_dir_default()
    write_rows(rows, out, args.stem)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    tags = [tag for tag, _, _ in cases]
    ax.bar(range(len(tags)), [min(times[t]) / base for t in tags])
    ax.set_xticks(range(len(tags)), [t.replace(f"top-{args.k} ", "") for t in tags], rotation=30, ha="right")
    ax.set_ylabel("x the plain CE call")
    ax.set_title(f"top-{args.k}: time against maxnreg ({torch.cuda.get_device_name()})")
    fig.tight_layout()
    fig.savefig(out / f"{args.stem}.png")


if __name__ == "__main__":
    main()
