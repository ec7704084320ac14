"""``python -m headloss demo|explain`` -- run a config on a synthetic batch, or print its plan."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import env
from .api import DEFAULT_CHUNK_BYTES, head_loss
from .plan import KernelPlan, compile_plan
from .reference import reference_head_loss
from .routes import ROUTES, Facts, routes_for
from .spec import LossSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "sft_zloss.yaml"


def _spec_arg(path: str | None) -> LossSpec:
    if path is None:
        return LossSpec.from_file(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else LossSpec()
    return LossSpec.from_file(path)


def explain(spec: LossSpec, rows: int, vocab: int, dtype: torch.dtype, with_grad: bool = True,
            seq_len: int = 1024) -> str:
    """The plan of ``spec`` for a [rows, vocab] batch: mode, flags, per-row columns, the scalars its
    terms use, the inputs it takes, passes and bytes, and the routes a call on CUDA takes (rows as
    sequences of ``seq_len`` when the spec has a policy term)."""
    plan = compile_plan(spec, has_targets=spec.needs_targets)
    elem = torch.empty((), dtype=dtype).element_size()
    traffic = plan.traffic_bytes(rows, vocab, elem, elem, with_grad)
    flags = plan.flags._asdict()
    on = [name if value is True else f"{name}={value}" for name, value in flags.items()
          if value is not False and not (name == "DISTILL_KIND" and value < 0) and value != 0]
    off = [name for name, value in flags.items() if value is False]
    scalars = plan.scalars._asdict()
    columns = [name for name in plan.cols._fields[:-1] if getattr(plan.cols, name) >= 0]
    lines = [
        f"mode        {plan.mode}" + (" (stats in forward, gradient pass in backward)" if plan.mode == "deferred"
                                      else " (one launch: stats, epilogue, gradient)"),
        f"flags on    {', '.join(on) or '-'}",
        f"flags off   {', '.join(off) or '-'}   (compiled out)",
        "scalars     " + (", ".join(f"{k}={scalars[k]:g}" for k in plan.used_scalars) or "-"),
        f"per row     {', '.join(columns)} ({plan.cols.N} fp32 values)",
        f"reduction   {plan.reduction}",
        f"inputs      {', '.join(plan.requires)}" + (f"; optional: {', '.join(plan.accepts)}" if plan.accepts else ""),
        f"logit reads {plan.logit_passes(with_grad)} pass(es) over [{rows}, {vocab}] {str(dtype)[6:]}"
        + (" (student and teacher)" if plan.has_teacher else ""),
        f"bytes       reads {traffic['logit_reads'] / 1e9:.3f} GB + gradient writes "
        f"{traffic['grad_writes'] / 1e9:.3f} GB = {traffic['total'] / 1e9:.3f} GB"
        f" (+ O(rows) per-token buffers)",
        *_routes_lines(plan, rows, vocab, elem, seq_len),
    ]
    return "\n".join(lines)


def _routes_lines(plan: KernelPlan, rows: int, vocab: int, elem: int, seq_len: int) -> list[str]:
    """The route of a head_loss and of a linear_head_loss call on CUDA, in eager mode, and the others
    each could take (``route=``)."""
    length = max(1, min(seq_len, rows))
    shape = (max(rows // length, 1), length) if plan.spec.policy is not None else (rows,)
    lines = []
    for entry, label in (("logits", "route"), ("hidden", "lm_head")):
        facts = Facts(entry, "triton", shape, False, False, False, False, False,
                      sequence_fits=len(shape) == 2 and 0 < length * vocab * elem <= 4 * DEFAULT_CHUNK_BYTES)
        default, *others = routes_for(plan, facts)
        more = f" (also: {', '.join(r.name for r in others)})" if others else ""
        lines.append(f"{label:<11} {default.name}: {ROUTES[default.name]}{more}")
    return lines


def demo(spec: LossSpec, rows: int, vocab: int, dtype: torch.dtype, device: str) -> int:
    """Run ``spec`` on a synthetic batch, print the outputs and the check against fp64."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 2.0).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[torch.rand(rows, generator=gen) < 0.1] = spec.ignore_index
    logits, targets = logits.to(device), targets.to(device)

    inputs = synthetic_inputs(spec, logits, gen)
    x = logits.clone().requires_grad_()
    out = head_loss(x, targets if spec.needs_targets else None, spec, **inputs)
    out.loss.sum().backward()
    ref_x = logits.double().requires_grad_()
    ref_inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    ref = reference_head_loss(ref_x, targets if spec.needs_targets else None, spec, **ref_inputs)
    ref.loss.sum().backward()

    backend = "triton kernel" if (logits.is_cuda or env.INTERPRETER) else (
        "plain-torch reference (TRITON_INTERPRET=1 runs the kernel on CPU)"
    )
    print(f"spec: {spec.model_dump(exclude_defaults=True)}")
    print(f"batch: logits [{rows}, {vocab}] {str(dtype)[6:]} on {device}, backend {backend}\n")
    print(f"{'value':<22}{'headloss':>16}{'fp64 reference':>18}{'abs err':>12}")
    worst = 0.0
    got, want = out.metrics_as_floats(), ref.metrics_as_floats()
    for name in got:
        err = abs(got[name] - want[name])
        worst = max(worst, err / max(1.0, abs(want[name])))
        print(f"{'metric ' + name:<22}{got[name]:>16.6f}{want[name]:>18.6f}{err:>12.2e}")
    for name in ("predicted_tokens", "logprobs", "lse", "token_loss", "entropy"):
        a, b = getattr(out, name), getattr(ref, name)
        if a is None:
            continue
        err = (a.double() - b.double()).abs().max().item()
        worst = max(worst, err / max(1.0, b.double().abs().max().item()))
        print(f"{name + ' (max err)':<22}{'':>16}{'':>18}{err:>12.2e}")
    gerr = ((x.grad.double() - ref_x.grad).norm() / ref_x.grad.norm().clamp(min=1e-30)).item()
    print(f"{'gradient (rel err)':<22}{'':>16}{'':>18}{gerr:>12.2e}")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = worst < 1e-4 and gerr < tol
    print(f"\n{'OK' if ok else 'MISMATCH'}: values within 1e-4 relative, gradient within {tol:g}")
    return 0 if ok else 1


def synthetic_inputs(spec: LossSpec, logits: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The per-call inputs a spec's terms need, made up for a [rows, V] batch (one sequence per 16 rows)."""
    rows = logits.shape[0]
    inputs: dict[str, torch.Tensor] = {}
    if spec.distillation is not None:
        inputs["teacher_logits"] = (torch.randn(logits.shape, generator=gen) * 2.0).to(logits)
    if spec.policy is not None:
        seq = torch.arange(rows) // 16
        logp_guess = -torch.rand(rows, generator=gen) * 4.0 - 4.0
        inputs.update(
            sequence_ids=seq,
            advantages=torch.randn(int(seq.max()) + 1 if rows else 0, generator=gen)[seq],
            old_logprobs=logp_guess,
            ref_logprobs=logp_guess + 0.1 * torch.randn(rows, generator=gen),
        )
    return {k: v.to(logits.device) for k, v in inputs.items()}


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2 (argparse's usage block is noise here)
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="headloss", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text in (("demo", "run a config on a synthetic batch and check it against fp64"),
                            ("explain", "print the kernel plan of a config")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", nargs="?", help="YAML/JSON spec (default: configs/sft_zloss.yaml)")
        p.add_argument("--rows", type=_positive("--rows"), default=8192 if name == "explain" else 64)
        p.add_argument("--vocab", type=_positive("--vocab"), default=128256 if name == "explain" else 1000)
        p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if name == "explain" else "fp32")
        if name == "explain":
            p.add_argument("--seq-len", type=_positive("--seq-len"), default=1024,
                           help="tokens per sequence of a policy spec's rows (the routes depend on it)")
        if name == "demo":
            p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        spec = _spec_arg(args.config)
        if args.command == "explain":
            print(explain(spec, args.rows, args.vocab, DTYPES[args.dtype], seq_len=args.seq_len))
            return 0
        device = _device_arg(args.device)
    except (ValueError, TypeError, OSError) as error:
        parser.exit(2, f"headloss {args.command}: error: {_one_line(error)}\n")
    return demo(spec, args.rows, args.vocab, DTYPES[args.dtype], device)


def _device_arg(name: str) -> str:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: unknown device {name!r} (use cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but no CUDA device is available (use --device cpu)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda, got {name!r}")
    return name


def _one_line(error: Exception) -> str:
    """A pydantic error is a block; its first problem (field and message) on one line."""
    text = str(error)
    errors = getattr(error, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        return f"{where}: {first.get('msg')}" if where else first.get("msg", text)
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
