"""Distillation from the teacher's top-k log-probs: verl's forward_kl_topk vs headloss (fwd+bwd, bf16).

Rows x H x V (default 16384 x 4096 x 151936, verl's shape) and K teacher entries per row (64, 256),
the teacher a top-k of a distribution near the student's. In one run:

* ``3-gemm-floor``               hidden @ W.T, dh, dW (cuBLAS, full logits): the fused head's floor
* ``verl on logits``             verl 0.9.1's ``compute_forward_kl_topk`` (its default path: the
                                 [N, V] log-softmax, its top-k, the gather) with its loss's
                                 clamp at 0, on materialised logits; d loss / d logits
* ``verl on logits (chunked)``   the same with verl's opt-in ``use_chunked_topk``
* ``headloss on logits``         head_loss with teacher ids / log-probs (topk ``verl``), same logits
* ``headloss CE on logits``      head_loss plain CE on the same logits: the logits path's yardstick
* ``headloss fused``             linear_head_loss from the hidden states with the top-k teacher
                                 (no logits, no teacher GEMM): against the 3-GEMM floor
* ``headloss fused CE``          the same call with plain CE

verl's function is loaded from the installed verl (``pip install --no-deps verl``) file by file,
without verl's package imports (Ray, tensordict); where it is not installed those rows are absent.
Each row checks its loss against headloss's torch path (fp32) on the same inputs. Time and peak
memory above the inputs (logits, hidden states and weight given; their gradients counted).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from types import SimpleNamespace

import torch

from benchmarks.common import Row, measure, out_dir_default, pyplot, write_rows


def load_verl_topk():
    """verl's ``compute_forward_kl_topk`` (verl/trainer/distillation/fsdp/losses.py), or None: the file
    and ``verl/utils/ulysses.py`` loaded by path, its config import stubbed."""
    spec = importlib.util.find_spec("verl")
    if spec is None:
        return None
    root = spec.submodule_search_locations[0]
    saved = {k: sys.modules.get(k) for k in ("verl", "verl.utils", "verl.utils.ulysses", "verl.workers",
                                              "verl.workers.config")}
    try:
        for name in ("verl", "verl.utils", "verl.workers"):
            sys.modules[name] = types.ModuleType(name)
        config = types.ModuleType("verl.workers.config")
        config.DistillationConfig = config.DistillationLossConfig = object
        sys.modules["verl.workers.config"] = config
        ulysses_spec = importlib.util.spec_from_file_location("verl.utils.ulysses", f"{root}/utils/ulysses.py")
        ulysses = importlib.util.module_from_spec(ulysses_spec)
        sys.modules["verl.utils.ulysses"] = ulysses
        ulysses_spec.loader.exec_module(ulysses)
        losses_spec = importlib.util.spec_from_file_location("verl_fsdp_losses",
                                                             f"{root}/trainer/distillation/fsdp/losses.py")
        losses = importlib.util.module_from_spec(losses_spec)
        losses_spec.loader.exec_module(losses)
        return losses.compute_forward_kl_topk
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def make_batch(n: int, h: int, v: int, k: int, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5 * 2.0).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    ids = torch.empty(n, k, dtype=torch.long, device="cuda")
    lp = torch.empty(n, k, dtype=torch.float32, device="cuda")
    with torch.no_grad():
        for start in range(0, n, 2048):  # the teacher: the student's logits plus noise, its top-k
            t = (hidden[start:start + 2048] @ weight.t()).float()
            t += torch.randn(t.shape, device="cuda", generator=gen)
            top = torch.log_softmax(t, -1).topk(k, dim=-1)
            ids[start:start + 2048], lp[start:start + 2048] = top.indices, top.values
            del t, top
    return dict(hidden=hidden.requires_grad_(), weight=weight.requires_grad_(), labels=labels, ids=ids, lp=lp)


def providers(b: dict, verl_topk, logits_too: bool) -> dict:
    from headloss import LossSpec, head_loss, linear_head_loss

    topk = LossSpec(cross_entropy=None, distillation={"teacher": "topk", "topk": "verl"})
    ce = LossSpec()
    h, w, ids, lp = b["hidden"], b["weight"], b["ids"], b["lp"]
    state = {}

    def logits_leaf():
        if "logits" not in state:
            with torch.no_grad():
                state["logits"] = (h @ w.t())[None]
        x = state["logits"].detach().requires_grad_()
        return x

    def floor():
        with torch.no_grad():
            logits = h @ w.t()
            h.grad = logits @ w
            w.grad = logits.t() @ h

    def verl_step(chunked: bool):
        config = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=None,
                                                                   use_chunked_topk=chunked))
        nested = lambda t: torch.nested.as_nested_tensor([t], layout=torch.jagged)  # noqa: E731

        def step():
            x = state["x"]
            out = verl_topk(x, nested(lp), nested(ids), config, "thd")
            loss = out["distillation_losses"].float().clamp_min(0.0).mean()
            loss.backward()
            return loss
        return step

    def head(spec, **kwargs):
        def step():
            out = head_loss(state["x"], b["labels"][None] if spec is ce else None, spec, **kwargs)
            out.loss.backward()
            return out.loss
        return step

    def fused(spec, **kwargs):
        def step():
            out = linear_head_loss(h, w, b["labels"] if spec is ce else None, spec, **kwargs)
            out.loss.backward()
            return out.loss
        return step

    out = {"3-gemm-floor": (floor, None), "headloss fused": (fused(topk, teacher_ids=ids, teacher_logprobs=lp), None),
           "headloss fused CE": (fused(ce), None)}
    if logits_too:
        setup = lambda: state.__setitem__("x", logits_leaf())  # noqa: E731
        out.update({"headloss on logits": (head(topk, teacher_ids=ids[None], teacher_logprobs=lp[None]), setup),
                    "headloss CE on logits": (head(ce), setup)})
        if verl_topk is not None:
            out.update({"verl on logits": (verl_step(False), setup),
                        "verl on logits (chunked)": (verl_step(True), setup)})
    return out


def check(b: dict, verl_topk) -> dict[str, float]:
    """Relative differences of the losses against headloss's torch path (fp32, on 1024 rows)."""
    from headloss import LossSpec, head_loss

    n = 1024
    with torch.no_grad():
        x = (b["hidden"][:n] @ b["weight"].t())[None]
    spec = LossSpec(cross_entropy=None, distillation={"teacher": "topk"})
    kw = dict(teacher_ids=b["ids"][None, :n], teacher_logprobs=b["lp"][None, :n])
    want = float(head_loss(x.float(), None, spec, backend="torch", **kw).loss)
    got = {"headloss on logits": float(head_loss(x, None, spec, backend="triton", **kw).loss)}
    if verl_topk is not None:
        nested = lambda t: torch.nested.as_nested_tensor([t[0]], layout=torch.jagged)  # noqa: E731
        config = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=None, use_chunked_topk=False))
        out = verl_topk(x, nested(kw["teacher_logprobs"]), nested(kw["teacher_ids"]), config, "thd")
        got["verl on logits"] = float(out["distillation_losses"].float().clamp_min(0.0).mean())
    return {name: abs(value - want) / max(abs(want), 1e-12) for name, value in got.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16384])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--k", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--no-logits-above", type=int, default=1 << 30,
                        help="rows above which the logits-path rows are skipped (only the fused head runs)")
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    out_dir = out_dir_default() if args.out is None else __import__("pathlib").Path(args.out)
    verl_topk = load_verl_topk()
    rows: list[Row] = []
    for n in args.rows:
        for k in args.k:
            b = make_batch(n, args.hidden, args.vocab, k)
            errs = check(b, verl_topk)
            case = f"{n}x{args.hidden}x{args.vocab} K={k}"
            print(f"{case}: loss vs torch path " + ", ".join(f"{p} {e:.1e}" for p, e in errs.items()), flush=True)
            for name, (step, setup) in providers(b, verl_topk, n <= args.no_logits_above).items():
                def zero(setup=setup, b=b):
                    b["hidden"].grad = b["weight"].grad = None
                    if setup is not None:
                        setup()
                row = measure(rows, case, name, "rows", n, step, zero,
                              config=dict(rows=n, hidden=args.hidden, vocab=args.vocab, k=k,
                                          check=errs.get(name)), cold_blas=True)
                mem = [r for r in rows if r.metric == "memory" and r.provider == name and r.case == case]
                print(f"  {name:<26} {row.p50 if row.p50 is not None else float('nan'):9.2f} ms  "
                      f"{mem[-1].p50 if mem else float('nan'):6.2f} GB  {row.note}", flush=True)
            del b
            torch.cuda.empty_cache()
    write_rows(rows, out_dir, "bench_distill_topk")
    plot(rows, out_dir / "bench_distill_topk.png")


def plot(rows: list[Row], path) -> None:
    plt = pyplot()
    cases = sorted({r.case for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        data = [(r.provider, r.p50) for r in rows if r.case == case and r.metric == "time" and r.p50 is not None]
        ax.barh([p for p, _ in data], [t for _, t in data])
        ax.set_title(case)
        ax.set_xlabel("ms (fwd+bwd, median)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
