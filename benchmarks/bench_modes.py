"""The same step run three ways, and the DFT term's cost: fwd+bwd, bf16, N=8192, V=128256.

  eager     head_loss(...).loss.backward()
  compile   the step under torch.compile(fullgraph=True) (Inductor; headloss runs as torch.library ops)
  compile-ro  the same with mode="reduce-overhead" (the headloss ops run between Inductor's CUDA graphs)
  graph     the eager step captured in a CUDA graph (default arguments, validation on), replayed

Cases: ``full`` (CE + z-loss + accuracy + predicted tokens + entropy metric), ``ce``, ``ce+dft``
(CE and DFT together), ``dft`` (DFT alone). Medians of CUDA events, back-to-back.

  python -m benchmarks.bench_modes

Writes $OUT (or ./results)/bench_modes.{json,csv,png}; prints a table.
"""

from __future__ import annotations

import argparse

import torch

import headloss
from benchmarks.bench_head import CE_SPEC, FULL_SPEC
from benchmarks.bench_host import graph_ms
from benchmarks.common import Row, gpu_name, out_dir_default, pyplot, time_ms, write_rows

SPECS = {
    "full": FULL_SPEC,
    "ce": CE_SPEC,
    "ce+dft": headloss.LossSpec(dft={"weight": 1.0}),
    "dft": headloss.LossSpec(cross_entropy=None, dft={"weight": 1.0}),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(args.rows, args.vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, args.vocab, (args.rows,), device="cuda", generator=gen)
    y[torch.rand(args.rows, device="cuda", generator=gen) < 0.05] = -100
    rows: list[Row] = []
    table = []
    for case, spec in SPECS.items():
        def loss_of(x, y, spec=spec):
            return headloss.head_loss(x, y, spec).loss

        compiled = torch.compile(loss_of, fullgraph=True)
        compiled_ro = torch.compile(loss_of, fullgraph=True, mode="reduce-overhead")

        def eager(loss_of=loss_of):
            x.grad = None
            loss_of(x, y).backward()

        def step_compiled(compiled=compiled):
            x.grad = None
            compiled(x, y).backward()

        def step_compiled_ro(compiled=compiled_ro):
            x.grad = None
            compiled(x, y).backward()

        times = {"eager": time_ms(eager, reps=30)[0]}
        if case in ("full", "ce"):
            step_compiled()
            times["compile"] = time_ms(step_compiled, reps=30)[0]
            for _ in range(3):
                step_compiled_ro()
            times["compile-ro"] = time_ms(step_compiled_ro, reps=30)[0]
            times["graph"] = graph_ms(eager)
        for mode, ms in times.items():
            rows.append(Row(case=case, provider=f"headloss-{mode}", metric="time", unit="ms", x_name="N",
                            x=args.rows, p50=ms, config={"V": args.vocab, "dtype": "bf16"}, gpu=gpu_name()))
        table.append((case, times))
        print(case, {k: round(v, 4) if v else v for k, v in times.items()}, flush=True)
    out = out_dir_default()
    write_rows(rows, out, "bench_modes")
    _plot(rows, out / "bench_modes.png")
    ce = dict(table)["ce"]["eager"]
    print(f"\n{'case':8s} {'eager ms':>9s} {'compile':>9s} {'comp-ro':>9s} {'graph':>9s} {'/eager':>8s} {'/ce':>7s}")
    cell = lambda v: f"{v:9.3f}" if v is not None else "        -"  # noqa: E731
    for case, t in table:
        comp, graph = t.get("compile"), t.get("graph")
        ratio = f"{comp / t['eager']:8.3f}" if comp else "       -"
        print(f"{case:8s} {t['eager']:9.3f} {cell(comp)} {cell(t.get('compile-ro'))} {cell(graph)} {ratio} "
              f"{t['eager'] / ce:7.3f}")


def _plot(rows: list[Row], path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r.case} {r.provider.split('-', 1)[1]}" for r in rows if r.p50]
    ax.barh(labels, [r.p50 for r in rows if r.p50], color="tab:blue")
    ax.set_xlabel("fwd+bwd ms (median)")
    ax.set_title("eager vs torch.compile vs CUDA graph; DFT cost (N=8192, V=128256, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
