"""A megatron-core GPTModel's loss step, Megatron's own against headloss's patch, tensor parallel over NCCL.

The model is the part the loss sees (embedding, final norm, output layer; no transformer layers:
they are the same in every case), bf16, hidden 4096, V 128256, ``--seq`` tokens of one sequence,
tensor parallel over ``--world`` GPUs with sequence parallelism. One step: forward with labels, the
per-token loss times a loss mask summed, backward. Cases:

  megatron            Megatron's output layer + tensor_parallel.vocab_parallel_cross_entropy
  megatron-fused-ce   Megatron's output layer + its fused_vocab_parallel_cross_entropy (native)
  headloss-logits     Megatron's output layer + headloss on the vocab-parallel logits (patch fused=False)
  headloss-fused      headloss from the hidden states and the output weight shard (patch fused=True)

Per rank: median step time (CUDA events) and peak memory above the model and inputs (GB).

  python -m benchmarks.bench_megatron [--world 2] [--seq 8192] [--hidden 4096] [--vocab 128256] [--mtp 0]

``--mtp N``: N multi-token prediction depths (each a transformer layer without attention or MLP beside
its norms and projection; mtp_loss_scaling_factor 0.3): each depth's loss through the same case.

Writes $OUT (or ./results)/bench_megatron.{json,csv,png}; prints a table.
"""

from __future__ import annotations

import os

import torch

from benchmarks.common import peak_extra_gb, per_rank_report, spawn_world, time_ms, world_parser

CASES = ("megatron", "megatron-fused-ce", "headloss-logits", "headloss-fused")


def _rank(rank: int, world: int, port: int, args, results) -> None:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from megatron_cases import init, model_of

    from headloss.integrations.megatron import patch_gpt_model

    device = init(rank, world, port, "nccl")
    model = model_of(world, True, False, torch.bfloat16, device, vocab=args.vocab, hidden=args.hidden,
                     mtp_layers=args.mtp)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=gen).to(device)
    labels = torch.randint(0, args.vocab, (1, args.seq), generator=gen).to(device)
    position = torch.arange(args.seq, device=device)[None]
    loss_mask = (torch.rand(1, args.seq, generator=gen) > 0.1).float().to(device)
    out = []
    for case in CASES:
        patch = None
        model.config.cross_entropy_loss_fusion = case == "megatron-fused-ce"
        model.config.cross_entropy_fusion_impl = "native"
        if case.startswith("headloss"):
            patch = patch_gpt_model(model, fused=case == "headloss-fused")

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(ids, position, None, labels=labels)
            (loss.float() * loss_mask).sum().backward()

        p50, p20, p80 = time_ms(step, reps=args.reps)
        model.zero_grad(set_to_none=True)
        peak = peak_extra_gb(step)
        out.append({"case": case, "p50": p50, "p20": p20, "p80": p80, "peak": peak})
        if patch is not None:
            patch.restore()
    results[rank] = out


def main(argv: list[str] | None = None) -> None:
    parser = world_parser(__doc__, "bench_megatron", 20, seq=8192, vocab=128256, hidden=4096, mtp=0)
    args = parser.parse_args(argv)
    results = spawn_world(_rank, args.world, args)
    config = {"world": args.world, "seq": args.seq, "vocab": args.vocab, "hidden": args.hidden, "dtype": "bf16",
              "sequence_parallel": True, "mtp_layers": args.mtp}
    per_rank_report(results, CASES, "gpt-loss-step", "seq", args.seq, config, args.name,
                    f"GPTModel loss step, TP {args.world} + SP, seq {args.seq}, H {args.hidden}, V {args.vocab}, bf16"
                    + (f", {args.mtp} MTP depths" if args.mtp else ""))

if __name__ == "__main__":
    main()
