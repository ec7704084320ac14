"""Do two source trees compute the same numbers? A fixed list of calls -- the core terms over dtypes,
reductions, transforms and odd shapes on both entry points, every distillation form, and every policy
route -- runs on the base tree and on this checkout (each in a process of its own), and every loss,
metric, per-token output and gradient is compared bitwise. A change meant to move no number (a
restructuring) should show 0 differences; its route column says which path each call took.

  python -m benchmarks.ab_values --base /tmp/base            # CUDA here, else the CPU interpreter
  python -m benchmarks.ab_values --base .base --name same_values

The base tree is a folder with another commit's ``headloss/`` (as for benchmarks/ab.py). Writes $OUT (or
./results)/<name>.{json,csv,png}: per call its route, the tensors compared and the largest difference;
prints a table of the calls that differ (or says none does) and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(shape, dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed), dtype=torch.float64) * scale).to(dtype)


def _targets(shape, vocab: int, seed: int, ignored: float, ignore_index: int) -> torch.Tensor:
    g = _gen(seed + 7919)
    t = torch.randint(0, vocab, tuple(shape), generator=g)
    m = torch.rand(tuple(shape), generator=g) < ignored
    m.reshape(-1)[0] = False
    return torch.where(m, torch.full_like(t, ignore_index), t)


def core_specs() -> list[dict]:
    """Specs of the core terms: each term alone and together, every reduction, a transform."""
    return [
        {},
        {"z_loss": {"weight": 1e-3}, "token_accuracy": True, "entropy": {"weight": 0.0},
         "outputs": ["predicted_tokens", "logprobs", "lse", "token_loss", "entropy"]},
        {"cross_entropy": {"label_smoothing": 0.1}, "dft": {"weight": 0.5}},
        {"reduction": "sum", "entropy": {"weight": -0.1}, "transform": {"softcap": 20.0, "temperature": 1.3}},
        {"reduction": "none", "outputs": ["logprobs", "entropy"], "ignore_index": -1},
        {"differentiable_outputs": True, "outputs": ["logprobs", "lse", "token_loss"],
         "transform": {"logit_scale": 0.7}},
    ]


def _objective(out) -> torch.Tensor:
    loss = out.loss.float().sum()
    for name in ("logprobs", "lse", "token_loss", "entropy"):
        value = getattr(out, name, None)
        if value is not None and value.requires_grad:
            loss = loss + 0.1 * value.float().sum()
    return loss


def run_calls(device: str) -> dict[str, dict[str, object]]:
    """Every call's outputs and gradients on ``device``, by call name (errors as a string)."""
    import headloss
    from headloss import LossSpec

    warnings.filterwarnings("ignore")
    results: dict[str, dict[str, object]] = {}

    def record(name, make, leaves):
        try:
            out = make()
            _objective(out).backward()
        except Exception as exc:  # a call that fails on one side is a difference, not a crash
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            return
        row: dict[str, object] = {"route": out.route, "loss": out.loss.detach().cpu()}
        row.update({"metric " + k: torch.as_tensor(v).detach().cpu() for k, v in out.metrics.items()})
        for name_ in ("predicted_tokens", "logprobs", "lse", "token_loss", "entropy"):
            value = getattr(out, name_, None)
            if value is not None:
                row["output " + name_] = value.detach().cpu()
        row.update({f"grad {i}": leaf.grad.detach().cpu() for i, leaf in enumerate(leaves) if leaf.grad is not None})
        results[name] = row

    for s, spec_data in enumerate(core_specs()):
        spec = LossSpec.model_validate(spec_data)
        for dtype_name, dtype in DTYPES.items():
            for shape, vocab in (((7,), 37), ((2, 5), 129), ((1,), 3)):
                seed = 100 * s + len(shape) + vocab
                x = _logits((*shape, vocab), dtype, seed).to(device).requires_grad_()
                y = _targets(shape, vocab, seed, 0.3, spec.ignore_index).to(device)
                tag = f"core{s} {dtype_name} {shape}x{vocab}"
                record(f"{tag} logits", lambda x=x, y=y, spec=spec: headloss.head_loss(x, y, spec), [x])
                if spec.reduction == "none":
                    continue
                h = _logits((*shape, 12), dtype, seed + 1, 1.0).to(device).requires_grad_()
                w = _logits((vocab, 12), dtype, seed + 2, 0.5).to(device).requires_grad_()
                chunk = vocab * 3 * h.element_size()  # a few rows per chunk
                record(f"{tag} lm_head", lambda h=h, w=w, y=y, spec=spec, chunk=chunk: headloss.linear_head_loss(
                    h, w, y, spec, chunk_bytes=chunk), [h, w])

    b, t, v = 2, 5, 37
    g = _gen(5)
    teacher = (torch.randn(b, t, v, generator=g) * 2).to(device)
    ids = torch.stack([torch.randperm(v, generator=g)[:4] for _ in range(b * t)]).view(b, t, 4)
    lp = torch.log_softmax(torch.randn(b, t, v, generator=g), -1).gather(-1, ids)
    ids, lp = ids.to(device), lp.to(device)
    adv, old, ref = (torch.randn(b, generator=g).to(device), (-torch.rand(b, t, generator=g) * 3).to(device),
                     (-torch.rand(b, t, generator=g) * 3).to(device))

    def special(name, spec_data, entry, route=None, **inputs):
        spec = LossSpec.model_validate(spec_data)
        x = _logits((b, t, v), torch.float32, 11).to(device).requires_grad_()
        y = _targets((b, t), v, 11, 0.2, -100).to(device)
        extra = {"route": route} if route else {}
        if entry == "logits":
            record(name, lambda: headloss.head_loss(x, y, spec, **inputs, **extra), [x])
            return
        h = _logits((b, t, 12), torch.float32, 12, 1.0).to(device).requires_grad_()
        w = _logits((v, 12), torch.float32, 13, 0.5).to(device).requires_grad_()
        record(name, lambda: headloss.linear_head_loss(h, w, y, spec, chunk_bytes=v * 4 * 4, **inputs, **extra),
               [h, w])

    for div in ("forward_kl", "reverse_kl", "jsd"):
        for entry in ("logits", "hidden"):
            special(f"teacher logits {div} {entry}", {"distillation": {"divergence": div}}, entry,
                    teacher_logits=teacher)
    for form in ("verl", "renormalized", "rest"):
        special(f"teacher topk {form}", {"distillation": {"teacher": "topk", "topk": form}}, "logits",
                teacher_ids=ids, teacher_logprobs=lp)
    special("teacher token k3", {"distillation": {"teacher": "token"}}, "logits", teacher_logprobs=lp[..., 0])
    grpo = {"cross_entropy": None, "entropy": {"weight": 0.0}, "policy": {"loss_type": "dapo", "kl_beta": 0.04}}
    for entry in ("logits", "hidden"):
        special(f"grpo {entry}", grpo, entry, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    gspo = {"cross_entropy": None, "policy": {"loss_type": "grpo", "importance_sampling": "sequence"}}
    for route in ("deferred+kernels", "deferred+torch"):
        special(f"gspo {route}", gspo, "logits", route=route, advantages=adv, old_logprobs=old)
    for route in ("sequences+kernels", "sequences+torch", "deferred+kernels", "deferred+torch"):
        special(f"gspo lm_head:{route}", gspo, "hidden", route="lm_head:" + route, advantages=adv, old_logprobs=old)
    for objective in ("kl_cov", "clip_cov"):
        cov = {"cross_entropy": None, "policy": {"objective": objective, "loss_type": "dapo"}}
        special(f"{objective} lm_head:covariance", cov, "hidden", route="lm_head:covariance", advantages=adv,
                old_logprobs=old)
        special(f"{objective} logits", cov, "logits", advantages=adv, old_logprobs=old)
    top = {"cross_entropy": None, "policy": {"loss_type": "dapo", "top_entropy_quantile": 0.5}}
    special("top-entropy lm_head:entropy-guess", top, "hidden", route="lm_head:entropy-guess", advantages=adv,
            old_logprobs=old)
    special("top-entropy logits", top, "logits", advantages=adv, old_logprobs=old)
    return results


def _side(root: Path, path: Path, device: str) -> None:
    """This script's --run (this checkout's) on the headloss of the tree at ``root``, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", str(path), "--device", device], cwd=root,
                   env=env, check=True)


def compare(base: dict, new: dict) -> list[dict]:
    """Per call: its route, the tensors compared, the largest absolute difference (NaN where equal NaN)."""
    rows = []
    for name in sorted(set(base) | set(new)):
        a, b = base.get(name, {"error": "missing"}), new.get(name, {"error": "missing"})
        row = {"call": name, "route": b.get("route", ""), "tensors": 0, "max_diff": 0.0, "note": ""}
        if "error" in a or "error" in b:
            row.update(max_diff=None if a.get("error") != b.get("error") else 0.0,
                       note=f"base: {a.get('error', 'ran')}; new: {b.get('error', 'ran')}"[:200])
        elif set(a) != set(b) or a["route"] != b["route"]:
            row.update(max_diff=None, note=f"outputs differ: {sorted(set(a) ^ set(b))}, routes {a['route']} / "
                                           f"{b['route']}")
        else:
            for key in a:
                if key == "route":
                    continue
                x, y = a[key], b[key]
                row["tensors"] += 1
                if x.shape != y.shape or x.dtype != y.dtype:
                    row.update(max_diff=None, note=f"{key}: {tuple(x.shape)} {x.dtype} / {tuple(y.shape)} {y.dtype}")
                    break
                same = torch.equal(x, y) or torch.equal(torch.nan_to_num(x.float(), nan=1.5e38),
                                                         torch.nan_to_num(y.float(), nan=1.5e38))
                if not same:
                    row["max_diff"] = max(row["max_diff"], float((x.float() - y.float()).abs().max()))
                    row["note"] = row["note"] or f"first: {key}"
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="a folder with the base commit's headloss/")
    parser.add_argument("--name", default="ab_values")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)  # one side: save its results here
    args = parser.parse_args()
    if args.run is not None:
        import headloss

        if not Path(headloss.__file__).resolve().is_relative_to(Path.cwd().resolve()):
            raise SystemExit(f"ab_values --run: imported {headloss.__file__}, not the tree at {Path.cwd()}")
        torch.save(run_calls(args.device), args.run)
        return
    if args.base is None or not (args.base / "headloss").is_dir():
        raise SystemExit("--base: a folder with the base commit's headloss/ is required")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {side: Path(tmp) / f"{side}.pt" for side in ("base", "new")}
        _side(args.base.resolve(), paths["base"], args.device)
        _side(HERE, paths["new"], args.device)
        base, new = (torch.load(paths[side], weights_only=False) for side in ("base", "new"))
    rows = compare(base, new)
    from benchmarks.common import Row, out_dir_default, pyplot, write_rows

    out = out_dir_default()
    write_rows([Row(case=r["call"], provider=r["route"], metric="max_abs_diff", unit="", x_name="tensors",
                    x=r["tensors"], p50=r["max_diff"], note=r["note"], config={"device": args.device})
                for r in rows], out, args.name)
    differ = [r for r in rows if r["max_diff"] != 0.0]
    routes = sorted({r["route"] for r in rows if r["route"]})
    tensors = sum(r["tensors"] for r in rows)
    print(f"{len(rows)} calls ({tensors} tensors) on {args.device}, routes: {', '.join(routes)}")
    for r in differ:
        print(f"  differs: {r['call']:45s} {r['route']:28s} {r['max_diff']} {r['note']}")
    print("every call equal, bit for bit" if not differ else f"{len(differ)} calls differ")
    try:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 2.5))
        counts = {route: sum(1 for r in rows if r["route"] == route) for route in routes}
        ax.barh(list(counts), list(counts.values()))
        ax.set_xlabel(f"calls per route ({len(differ)} of {len(rows)} differ)")
        fig.tight_layout()
        fig.savefig(out / f"{args.name}.png", dpi=120)
    except ImportError:
        print("(no matplotlib here: no plot)")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
