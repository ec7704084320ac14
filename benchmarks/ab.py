"""A/B of two source trees on one machine: each benchmark run alternately on the base tree and on this
checkout, then every measured row of one side matched with the other's (same case, provider, metric
and size) and their medians compared.

The base tree is a folder holding another commit's ``headloss/`` and, if its scripts are to run, its
``benchmarks/`` (each side then runs its own; a base without ``benchmarks/`` runs this checkout's
scripts on its ``headloss``), e.g.

  git worktree add /tmp/base 7654cd1            # or: git archive 7654cd1 headloss benchmarks | tar -x -C .base
  python -m benchmarks.ab --base /tmp/base --rounds 2 --name one_engine \\
      bench_head --vocab 151936 --cases full ce --providers headloss ::: \\
      bench_linear --rows 8192 --vocab 151936 --providers headloss --no-sweep-chunks ::: \\
      bench_objectives ::: bench_parallel --world 2

Benchmarks are separated by ``:::``; each is a module of benchmarks/ and its arguments (its results
file name is set here: ``<module>_<side><round>``). Rounds alternate the order (base first, then this
checkout first, ...). Writes $OUT (or ./results)/<name>.{json,csv,png}: per matched row the median
over rounds of each side and new / base; prints the table. A row that only one side measured is
listed with its side's value alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import Row, out_dir_default, pyplot, write_rows

HERE = Path(__file__).resolve().parent.parent  # this checkout's root


def split_benchmarks(words: list[str]) -> list[list[str]]:
    """``bench_a --x 1 ::: bench_b`` -> [["bench_a", "--x", "1"], ["bench_b"]]."""
    groups, current = [], []
    for word in words:
        if word == ":::":
            if current:
                groups.append(current)
            current = []
        else:
            current.append(word)
    if current:
        groups.append(current)
    if not groups:
        raise SystemExit("ab: name at least one benchmark (a module of benchmarks/ and its arguments)")
    return groups


def name_flag(root: Path, module: str) -> str:
    """The flag that names a benchmark's results file: ``--stem`` or ``--name``."""
    source = (root / "benchmarks" / f"{module}.py").read_text()
    return "--stem" if '"--stem"' in source else "--name"


def run_side(root: Path, command: list[str], stem: str, out: Path) -> Path:
    """One benchmark on the tree at ``root`` (its headloss; its benchmarks, else this checkout's), results
    as ``stem``."""
    module, *args = command
    scripts = root if (root / "benchmarks").is_dir() else HERE
    full = [sys.executable, "-m", f"benchmarks.{module}", *args, name_flag(scripts, module), stem]
    env = {**os.environ, "OUT": str(out)}
    if scripts is not root:  # (the working directory's headloss first, then this checkout's benchmarks)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    print(f"\n$ (cd {root}) {' '.join(full[1:])}", flush=True)
    subprocess.run(full, cwd=root, env=env, check=True)
    return out / f"{stem}.json"


MEASURED = ("copy_GBps",)
"""Config entries a benchmark measures on the machine (bench_head's copy bandwidth): not part of a row's
identity, so two runs' rows still match."""


def _key(row: dict) -> tuple:
    config = {k: v for k, v in row.get("config", {}).items() if k not in MEASURED}
    return (row["case"], row["provider"], row["metric"], row["x_name"], row["x"], json.dumps(config, sort_keys=True))


def compare(runs: dict[str, list[Path]]) -> list[Row]:
    """Rows of new / base: each matched row's median over the rounds of each side."""
    values: dict[str, dict[tuple, list[float]]] = {}
    units: dict[tuple, str] = {}
    for side, paths in runs.items():
        found = values.setdefault(side, {})
        for path in paths:
            for row in json.loads(path.read_text()):
                if row["p50"] is None:
                    continue
                found.setdefault(_key(row), []).append(row["p50"])
                units[_key(row)] = row["unit"]
    rows = []
    for key in sorted(set(values["base"]) | set(values["new"]), key=str):
        base, new = values["base"].get(key), values["new"].get(key)
        b = statistics.median(base) if base else None
        n = statistics.median(new) if new else None
        case, provider, metric, x_name, x, config = key
        note = f"base {b:.4g} new {n:.4g}" if b and n else ("base only" if b else "new only")
        rows.append(Row(case=case, provider=provider, metric=metric, unit="new/base", x_name=x_name, x=x,
                        p50=n / b if b and n else None, p20=b, p80=n,
                        note=f"{note} ({units[key]}; p20: base median, p80: new median)",
                        config=json.loads(config)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="a folder with the base's headloss/ and benchmarks/")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="ab")
    parser.add_argument("benchmarks", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    base = args.base.resolve()
    if not (base / "headloss").is_dir():
        raise SystemExit(f"--base: {base} has no headloss/ (copy the base commit's headloss/ there)")
    out = out_dir_default().resolve()
    sides = {"base": base, "new": HERE}
    runs: dict[str, list[Path]] = {"base": [], "new": []}
    for r in range(args.rounds):
        order = ("base", "new") if r % 2 == 0 else ("new", "base")
        for command in split_benchmarks(args.benchmarks):
            for side in order:
                runs[side].append(run_side(sides[side], command, f"{command[0]}_{side}{r + 1}", out))
    rows = compare(runs)
    write_rows(rows, out, args.name)
    print(f"\n{'case':28s} {'provider':22s} {'metric':7s} {'x':>7s} {'base':>10s} {'new':>10s} {'new/base':>9s}")
    for row in rows:
        ratio = f"{row.p50:9.3f}" if row.p50 is not None else f"{'-':>9s}"
        b = f"{row.p20:10.4g}" if row.p20 is not None else f"{'-':>10s}"
        n = f"{row.p80:10.4g}" if row.p80 is not None else f"{'-':>10s}"
        print(f"{row.case[:28]:28s} {row.provider[:22]:22s} {row.metric:7s} {row.x:7d} {b} {n} {ratio}")
    timed = [row for row in rows if row.metric == "time" and row.p50 is not None]
    try:
        plt = pyplot()
    except ImportError:
        print("(no matplotlib here: no plot)")
        timed = []
    if timed:
        fig, ax = plt.subplots(figsize=(8, 0.3 * len(timed) + 1.5))
        ax.barh([f"{r.case} {r.provider} {r.x}"[:60] for r in timed], [r.p50 for r in timed])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("new / base, median time")
        fig.tight_layout()
        fig.savefig(out / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
