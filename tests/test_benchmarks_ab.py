"""benchmarks/ab.py, the A/B driver of two source trees: it runs each benchmark on both trees (each its
own scripts), alternating, and matches their rows. A stand-in benchmark whose time is the tree's own
constant shows the plumbing end to end on CPU."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.ab import split_benchmarks

ROOT = Path(__file__).resolve().parent.parent

FAKE = '''
import argparse
from pathlib import Path
from benchmarks.common import Row, out_dir_default, write_rows
import headloss
parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=8)
parser.add_argument("--name", default="fake")
args = parser.parse_args()
rows = [Row(case="ce", provider="headloss", metric="time", unit="ms", x_name="rows", x=args.rows, p50=headloss.TIME),
        Row(case=headloss.ONLY, provider="headloss", metric="time", unit="ms", x_name="rows", x=args.rows, p50=1.0)]
write_rows(rows, out_dir_default(), args.name)
'''


def _tree(root: Path, time: float, only: str, scripts: bool = True) -> Path:
    (root / "headloss").mkdir(parents=True)
    (root / "headloss" / "__init__.py").write_text(f"TIME = {time}\nONLY = {only!r}\n")
    if not scripts:
        return root
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "__init__.py").write_text("")
    shutil.copy(ROOT / "benchmarks" / "common.py", root / "benchmarks" / "common.py")
    (root / "benchmarks" / "fake.py").write_text(FAKE)
    return root


def test_split_benchmarks():
    assert split_benchmarks(["a", "--x", "1", ":::", "b", ":::"]) == [["a", "--x", "1"], ["b"]]
    with pytest.raises(SystemExit):
        split_benchmarks([":::"])


def test_rows_match_whatever_the_machine_measured_beside_them(tmp_path):
    """bench_head records the copy bandwidth it measured in each row's config: two runs' rows still match
    (new / base), while a setting that differs (N) keeps rows apart."""
    from benchmarks.ab import compare

    def run(name, gbps, time, n=8192):
        row = dict(case="ce", provider="headloss", metric="time", unit="ms", x_name="V", x=151936, p50=time,
                   config={"dtype": "bf16", "copy_GBps": gbps, "N": n})
        (tmp_path / name).write_text(json.dumps([row, {**row, "config": {**row["config"], "N": n * 2}, "p50": 9.0}]))
        return tmp_path / name

    rows = compare({"base": [run("b1", 4257.8, 2.0), run("b2", 4257.2, 2.2)],
                    "new": [run("n1", 4257.0, 1.0), run("n2", 4257.3, 1.2)]})
    by_n = {r.config["N"]: r for r in rows}
    assert len(rows) == 2 and by_n[8192].p50 == pytest.approx(1.1 / 2.1) and by_n[16384].p50 == pytest.approx(1.0)
    assert all("copy_GBps" not in r.config for r in rows)


@pytest.mark.slow  # (a subprocess per side; the rows' matching is tested in the fast tier above)
@pytest.mark.parametrize("base_scripts", [True, False],
                         ids=["base-scripts", "this-checkout's-scripts"])
def test_each_side_runs_its_own_tree_and_rows_are_matched(tmp_path, base_scripts):
    """Each side's headloss (a constant time apiece); the base's scripts, or this checkout's where it has none."""
    base = _tree(tmp_path / "base", 2.0, "base-only", scripts=base_scripts)
    new = _tree(tmp_path / "new", 1.5, "new-only")
    shutil.copy(ROOT / "benchmarks" / "ab.py", new / "benchmarks" / "ab.py")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks.ab", "--base", str(base), "--rounds", "2", "--name",
                           "cmp", "fake", "--rows", "16"], cwd=new, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(out), "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    # two rounds, alternated: base then new, new then base
    runs = [line for line in done.stdout.splitlines() if line.startswith("$ ")]
    assert [("base" in r and str(base) in r) for r in runs] == [True, False, False, True]
    rows = {r["case"]: r for r in json.loads((out / "cmp.json").read_text())}
    assert rows["ce"]["p50"] == pytest.approx(0.75) and rows["ce"]["x"] == 16
    assert rows["base-only"]["p50"] is None and "base only" in rows["base-only"]["note"]
    assert rows["new-only"]["p50"] is None and "new only" in rows["new-only"]["note"]
    assert (out / "cmp.csv").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "cmp.png").exists()


def test_values_compare_finds_a_moved_number_a_missing_output_and_an_error():
    """benchmarks/ab_values.compare: 0 where every tensor is equal bit for bit (NaN equal to NaN), the
    largest difference where one moved, None where the outputs, routes or errors differ."""
    import torch

    from benchmarks.ab_values import compare

    same = {"route": "fused", "loss": torch.tensor(1.5), "metric nan": torch.tensor(float("nan"))}
    moved = {**same, "loss": torch.tensor(1.5 + 2**-20)}
    rows = {r["call"]: r for r in compare(
        {"a": same, "b": same, "c": same, "d": same, "e": {"error": "ValueError: x"}},
        {"a": dict(same), "b": moved, "c": {k: v for k, v in same.items() if k != "metric nan"},
         "d": {"error": "TypeError: y"}, "e": {"error": "ValueError: x"}})}
    assert rows["a"]["max_diff"] == 0.0 and rows["a"]["tensors"] == 2
    assert rows["b"]["max_diff"] == pytest.approx(2**-20) and "loss" in rows["b"]["note"]
    assert rows["c"]["max_diff"] is None and rows["d"]["max_diff"] is None
    assert rows["e"]["max_diff"] == 0.0  # the same error on both sides
