"""``python -m headloss demo|explain`` -- run a config on a synthetic batch, or print its plan."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

from . import env
from .api import head_loss
from .chunks import DEFAULT_CHUNK_BYTES
from .plan import KernelPlan, compile_plan
from .policy_tables import IMPORTANCE_SAMPLING, KL_ESTIMATORS, LOSS_TYPES, OBJECTIVES
from .reference import reference_head_loss
from .registry import ROW_COLUMNS
from .routes import ROUTES, Facts, routes_for
from .spec import OUTPUT_NAMES, LossSpec, Policy

DESCRIPTION = "Run a loss spec on a synthetic batch (demo), or print its kernel plan and routes (explain)."

POLICY_FLAGS = ("HAS_POLICY", "OBJECTIVE", "CISPO_VERL", "LOG_RATIO_CLAMP", "KL_EST", "KL_CLAMP", "KL_K2_GRAD",
                "KL_IS_CORR", "ENTROPY_TOKEN_MEAN")
"""The kernel flags of the policy term: explain leaves them out of a spec without one."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "sft_zloss.yaml"


def _spec_arg(path: str | None) -> LossSpec:
    """The spec file the command names; its errors name the ``config`` argument."""
    if path is None:
        return LossSpec.from_file(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else LossSpec()
    try:
        return LossSpec.from_file(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"config: {_one_line(error).removeprefix('path: ')}") from None


def explain(spec: LossSpec, rows: int, vocab: int, dtype: torch.dtype, with_grad: bool = True,
            seq_len: int = 1024) -> str:
    """The plan of ``spec`` for a [rows, vocab] batch: mode, flags, per-row columns, the scalars its
    terms use, the inputs it takes, passes and bytes, the policy term's objective, ratio, aggregation
    and KL penalty with the values each reads (when it has one), and the routes a call on CUDA takes
    (rows as sequences of ``seq_len`` when the spec has a policy term)."""
    selecting = "selected_logprobs" in spec.outputs  # (shown with DEMO_SELECTED ids per row)
    plan = compile_plan(spec, has_targets=spec.needs_targets, selected_k=DEMO_SELECTED if selecting else 0)
    elem = torch.empty((), dtype=dtype).element_size()
    traffic = plan.traffic_bytes(rows, vocab, elem, elem, with_grad)
    unread = {0: set(), 1: {"TOKEN_EST", "TOKEN_CLAMP", "TOKEN_K2_GRAD"}, 2: {"TOPK_FORM", "TOPK_DIV", "TOPK_CLAMP"}}
    unread[0] = unread[1] | unread[2]  # (the sparse teacher's flags of the form the plan does not run)
    flags = {name: value for name, value in plan.flags._asdict().items()
             if not (spec.policy is None and name in POLICY_FLAGS or not plan.has_teacher and name == "OWN_TEMP"
                     or name in unread[plan.flags.SPARSE])}
    # ints whose 0 is a value
    codes = {"DISTILL_KIND": plan.has_teacher, "OBJECTIVE": plan.flags.HAS_POLICY,
             "TOPK_FORM": plan.flags.SPARSE == 1, "TOPK_DIV": plan.flags.SPARSE == 1}
    on = [name if value is True else f"{name}={value}" for name, value in flags.items()
          if value is True or type(value) is int and (codes[name] if name in codes else value != 0)]
    off = [name for name, value in flags.items() if value is False]
    scalars = plan.scalars._asdict()
    columns = [name for name in ROW_COLUMNS if getattr(plan.cols, name) >= 0]
    lines = [
        f"mode        {plan.mode}" + (" (stats in forward, gradient pass in backward)" if plan.mode == "deferred"
                                      else " (one launch: stats, epilogue, gradient)"),
        f"flags on    {', '.join(on) or '-'}",
        f"flags off   {', '.join(off) or '-'}   (compiled out)",
        "scalars     " + (", ".join(f"{k}={scalars[k]:g}" for k in plan.used_scalars) or "-")
        + ("   (inv_temperature per row: 1 / the call's temperature)" if spec.transform.per_row_temperature else ""),
        f"per row     {', '.join(columns)} ({plan.cols.N} fp32 values)",
        f"reduction   {plan.reduction}" + (_weighted(spec) if spec.token_weights is not None else ""),
        f"inputs      {', '.join(plan.requires)}" + (f"; optional: {', '.join(plan.accepts)}" if plan.accepts else ""),
        f"logit reads {plan.logit_passes(with_grad)} pass(es) over [{rows}, {vocab}] {str(dtype)[6:]}"
        + (" (student and teacher)" if plan.has_teacher else "")
        + (" + K logits per row at the teacher's ids" if plan.flags.SPARSE == 1 else "")
        + (" + K logits per row at the selected ids" if selecting else ""),
        *([f"top-k       the student's {spec.student_topk} most likely ids per row, bounded in the stats pass "
           "(topk_ids, topk_logprobs; ties to the lower id)" + (", and verl's overlap with the teacher's top-k"
                                                               if plan.cols.overlap >= 0 else "")]
          if spec.student_topk else []),
        *([f"selected    log p of the call's selected_ids [.., K] (K <= 64; shown for K = {DEMO_SELECTED}): K "
           "columns of the packed row buffer" + (", with gradient (the deferred backward adds each id's share "
                                                 "inside its pass)" if spec.differentiable_outputs else "")]
          if selecting else []),
        f"bytes       reads {traffic['logit_reads'] / 1e9:.3f} GB + gradient writes "
        f"{traffic['grad_writes'] / 1e9:.3f} GB = {traffic['total'] / 1e9:.3f} GB"
        f" (+ O(rows) per-token buffers)",
        *(_policy_lines(spec.policy) if spec.policy is not None else []),
        *_routes_lines(plan, rows, vocab, elem, seq_len),
    ]
    return "\n".join(lines)


OBJECTIVE_FIELDS: dict[str, tuple[str, ...]] = {
    "clip": ("eps_low", "eps_high", "delta", "dual_clip_c"),
    "cispo": ("eps_low", "eps_high"),  # TRL's convention reads eps_high only (an absolute cap)
    "sapo": ("sapo_tau_pos", "sapo_tau_neg"),
    "gpg": (),
    "dro": ("dro_beta",),
    "dppo_tv": ("eps_low", "eps_high", "dppo_ratio_cap"),
    "dppo_kl": ("eps_low", "eps_high", "dppo_ratio_cap"),
    "reinforce": ("reinforce_is_max",),
    "gmpo": ("eps_low", "eps_high"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
    "clip_cov": ("eps_low", "eps_high", "delta", "dual_clip_c", "cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("cov_ratio", "kl_cov_coef"),
}
"""The Policy fields each objective reads (explain prints them beside it)."""

LOSS_TYPE_FIELDS: dict[str, tuple[str, ...]] = {
    "dr_grpo": ("max_completion_length",),
    "dapo": ("num_processes",),
    "grpo": ("num_processes",),
    "seq-mean-token-sum": ("num_processes",),
    "seq-mean-token-mean": ("num_processes",),
}
"""The Policy fields each aggregation reads, besides the call's counts."""

KL_FIELDS = ("kl_beta", "kl_estimator", "kl_clamp", "kl_grad", "kl_importance_correction")


def _fields(policy: Policy, names: tuple[str, ...]) -> str:
    return ", ".join(f"{name}={getattr(policy, name)}" for name in names if getattr(policy, name) is not None)


def _aggregation(loss_type: str) -> str:
    row = LOSS_TYPES[loss_type]
    if row.over == "tokens":
        return row.source
    each = {"mean": "token mean", "sum": "token sum", "sum_norm": "token sum / T"}[row.per_sequence]
    return f"{row.source}: the mean over sequences of each one's {each}"


def _policy_lines(policy: Policy) -> list[str]:
    """The policy term: its objective, ratio, aggregation and KL penalty with the values each reads,
    then every other field set away from its default."""
    objective_fields = OBJECTIVE_FIELDS[policy.objective]
    if policy.objective == "cispo" and policy.convention == "trl":
        objective_fields = ("eps_high",)
    loss_fields = LOSS_TYPE_FIELDS.get(policy.loss_type, ())
    kl = "none (kl_beta=0)"
    if policy.kl_beta > 0:
        kl = (f"kl_beta={policy.kl_beta:g}, {policy.kl_estimator} ({KL_ESTIMATORS[policy.kl_estimator].formula})"
              + (", verl's clamps" if policy.kl_clamp else "") + (", k2 gradient" if policy.kl_grad == "k2" else "")
              + (", times the ratio" if policy.kl_importance_correction else ""))
    shown = {"objective", "convention", "importance_sampling", "loss_type", *objective_fields, *loss_fields,
             *KL_FIELDS}
    others = [f"{name}={value}" for name, value in policy if name not in shown
              and value != Policy.model_fields[name].default]
    lines = [
        f"policy      {policy.objective} ({OBJECTIVES[policy.objective].source}), convention {policy.convention}"
        + (f": {_fields(policy, objective_fields)}" if _fields(policy, objective_fields) else ""),
        f"ratio       {policy.importance_sampling} ({IMPORTANCE_SAMPLING[policy.importance_sampling].source})",
        f"aggregation {policy.loss_type} ({_aggregation(policy.loss_type)})"
        + (f": {_fields(policy, loss_fields)}" if loss_fields else ""),
        f"kl penalty  {kl}",
    ]
    if others:
        lines.append(f"policy also {', '.join(others)}")
    return lines


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
        "plain torch (TRITON_INTERPRET=1 runs the kernel on CPU)"
    )
    print("spec, defaults filled in:")
    for name, value in spec.model_dump(mode="json", exclude_none=True).items():
        text = yaml.safe_dump(value, default_flow_style=True, width=100, sort_keys=False).removesuffix("...\n")
        print(f"  {name}: " + text.strip().replace("\n", "\n    "))
    print(f"batch: logits [{rows}, {vocab}] {str(dtype)[6:]} on {device}, backend {backend}")
    print(_scored(spec, targets) + "\n")
    got, want = out.metrics_as_floats(), ref.metrics_as_floats()
    w = max([22, *(len(name) + 9 for name in got)])  # the first column, wide enough for every name
    print(f"{'value':<{w}}{'headloss':>16}{'fp64 reference':>18}{'abs err':>12}")
    worst = 0.0
    for name in got:
        err = abs(got[name] - want[name])
        worst = max(worst, err / max(1.0, abs(want[name])))
        print(f"{'metric ' + name:<{w}}{got[name]:>16.6f}{want[name]:>18.6f}{err:>12.2e}")
    for name in (name for name in OUTPUT_NAMES if name != "topk_ids"):  # (their log-probs say the same)
        a, b = getattr(out, name), getattr(ref, name)
        if a is None:
            continue
        err = (a.double() - b.double()).abs().max().item()
        worst = max(worst, err / max(1.0, b.double().abs().max().item()))
        print(f"{name + ' (max err)':<{w}}{'':>16}{'':>18}{err:>12.2e}")
    gerr = ((x.grad.double() - ref_x.grad).norm() / ref_x.grad.norm().clamp(min=1e-30)).item()
    print(f"{'gradient (rel err)':<{w}}{'':>16}{'':>18}{gerr:>12.2e}")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = worst < 1e-4 and gerr < tol
    print(f"\n{'OK' if ok else 'MISMATCH'}: values within 1e-4 relative, gradient within {tol:g}")
    return 0 if ok else 1


def _scored(spec: LossSpec, targets: torch.Tensor) -> str:
    """How many rows the batch scores, and why the others are not."""
    rows = targets.numel()
    if not spec.needs_targets:
        return f"{rows} of {rows} rows scored (the spec reads no targets)"
    ignored = int((targets == spec.ignore_index).sum())
    return f"{rows - ignored} of {rows} rows scored: {ignored} targets are ignore_index ({spec.ignore_index})"


def synthetic_inputs(spec: LossSpec, logits: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The per-call inputs a spec's terms need, made up for a [rows, V] batch (one sequence per 16 rows)."""
    rows = logits.shape[0]
    inputs: dict[str, torch.Tensor] = {}
    dist = spec.distillation
    if dist is not None and dist.teacher == "logits":
        inputs["teacher_logits"] = (torch.randn(logits.shape, generator=gen) * 2.0).to(logits)
    elif dist is not None and dist.teacher == "probs":
        inputs["teacher_probs"] = torch.softmax(torch.randn(logits.shape, generator=gen) * 2.0, dim=-1).to(logits)
    elif dist is not None:  # the teacher's top-8 (or its log-prob at each target, made up)
        teacher = torch.log_softmax(torch.randn(logits.shape, generator=gen) * 2.0, dim=-1)
        top = teacher.topk(min(8, logits.shape[-1]), dim=-1)
        if dist.teacher == "topk":
            inputs.update(teacher_ids=top.indices, teacher_logprobs=top.values)
        else:
            inputs["teacher_logprobs"] = top.values[:, 0]
    if spec.policy is not None:
        seq = torch.arange(rows) // 16
        logp_guess = -torch.rand(rows, generator=gen) * 4.0 - 4.0
        inputs.update(
            sequence_ids=seq,
            advantages=torch.randn(int(seq.max()) + 1 if rows else 0, generator=gen)[seq],
            old_logprobs=logp_guess,
        )
        if spec.policy.kl_beta != 0.0:
            inputs["ref_logprobs"] = logp_guess + 0.1 * torch.randn(rows, generator=gen)
    if spec.transform.per_row_temperature:  # rows sampled at temperatures in [0.6, 1.4)
        inputs["temperature"] = 0.6 + 0.8 * torch.rand(rows, generator=gen)
    if spec.token_weights is not None:  # weights in [0, 2)
        inputs["token_weights"] = 2.0 * torch.rand(rows, generator=gen)
    if "selected_logprobs" in spec.outputs:  # DEMO_SELECTED ids per row, -1 among them
        inputs["selected_ids"] = torch.randint(-1, logits.shape[-1], (rows, DEMO_SELECTED), generator=gen)
    return {k: v.to(logits.device) for k, v in inputs.items()}


DEMO_SELECTED = 8
"""The selected ids per row that explain shows and demo scores (outputs: selected_logprobs)."""


def _weighted(spec: LossSpec) -> str:
    """What explain says of the token weights."""
    by_weights = spec.token_weights.normalize == "weights"
    policy = "" if spec.policy is None else (
        "; the policy term: the token weights " + ("in the mask's place in" if by_weights else "on the per-token "
                                                   "values of") + " its aggregation")
    if spec.reduction != "mean":
        return " of each token's loss times its token weight" + policy
    divisor = "their summed token weights" if by_weights else "their count"
    return f" of each token's loss times its token weight, over {divisor} (or num_items_in_batch)" + policy


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


COMMANDS = {
    "demo": ("run a config on a synthetic batch and check it against an fp64 reference",
             "Run a spec on a synthetic batch of random logits and targets (10% of them ignore_index), with "
             "made-up inputs for its other terms, and compare every metric, output and the gradient with "
             "an fp64 plain-torch reference."),
    "explain": ("print the kernel plan and the routes of a config",
                "Print the plan of a spec for a [rows, vocab] batch: mode, flags, scalars, per-row values, "
                "inputs, passes and bytes, the policy term's settings, and the routes of a CUDA call on "
                "logits and on the lm_head."),
}


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="headloss", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="{demo,explain}")
    for name, (help_text, description) in COMMANDS.items():
        explaining = name == "explain"
        p = sub.add_parser(name, help=help_text, description=description)
        p.add_argument("config", nargs="?",
                       help="the spec: a .yaml, .yml or .json file (default: configs/sft_zloss.yaml)")
        p.add_argument("--rows", type=_positive("--rows"), default=8192 if explaining else 64,
                       help="rows of the batch, one token each (default: %(default)s)")
        p.add_argument("--vocab", type=_positive("--vocab"), default=128256 if explaining else 1000,
                       help="vocabulary size, the logits' last dimension (default: %(default)s)")
        p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if explaining else "fp32",
                       help="the logits' dtype (default: %(default)s)")
        if explaining:
            p.add_argument("--seq-len", type=_positive("--seq-len"), default=1024,
                           help="tokens per sequence of a policy spec's rows; the routes depend on it "
                                "(default: %(default)s)")
        else:
            p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                           help="cpu or cuda (default: %(default)s; cuda where a CUDA device is available)")
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
