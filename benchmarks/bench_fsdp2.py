"""A Hugging Face causal LM's training step under FSDP2 (``fully_shard`` per decoder layer and at the
root), with and without headloss's patch, over NCCL on ``--world`` GPUs.

A Llama of hidden ``--hidden``, ``--layers`` decoder layers, vocabulary ``--vocab`` (random weights,
bf16), one sequence of ``--seq`` tokens per rank. One step: forward with labels, backward. Per rank:
median step time (CUDA events) and peak memory above the sharded model and inputs (GB).

  python -m benchmarks.bench_fsdp2 [--world 2] [--seq 4096] [--hidden 2048] [--layers 4] [--vocab 128256]

Writes $OUT (or ./results)/bench_fsdp2.{json,csv,png}; prints a table.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.multiprocessing as mp

from benchmarks.common import Row, gpu_name, out_dir_default, peak_extra_gb, pyplot, time_ms, write_rows

CASES = ("stock", "headloss")


def _rank(rank: int, world: int, port: int, args, results) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from headloss.integrations.transformers import patch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
                                      num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 256,
                                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    mesh = init_device_mesh("cuda", (world,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    gen = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=gen).to(device)
    out = []
    for case in CASES:
        handle = patch(model) if case == "headloss" else None

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        p50, p20, p80 = time_ms(step, reps=args.reps)
        peak = peak_extra_gb(step)
        out.append({"case": case, "p50": p50, "p20": p20, "p80": p80, "peak": peak})
        if handle is not None:
            handle.undo()
    results[rank] = out
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=min(2, torch.cuda.device_count()))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--name", default="bench_fsdp2")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_rank, args=(args.world, port, args, shared), nprocs=args.world, join=True)
        results = dict(shared)
    config = {"world": args.world, "seq": args.seq, "hidden": args.hidden, "layers": args.layers,
              "vocab": args.vocab, "dtype": "bf16"}
    rows: list[Row] = []
    base = results[0][0]["p50"]
    print(f"\n{'case':10s} {'p50 ms (rank 0)':>16s} {'x stock':>8s} {'slowest rank ms':>16s} {'peak GB/rank':>13s}")
    for i, case in enumerate(CASES):
        per_rank = [results[r][i] for r in sorted(results)]
        p50, slowest, peak = per_rank[0]["p50"], max(r["p50"] for r in per_rank), max(r["peak"] for r in per_rank)
        print(f"{case:10s} {p50:16.2f} {p50 / base:8.2f} {slowest:16.2f} {peak:13.2f}")
        rows.append(Row(case="fsdp2-hf-step", provider=case, metric="time", unit="ms", x_name="seq", x=args.seq,
                        p50=p50, p20=per_rank[0]["p20"], p80=per_rank[0]["p80"],
                        note=f"rank 0; slowest rank {slowest:.2f}", config=config, gpu=gpu_name()))
        rows.append(Row(case="fsdp2-hf-step", provider=case, metric="memory", unit="GB", x_name="seq", x=args.seq,
                        p50=peak, note="max over ranks", config=config, gpu=gpu_name()))
    out = out_dir_default()
    write_rows(rows, out, args.name)
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3))
    a.barh(CASES, [r.p50 for r in rows if r.metric == "time"])
    a.set_xlabel("ms per step (rank 0)")
    b.barh(CASES, [r.p50 for r in rows if r.metric == "memory"])
    b.set_xlabel("peak GB per rank")
    fig.suptitle(f"HF Llama step under FSDP2 on {args.world} GPUs: seq {args.seq}, H {args.hidden}, "
                 f"{args.layers} layers, V {args.vocab}, bf16")
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
