"""Shared benchmark plumbing: timing, memory, tidy rows, table, plot."""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Row:
    """One measurement, in the tidy layout a plot script reads."""

    case: str  # what is computed, e.g. "ce+z+acc+argmax+entropy"
    provider: str  # torch-eager, torch-compile, liger, headloss, ...
    metric: str  # "time" or "memory"
    unit: str  # "ms" or "GB"
    x_name: str
    x: int
    p50: float | None
    p20: float | None = None
    p80: float | None = None
    note: str = ""
    config: dict = field(default_factory=dict)
    gpu: str = ""
    timestamp: str = ""


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def time_ms(
    step: Callable[[], object],
    setup: Callable[[], object] | None = None,
    reps: int = 25,
    warmup: int = 3,
) -> tuple[float, float, float]:
    """(p50, p20, p80) of ``step`` in ms from CUDA events around each call.

    ``setup`` runs before every call, outside the events: it restores inputs that a step
    destroys (in-place gradients) and, being a multi-GB copy, also flushes the L2 cache.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        step()
    events = []
    for _ in range(reps):
        if setup is not None:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]
    return pick(0.5), pick(0.2), pick(0.8)


def host_ms(step: Callable[[], object], reps: int = 100, sleep: int = 0) -> float:
    """Median wall time from the call to its return (the GPU may still run), synchronised between calls: from
    an empty queue the host does not wait for the GPU to make room, so this is its own work. ``sleep``: clock
    cycles of a sleep kernel queued before each call (outside the time): a call that waits for the GPU
    anywhere (a host sync, an event's) takes that wait into its time."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if sleep:
            torch.cuda._sleep(sleep)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[reps // 2] * 1e3


@contextlib.contextmanager
def launch_forced(block: int | None, warps: int | None) -> Iterator[None]:
    """The head kernels' block and warps forced (kernels.launch.LAUNCH_OVERRIDES; None: the default's),
    back to the defaults after."""
    from headloss.kernels.launch import LAUNCH_OVERRIDES

    LAUNCH_OVERRIDES.update(block_v=block, num_warps=warps)
    try:
        yield
    finally:
        LAUNCH_OVERRIDES.update(block_v=None, num_warps=None)


@contextlib.contextmanager
def dw_gemm_forced(impl: str) -> Iterator[None]:
    """The lm_head's dW accumulation forced to ``impl`` (dw_gemm.DW_GEMM), the setting found restored after."""
    from headloss import dw_gemm

    before = dw_gemm.DW_GEMM["impl"]
    dw_gemm.DW_GEMM["impl"] = impl
    try:
        yield
    finally:
        dw_gemm.DW_GEMM["impl"] = before


def three_gemms_ms(hidden: torch.Tensor, weight: torch.Tensor, reps: int = 7) -> float:
    """Median ms of an lm_head's 3 GEMMs back to back on the whole batch (logits, dh, dW; no autograd):
    the floor the fused head is measured against."""
    def gemms():
        logits = hidden @ weight.t()
        torch.mm(logits, weight)
        torch.mm(logits.t(), hidden)

    with torch.no_grad():
        gemms()
        return time_ms(gemms, reps=reps)[0]


def peak_extra_gb(step: Callable[[], object], setup: Callable[[], object] | None = None,
                  cold_blas: bool = False) -> float:
    """Peak memory allocated while ``step`` runs, above what was allocated before it (GB).

    ``cold_blas``: free cuBLAS's per-stream workspaces (32 MiB on Hopper) first, so that the step
    allocates them again and they count, as in a measurement from a fresh process.
    """
    if setup is not None:
        setup()
    torch.cuda.synchronize()
    if cold_blas:
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def kernel_device_us(step: Callable[[], object], reps: int) -> dict[str, list[float]]:
    """Device time (us) of every CUDA kernel launched by ``reps`` calls of ``step``, by kernel name,
    from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type.name == "CUDA":
            per.setdefault(evt.name, []).append(evt.device_time)
    return per


def copy_bandwidth_gbs(n_bytes: int = 4 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written (GB/s)."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms, _, _ = time_ms(lambda: dst.copy_(src), reps=50)
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def measure(
    rows: list[Row],
    case: str,
    provider: str,
    x_name: str,
    x: int,
    step: Callable[[], object],
    setup: Callable[[], object] | None = None,
    config: dict | None = None,
    note: str = "",
    cold_blas: bool = False,
) -> Row:
    """Time and peak memory of ``step``; records rows (OOM and errors become a note)."""
    stamp = _dt.datetime.now().isoformat(timespec="seconds")
    common = dict(case=case, provider=provider, x_name=x_name, x=x, config=config or {}, gpu=gpu_name(),
                  timestamp=stamp)
    try:
        if setup is not None:
            setup()
        step()  # compile / warm up outside the measurement
        mem = peak_extra_gb(step, setup, cold_blas)
        p50, p20, p80 = time_ms(step, setup)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        row = Row(metric="time", unit="ms", p50=None, note="OOM", **common)
        rows.append(row)
        return row
    except Exception as exc:  # a peer failing is a result, not a crash of the whole run
        torch.cuda.empty_cache()
        row = Row(metric="time", unit="ms", p50=None, note=f"error: {type(exc).__name__}: {exc}"[:200], **common)
        rows.append(row)
        return row
    row = Row(metric="time", unit="ms", p50=p50, p20=p20, p80=p80, note=note, **common)
    rows.append(row)
    rows.append(Row(metric="memory", unit="GB", p50=mem, note=note, **common))
    return row


def write_rows(rows: list[Row], out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js, cs = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    data = [asdict(r) for r in rows]
    js.write_text(json.dumps(data, indent=1))
    with cs.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(data[0]) if data else ["case"])
        writer.writeheader()
        for d in data:
            writer.writerow({**d, "config": json.dumps(d["config"])})
    return js, cs


def out_dir_default() -> Path:
    return Path(os.environ.get("OUT", "results"))


def import_trl(module: str):
    """``importlib.import_module(module)`` for a trl module; trl imports ``datasets`` (for types),
    which the GPU image lacks: a stub stands in when it is not installed."""
    import importlib
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("datasets") is None and "datasets" not in sys.modules:
        stub = types.ModuleType("datasets")
        stub.IterableDataset = stub.Dataset = type("Dataset", (), {})
        sys.modules["datasets"] = stub
    return importlib.import_module(module)


def pyplot():
    """matplotlib.pyplot on the Agg backend (the plots are files; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def world_parser(doc: str, name: str, reps: int, **sizes: int) -> argparse.ArgumentParser:
    """The multi-GPU benchmarks' arguments: --world (the GPUs here, 2 at most by default), each of
    ``sizes`` as --<size> with its default, --reps and --name (the results file's name)."""
    import torch

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=min(2, torch.cuda.device_count()))
    for size, default in sizes.items():
        parser.add_argument(f"--{size}", type=int, default=default)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--name", default=name, help=f"results file name (default {name})")
    return parser


def spawn_world(rank_fn: Callable, world: int, args) -> dict:
    """``rank_fn(rank, world, port, args, results)`` on ``world`` spawned processes (a free local port
    for their process group); returns ``results``, the dict each rank writes its rows into."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(rank_fn, args=(world, port, args, shared), nprocs=world, join=True)
        return {k: list(v) for k, v in shared.items()}


def per_rank_report(results: dict, cases: tuple[str, ...], case: str, x_name: str, x: int, config: dict,
                    name: str, title: str) -> list[Row]:
    """Rows, a printed table and a bar plot of per-rank cases (each rank's list of {"case", "p50",
    "p20", "p80", "peak"} in ``cases`` order): rank 0's median time against the first case's, the
    slowest rank's, the largest peak over the ranks. Writes $OUT (or ./results)/<name>.{json,csv,png}."""
    rows: list[Row] = []
    base = results[0][0]["p50"]
    print(f"\n{'case':20s} {'p50 ms (rank 0)':>16s} {'x ' + cases[0]:>12s} {'slowest rank ms':>16s} "
          f"{'peak GB/rank':>13s}")
    for i, provider in enumerate(cases):
        per_rank = [results[r][i] for r in sorted(results)]
        p50, slowest, peak = per_rank[0]["p50"], max(r["p50"] for r in per_rank), max(r["peak"] for r in per_rank)
        print(f"{provider:20s} {p50:16.2f} {p50 / base:12.2f} {slowest:16.2f} {peak:13.2f}")
        rows.append(Row(case=case, provider=provider, metric="time", unit="ms", x_name=x_name, x=x, p50=p50,
                        p20=per_rank[0]["p20"], p80=per_rank[0]["p80"], note=f"rank 0; slowest rank {slowest:.2f}",
                        config=config, gpu=gpu_name()))
        rows.append(Row(case=case, provider=provider, metric="memory", unit="GB", x_name=x_name, x=x, p50=peak,
                        note="max over ranks", config=config, gpu=gpu_name()))
    out = out_dir_default()
    write_rows(rows, out, name)
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.barh(cases, [r.p50 for r in rows if r.metric == "time"])
    a.set_xlabel("ms per step (rank 0)")
    b.barh(cases, [r.p50 for r in rows if r.metric == "memory"])
    b.set_xlabel("peak GB per rank")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    return rows
