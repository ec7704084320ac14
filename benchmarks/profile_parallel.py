"""Where the time of one vocab-parallel head_loss call goes, on each rank (NCCL).

  python -m benchmarks.profile_parallel [--world 2] [--rows 8192] [--vocab 128256] [--name profile_parallel]
                                        [--cprofile 50]

For the CE-only and full specs on logits [N, V / world] per rank (bf16, fwd+bwd): the back-to-back
step time (CUDA events, as benchmarks.bench_parallel), the synced step time, the host time of the call
(from the call to its return, synchronised between calls), and each kernel's device time (torch.profiler,
median over the profiled steps; the all_gather is NCCL's kernel); ``--cprofile``: rank 0's Python profile
of that many synced calls. Writes $OUT (or ./results)/<name>.json and prints a table per rank.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import kernel_device_us, out_dir_default, spawn_world, time_ms, world_parser

SPECS = {"ce": {}, "full": dict(z_loss={"weight": 1e-4}, entropy={"weight": 0.0}, token_accuracy=True,
                                outputs=("predicted_tokens",))}


def _rank(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import headloss

    n, v = args.rows, args.vocab
    width = v // world
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, width, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
    out = []
    for case, fields in SPECS.items():
        spec = headloss.LossSpec(**fields)

        def step(spec=spec):
            logits.grad = None
            headloss.head_loss(logits, ids, spec, group=dist.group.WORLD).loss.backward()

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        b2b, _, _ = time_ms(step, reps=args.reps)
        synced, host = [], []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            host.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            synced.append(time.perf_counter() - start)
        kernels = {name: statistics.median(t) for name, t in kernel_device_us(step, 10).items()}
        if args.cprofile:  # every rank (their calls meet in the all_gather), rank 0's printed
            import cProfile
            import io
            import pstats

            profiler = cProfile.Profile()
            for _ in range(args.cprofile):
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda.synchronize()
                profiler.enable()
                step()
                profiler.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text).strip_dirs()
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(30)
            if rank == 0:
                print(f"--- rank 0 {case}: cProfile of {args.cprofile} calls\n{text.getvalue()}")
        out.append(dict(case=case, b2b_ms=b2b, synced_ms=statistics.median(synced) * 1e3,
                        host_ms=statistics.median(host) * 1e3, kernels_us=kernels,
                        headloss=os.path.dirname(headloss.__file__)))
    results[rank] = out
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = world_parser(__doc__, "profile_parallel", 25, rows=8192, vocab=128256)
    parser.add_argument("--cprofile", type=int, default=0, help="also profile this many calls on rank 0 (cProfile)")
    args = parser.parse_args(argv)
    results = spawn_world(_rank, args.world, args)
    for rank in sorted(results):
        for entry in results[rank]:
            print(f"rank {rank} {entry['case']:5s} b2b {entry['b2b_ms']:.3f} ms  synced {entry['synced_ms']:.3f} ms  "
                  f"host {entry['host_ms']:.3f} ms  ({entry['headloss']})")
            for name, us in sorted(entry["kernels_us"].items(), key=lambda item: -item[1]):
                print(f"    {us:9.1f} us  {name[:90]}")
    out = out_dir_default()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"config": vars(args), "ranks": results}, indent=1))


if __name__ == "__main__":
    main()
