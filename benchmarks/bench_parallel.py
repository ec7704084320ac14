"""Vocab-parallel heads on several GPUs (NCCL), beside the single-GPU call on the whole vocabulary.

Cases (bf16, fwd+bwd):

  full      logits [N, V / world] per rank, CE + z-loss + accuracy + argmax + entropy metric
  ce        CE only, beside Liger-Kernel's LigerVocabParallelCrossEntropy (its all-reduces)
  grpo      GRPO (dapo, k3 beta 0.04, entropy + clip/KL metrics) on [B, L, V / world]
  linear    fused lm_head + CE, hidden [N, H] replicated, weight [V / world, H] per rank

Per rank: median step time (CUDA events), the collectives and bytes one call issues, peak extra
memory for the lm_head case (above the inputs, gradients dW and dh included); rank 0 also times the
single-GPU call on the whole vocabulary.

  python -m benchmarks.bench_parallel [--world 2] [--rows 8192] [--vocab 128256] [--hidden 4096]
                                      [--cases full ce grpo linear] [--name bench_parallel]

Writes $OUT (or ./results)/<name>.{json,csv,png}; prints a table.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from benchmarks.common import (
    Row,
    gpu_name,
    out_dir_default,
    peak_extra_gb,
    pyplot,
    spawn_world,
    time_ms,
    world_parser,
    write_rows,
)

FULL = dict(z_loss={"weight": 1e-4}, entropy={"weight": 0.0}, token_accuracy=True, outputs=("predicted_tokens",))
CASES = ("full", "ce", "grpo", "linear")
GRPO = dict(cross_entropy=None, entropy={"weight": 0.0},
            policy={"loss_type": "dapo", "kl_beta": 0.04, "eps_low": 0.2, "eps_high": 0.28})


class _Counter:
    """Counts the torch.distributed collectives (and their bytes) a step issues."""

    def __init__(self) -> None:
        self.calls, self.bytes = 0, 0
        self._saved = {}

    def __enter__(self):
        for name in ("all_gather", "all_reduce", "all_gather_into_tensor"):
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapped(*args, _original=original, _name=name, **kwargs):
                self.calls += 1
                tensor = args[1] if _name.startswith("all_gather") else args[0]
                self.bytes += tensor.numel() * tensor.element_size() * (dist.get_world_size()
                                                                         if _name.startswith("all_gather") else 1)
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _rank(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import headloss

    out = []
    n, v, h = args.rows, args.vocab, args.hidden
    widths = [v // world + (1 if r < v % world else 0) for r in range(world)]
    start, width = sum(widths[:rank]), widths[rank]
    gen = torch.Generator(device="cuda").manual_seed(0)
    group = dist.group.WORLD

    def record(case, provider, step, setup=None, single=False, mem=False):
        if single and rank != 0:
            dist.barrier()
            return
        for _ in range(3):
            if setup:
                setup()
            step()
        with _Counter() as counter:
            if setup:
                setup()
            step()
        torch.cuda.synchronize()
        p50, p20, p80 = time_ms(step, setup, reps=args.reps)
        gb = peak_extra_gb(step, setup) if mem else None
        out.append(dict(case=case, provider=provider, p50=p50, p20=p20, p80=p80, collectives=counter.calls,
                        bytes=counter.bytes, peak_gb=gb))
        if single:
            dist.barrier()

    # --- logits path: full, ce, grpo
    cases = set(args.cases)
    logits = (torch.randn(n, v, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
    local = logits[:, start: start + width].contiguous().requires_grad_()
    whole = logits.requires_grad_() if rank == 0 else None
    for case, spec in (("full", headloss.LossSpec(**FULL)), ("ce", headloss.LossSpec())):
        if case not in cases:
            continue

        def sharded(spec=spec):
            local.grad = None
            headloss.head_loss(local, ids, spec, group=group).loss.backward()

        def single(spec=spec):
            whole.grad = None
            headloss.head_loss(whole, ids, spec).loss.backward()

        record(case, "headloss single GPU", single, single=True)
        record(case, f"headloss {world} ranks", sharded)
    try:
        if "ce" not in cases:
            raise RuntimeError("the ce case is not run")
        from liger_kernel.transformers import LigerVocabParallelCrossEntropy

        liger = LigerVocabParallelCrossEntropy()
        local3 = local.detach()[None].requires_grad_()

        def liger_step():
            local3.grad = None
            liger(local3, ids[None], tp_group=group).mean().backward()

        record("ce", f"liger {world} ranks", liger_step)
    except Exception as exc:  # a peer that fails is a result
        if rank == 0:
            print(f"liger unavailable: {exc}")
    whole = logits = None  # (freed; the closures above are done with them)
    torch.cuda.empty_cache()
    b, length = 8, n // 8
    glogits = (torch.randn(b, length, v, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    gids = torch.randint(0, v, (b, length), device="cuda", generator=gen)
    with torch.no_grad():
        old = torch.log_softmax(glogits.float(), -1).gather(-1, gids[..., None])[..., 0]
    inputs = dict(advantages=torch.randn(b, device="cuda", generator=gen), old_logprobs=old + 0.1,
                  ref_logprobs=old - 0.1, loss_mask=torch.ones(b, length, device="cuda"))
    glocal = glogits[..., start: start + width].contiguous().requires_grad_()
    gwhole = glogits.requires_grad_() if rank == 0 else None
    spec = headloss.LossSpec(**GRPO)

    def gsharded():
        glocal.grad = None
        headloss.head_loss(glocal, gids, spec, group=group, **inputs).loss.backward()

    def gsingle():
        gwhole.grad = None
        headloss.head_loss(gwhole, gids, spec, **inputs).loss.backward()

    if "grpo" in cases:
        record("grpo", "headloss single GPU", gsingle, single=True)
        record("grpo", f"headloss {world} ranks", gsharded)
    glogits = gwhole = glocal = None
    torch.cuda.empty_cache()

    # --- fused lm_head
    hidden = (torch.randn(n, h, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    wlocal = weight[start: start + width].contiguous().requires_grad_()
    wwhole = weight.requires_grad_() if rank == 0 else None

    def lsharded():
        headloss.linear_head_loss(hidden, wlocal, ids, group=group).loss.backward()

    def lsingle():
        headloss.linear_head_loss(hidden, wwhole, ids).loss.backward()

    def clear_sharded():  # outside the timed step: the peak then counts dW and dh
        hidden.grad = wlocal.grad = None

    def clear_single():
        hidden.grad = wwhole.grad = None

    if "linear" in cases:
        record("linear", "headloss single GPU", lsingle, clear_single, single=True, mem=True)
        record("linear", f"headloss {world} ranks", lsharded, clear_sharded, mem=True)
    results[rank] = out
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = world_parser(__doc__, "bench_parallel", 25, rows=8192, vocab=128256, hidden=4096)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    args = parser.parse_args(argv)
    results = spawn_world(_rank, args.world, args)
    rows: list[Row] = []
    single = {r["case"]: r for r in results[0] if r["provider"] == "headloss single GPU"}
    config = {"world": args.world, "rows": args.rows, "vocab": args.vocab, "hidden": args.hidden, "dtype": "bf16"}
    print(f"\n{'case':7s} {'provider':22s} {'p50 ms':>8s} {'x single':>9s} {'coll':>5s} {'MB/call':>8s} "
          f"{'peak GB':>8s} {'slowest rank':>13s}")
    for entry in results[0]:
        slowest = max(r["p50"] for rank in results for r in results[rank]
                      if r["case"] == entry["case"] and r["provider"] == entry["provider"])
        base = single.get(entry["case"])
        ratio = entry["p50"] / base["p50"] if base else float("nan")
        peak = f"{entry['peak_gb']:8.3f}" if entry["peak_gb"] is not None else "       -"
        print(f"{entry['case']:7s} {entry['provider']:22s} {entry['p50']:8.3f} {ratio:9.3f} {entry['collectives']:5d} "
              f"{entry['bytes'] / 1e6:8.2f} {peak} {slowest:13.3f}")
        note = json.dumps({"collectives": entry["collectives"], "bytes": entry["bytes"], "slowest_rank_ms": slowest})
        rows.append(Row(case=entry["case"], provider=entry["provider"], metric="time", unit="ms", x_name="rows",
                        x=args.rows, p50=entry["p50"], p20=entry["p20"], p80=entry["p80"], note=note, config=config,
                        gpu=gpu_name()))
        if entry["peak_gb"] is not None:
            rows.append(Row(case=entry["case"], provider=entry["provider"], metric="memory", unit="GB",
                            x_name="rows", x=args.rows, p50=entry["peak_gb"], config=config, gpu=gpu_name()))
    out = out_dir_default()
    write_rows(rows, out, args.name)
    _plot(rows, out / f"{args.name}.png")


def _plot(rows: list[Row], path) -> None:
    try:
        plt = pyplot()
    except Exception as exc:
        print(f"no plot: {exc}")
        return
    times = [r for r in rows if r.metric == "time"]
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r.case}\n{r.provider}" for r in times]
    ax.bar(range(len(times)), [r.p50 for r in times])
    ax.set_xticks(range(len(times)), labels, rotation=60, fontsize=7)
    ax.set_ylabel("ms per fwd+bwd (rank 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
