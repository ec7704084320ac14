"""A Hugging Face causal LM's training step under FSDP2 (``fully_shard`` per decoder layer and at the
root), with and without headloss's patch, over NCCL on ``--world`` GPUs.

A Llama of hidden ``--hidden``, ``--layers`` decoder layers, vocabulary ``--vocab`` (random weights,
bf16), one sequence of ``--seq`` tokens per rank. One step: forward with labels, backward. The labels are the
input ids, or with ``--prompt F`` a copy whose first F of the sequence is -100 (an SFT prompt). Cases: stock,
the patch (``headloss``) and the patch with ``compact=False`` (``headloss-every-row``: the ignored rows
computed, so the head's call waits for nothing). Per rank: median step time (CUDA events; ``--rounds`` rounds
over the cases in turn, in reversed order every other round, ``--reps`` steps each; the median of the rounds'
medians, p20 / p80 the medians of the rounds' p20 / p80) and peak memory above the sharded model and inputs
(GB). Rank 0 prints each round's median and two host times of one step: issued from an empty queue (the host's
own work), and issued right behind a 60 ms sleep kernel (a step that waits for the GPU anywhere takes up to
60 ms more).

  python -m benchmarks.bench_fsdp2 [--world 2] [--seq 4096] [--hidden 2048] [--layers 4] [--vocab 128256]
      [--prompt 0.3] [--rounds 3] [--reps 15]

Writes $OUT (or ./results)/bench_fsdp2.{json,csv,png}; prints a table.
"""

from __future__ import annotations

import os
import statistics

import torch

from benchmarks.common import host_ms, peak_extra_gb, per_rank_report, spawn_world, time_ms, world_parser

CASES = ("stock", "headloss", "headloss-every-row")


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
    labels = ids
    if args.prompt:
        labels = ids.clone()
        labels[:, : int(args.prompt * args.seq)] = -100

    def step():
        model(input_ids=ids, labels=labels).loss.backward()
        model.zero_grad(set_to_none=True)

    sleep = 0  # (calibrated once the GPU is warm: after the first case's timed steps)
    timed: dict[str, list[tuple[float, float, float]]] = {case: [] for case in CASES}
    host: dict[str, list[tuple[float, float]]] = {case: [] for case in CASES}
    peaks: dict[str, float] = {}
    for round_ in range(args.rounds):
        for case in CASES if round_ % 2 == 0 else CASES[::-1]:
            handle = None if case == "stock" else patch(model, compact=case == "headloss")
            timed[case].append(time_ms(step, reps=args.reps))
            if not sleep:
                sleep, slept = sleep_cycles(60.0)
                if rank == 0:
                    print(f"sleep kernel: {sleep} cycles, {slept:.1f} ms", flush=True)
            host[case].append((host_ms(step, args.reps), host_ms(step, args.reps, sleep)))
            if case not in peaks:
                peaks[case] = peak_extra_gb(step)
            if handle is not None:
                handle.undo()
    if rank == 0:
        for case in CASES:
            print(f"{case}: p50 per round " + " ".join(f"{t[0]:.2f}" for t in timed[case])
                  + "; host ms a step " + " ".join(f"{t[0]:.1f}" for t in host[case])
                  + "; behind a 60 ms sleep " + " ".join(f"{t[1]:.1f}" for t in host[case]), flush=True)
    quantiles = ("p50", "p20", "p80")
    out = [{"case": case, **{k: statistics.median(t[i] for t in timed[case]) for i, k in enumerate(quantiles)},
            "peak": peaks[case]} for case in CASES]
    results[rank] = out
    dist.destroy_process_group()


def sleep_cycles(ms: float) -> tuple[int, float]:
    """Clock cycles of ``torch.cuda._sleep`` that take about ``ms`` on this GPU now (timed with CUDA events),
    and what that many took when checked."""

    def took(cycles: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    cycles = int(50_000_000 * ms / took(50_000_000))
    return cycles, took(cycles)


def main(argv: list[str] | None = None) -> None:
    parser = world_parser(__doc__, "bench_fsdp2", 15, seq=4096, hidden=2048, layers=4, vocab=128256)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the cases in turn")
    parser.add_argument("--prompt", type=float, default=0.0,
                        help="the share of each sequence whose labels are -100 (default 0: the labels are the ids)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    if not 0.0 <= args.prompt < 1.0:
        parser.error(f"--prompt: a share in [0, 1), got {args.prompt}")
    results = spawn_world(_rank, args.world, args)
    config = {"world": args.world, "rounds": args.rounds, "seq": args.seq, "hidden": args.hidden, "layers": args.layers,
              "vocab": args.vocab, "prompt": args.prompt, "dtype": "bf16"}
    per_rank_report(results, CASES, "fsdp2-hf-step", "seq", args.seq, config, args.name,
                    f"HF Llama step under FSDP2 on {args.world} GPUs: seq {args.seq}, H {args.hidden}, "
                    f"{args.layers} layers, V {args.vocab}, bf16"
                    + (f", prompt {args.prompt:g}" if args.prompt else ""))

if __name__ == "__main__":
    main()
