"""spec (+ which inputs are present) -> KernelPlan. The only place that maps a spec to the kernels.

A plan has four parts, each crossing into the kernels as one object:

* ``flags``   (:class:`Flags`, ``tl.constexpr``) -- structure: which statistics the stats pass
  accumulates, which terms the epilogue evaluates. One distinct value is one compiled variant.
* ``cols``    (:class:`Columns`, ``tl.constexpr``) -- the per-row schema: the index of each value
  the kernel stores in its packed ``[rows, cols.N]`` fp32 buffer (-1 when absent). Metrics are
  column means, per-token outputs are column views.
* ``scalars`` (:class:`Scalars`, runtime fp32) -- values (weights, smoothing, temperature, ...):
  a new value reuses the compiled variant.
* what the call must and may pass (``requires``, ``accepts``), the metric and output names.

Whether an optional tensor (targets, teacher, policy inputs, the gradient buffer) is present is
not a flag: the kernels test ``x is not None``, and Triton compiles one variant per presence.
Everything here is keyed by name; the kernels read ``flags.HAS_Z``, ``cols.entropy``,
``scalars.w_z``: there is no positional list to keep in step with another.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from .bounded import BoundedDict, cache, memoize
from .layouts import EXTREME_METRICS, EXTREMES, OBJECTIVE_METRICS, ROW_COLUMNS, Columns
from .policy_tables import IMPORTANCE_SAMPLING, KL_ESTIMATORS, OBJECTIVES
from .spec import FIELD_NAMES, LossSpec, Policy, base_policy

Mode = Literal["fused", "deferred"]

POLICY_METRICS = (
    "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
    "clip_ratio/region_mean", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio/mean", "ratio/min", "ratio/max",
    "logprob/mean", "kl", "vespo/phi_seq_mean", "high_entropy/fraction", "high_entropy/entropy",
)
"""The policy term's metrics (TRL's and verl's names, headloss.policy.metrics), in their order."""

TERM_METRICS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("ce", "nll"),
    "z_loss": ("z_loss",),
    "dft": ("dft",),
    "entropy": ("entropy",),  # (the policy term's entropy too: one metric, one place)
    "distillation": ("distill/divergence", "distill/teacher_entropy", "distill/student_mass", "distill/teacher_mass",
                     "distill/top1_agreement"),
    "policy": POLICY_METRICS,
    "token_accuracy": ("token_accuracy",),
}
"""Each LossSpec field's metrics."""

METRIC_ORDER: tuple[str, ...] = (
    "loss",
    *(name for field in LossSpec.model_fields if field in TERM_METRICS for name in TERM_METRICS[field]),
    "n_tokens",
)
"""The order of ``out.metrics`` and ``out.packed_metrics()`` on every path and entry point, and of the
logging helpers: ``loss``, then each term's metrics in the order of LossSpec's fields (cross_entropy,
z_loss, dft, entropy, distillation, policy, token_accuracy), then ``n_tokens``. A name not listed here
(a caller's own) goes after the listed ones, before ``n_tokens``."""

_METRIC_RANK = {name: i for i, name in enumerate(METRIC_ORDER)}


def _check_metric_order() -> None:
    unknown = set(TERM_METRICS) - set(LossSpec.model_fields)
    named = set(EXTREME_METRICS) | set(OBJECTIVE_METRICS)
    if unknown or len(set(METRIC_ORDER)) != len(METRIC_ORDER) or not named <= set(METRIC_ORDER):
        raise RuntimeError(f"headloss.plan: METRIC_ORDER must list each metric once, by LossSpec fields "
                           f"(not fields: {sorted(unknown)}; unlisted: {sorted(named - set(METRIC_ORDER))})")


_check_metric_order()


def in_metric_order(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` in :data:`METRIC_ORDER` (a new dict; the same one when already in it)."""
    names = [name for name in METRIC_ORDER[:-1] if name in metrics]
    if len(names) + ("n_tokens" in metrics) != len(metrics):  # names METRIC_ORDER does not list
        names += [name for name in metrics if name not in _METRIC_RANK]
    if "n_tokens" in metrics:
        names.append("n_tokens")
    if names == list(metrics):
        return metrics
    return {name: metrics[name] for name in names}


DIFFERENTIABLE_COLUMNS = ("token_loss", "lse", "logp", "entropy")
"""Columns whose upstream gradient the deferred backward kernel folds into the gradient pass."""


class Flags(NamedTuple):
    """Constexpr structure of one kernel variant (read by name in the kernels)."""

    REDUCTION: int  # 0 mean, 1 sum, 2 none
    HAS_CE: bool  # cross-entropy term
    HAS_SMOOTHING: bool  # label smoothing > 0: needs sum(x)
    HAS_Z: bool  # z-loss term
    HAS_DFT: bool  # DFT term
    HAS_ENTROPY: bool  # entropy computed: needs sum(e * x) or the gradient pass's sum(p * (lse - x))
    ENTROPY_GRAD: bool  # entropy carries gradient (weight != 0, differentiable output, policy bonus)
    ENTROPY_TOKEN_MEAN: bool  # the policy's entropy bonus is a mean over the counted tokens (TRL)
    HAS_ARGMAX: bool  # running argmax (accuracy, predicted tokens, teacher agreement)
    HAS_SOFTCAP: bool  # c * tanh(u / c) in the transform
    HAS_POLICY: bool  # token-level policy objective in the epilogue (fused mode)
    OBJECTIVE: int  # policy objective: its kernel code (policy_tables.OBJECTIVES)
    CISPO_VERL: bool  # CISPO's coefficient clip(r, 1 - eps_low, 1 + eps_high), else TRL's min(r, eps_high)
    LOG_RATIO_CLAMP: bool  # verl: log-ratio clamped to [-20, 20] before exp
    KL_EST: int  # policy KL penalty: 0 none, else the estimator's kernel code (policy_tables.KL_ESTIMATORS)
    KL_CLAMP: bool  # verl's k3 clamps (ref - logp to +-20, the value to +-10)
    KL_K2_GRAD: bool  # the estimator's value with the k2 gradient (verl's "k3+")
    KL_IS_CORR: bool  # KL times the importance ratio
    DISTILL_KIND: int  # dense teacher: -1 none, 0 forward KL, 1 reverse KL, 2 mixture JSD (an extra pass)
    OWN_TEMP: bool  # distillation temperature != 1: the student's softmax at T_d is its own
    SPARSE: int  # sparse teacher: 0 none, 1 top-k, 2 per-token estimator (kernels.sparse)
    TOPK_FORM: int  # top-k: 0 verl's unnormalised forward KL, 1 renormalised over the ids, 2 ids plus the rest
    TOPK_DIV: int  # top-k forms 1 and 2: 0 forward KL, 1 reverse KL, 2 mixture JSD
    TOPK_CLAMP: bool  # verl's log_prob_min_clamp (scalar topk_min_logprob)
    TOKEN_EST: int  # per-token estimator: its kernel code (policy_tables.KL_ESTIMATORS)
    TOKEN_CLAMP: bool  # verl's low_var_kl clamps of k3
    TOKEN_K2_GRAD: bool  # the estimator's value with the k2 gradient


class Scalars(NamedTuple):
    """Runtime values (fp32 in the kernels): changing one never recompiles. Python floats only
    (kernels.head.spec_key keys a Scalars by its type)."""

    w_ce: float = 0.0
    smoothing: float = 0.0
    w_z: float = 0.0
    w_dft: float = 0.0
    w_entropy: float = 0.0
    logit_scale: float = 1.0
    softcap: float = 1.0
    inv_temperature: float = 1.0
    w_distill: float = 0.0  # weight (x T**2 when scaled)
    inv_distill_temp: float = 1.0
    jsd_beta: float = 0.0
    topk_min_logprob: float = float("-inf")  # verl's log_prob_min_clamp
    eps_low: float = 0.0
    eps_high: float = 0.0
    pol_delta: float = float("inf")  # two-sided clip cap, inf when off
    dual_c: float = float("inf")  # dual clip constant, inf when off
    kl_beta: float = 0.0
    entropy_coef: float = 0.0
    # the objectives' own values (policy_tables Objective.params: the spec.Policy fields of these names)
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.0
    dro_beta: float = 0.0
    dppo_ratio_cap: float = float("inf")
    reinforce_is_max: float = float("inf")


class ObjectiveFlags(NamedTuple):
    """Constexpr structure of the deferred mode's policy-objective kernels (kernels.head
    policy_sequence_kernel): the objective's fields of :class:`Flags` (same names: terms.py's
    ``_objective`` and ``kl_estimator`` read them), and the sequence-level ones."""

    OBJECTIVE: int
    CISPO_VERL: bool
    LOG_RATIO_CLAMP: bool
    KL_EST: int
    KL_CLAMP: bool
    KL_K2_GRAD: bool
    KL_IS_CORR: bool
    IS_MODE: int  # importance sampling: its kernel code (policy_tables.IMPORTANCE_SAMPLING)
    OFF_POLICY: bool  # TRL's off-policy sequence mask
    ENT_BONUS: bool  # entropy_coef != 0: the entropy bonus, and its gradient
    ENT_TOKEN_MEAN: bool  # the bonus is a mean over the call's counted tokens (TRL), else weighted like the loss
    SEQ_CLIP_MEANS: bool  # TRL's sequence-level ratios with one advantage per sequence: the clip fractions are
    # means over sequences, a sequence without counted tokens among them (fraction 0)


@memoize("plan.objective_flags", 256, "objective_flags' answers by (spec.Policy, sequence-level clip means)")
def objective_flags(pol, seq_clip_means: bool = False) -> ObjectiveFlags:
    """The policy term's flags for the deferred mode's objective kernels (a spec.Policy; cached).
    ``seq_clip_means``: the call's clip fractions are TRL's means over sequences (PolicyInputs.sequence_level)."""
    kl = pol.kl_beta != 0.0
    return ObjectiveFlags(
        OBJECTIVE=_kernel_code(pol.objective),
        CISPO_VERL=pol.objective == "cispo" and pol.convention == "verl",
        LOG_RATIO_CLAMP=pol.clamps_log_ratio,
        KL_EST=KL_ESTIMATORS[pol.kl_estimator].kernel if kl else 0,
        KL_CLAMP=kl and pol.kl_clamp and pol.kl_estimator == "k3",
        KL_K2_GRAD=kl and pol.kl_grad == "k2" and pol.kl_estimator != "k2",
        KL_IS_CORR=pol.kl_importance_correction,
        IS_MODE=IMPORTANCE_SAMPLING[pol.importance_sampling].kernel,
        OFF_POLICY=pol.off_policy_mask is not None,
        ENT_BONUS=pol.entropy_coef != 0.0,
        ENT_TOKEN_MEAN=pol.entropy_coef != 0.0 and pol.entropy_aggregation == "token-mean",
        SEQ_CLIP_MEANS=seq_clip_means,
    )


def _kernel_code(objective: str) -> int:
    """An objective's kernel code: the kernels run row-local objectives only (the plan routes the
    others through their sequence or batch statistics first)."""
    code = OBJECTIVES[objective].kernel
    if code is None:
        raise ValueError(f"policy.objective: {objective!r} needs its sequence's or the batch's values; the "
                         "kernels' epilogue runs row-local objectives only")
    return code


@dataclass(frozen=True)
class KernelPlan:
    """What one call runs: mode, kernel variant, per-row schema, runtime scalars, inputs, names."""

    spec: LossSpec
    mode: Mode
    flags: Flags
    cols: Columns
    scalars: Scalars
    used_scalars: tuple[str, ...]  # the scalars the spec's terms read (the rest are defaults)
    requires: tuple[str, ...]  # inputs the call must provide
    accepts: tuple[str, ...]  # optional inputs the call may provide
    metrics: tuple[tuple[str, str], ...]  # (metric name, column): metric = column mean over counted rows (METRIC_ORDER)
    outputs: tuple[tuple[str, str], ...]  # (output name, column) of the per-token float outputs
    key: str  # JSON of what the plan was made from; plan_from_key(key) gives the plan back
    metric_index: tuple[tuple[str, int], ...]  # (metric name, index into the means), in METRIC_ORDER
    means_size: int  # the column means, the loss, then the policy metrics the last program computes
    output_index: tuple[tuple[str, int], ...]  # (output name, column index) of the per-token float outputs
    base: KernelPlan | None = None  # the fused plan a corrected lm_head route runs first (_base_of)

    @property
    def reduction(self) -> str:
        return self.spec.reduction

    @property
    def has_teacher(self) -> bool:
        return self.flags.DISTILL_KIND >= 0

    def logit_passes(self, with_grad: bool = True) -> int:
        """Full reads of the logits: the stats pass, the gradient pass when there is one, and the
        JSD's extra pass."""
        return 1 + int(with_grad) + int(self.flags.DISTILL_KIND == 2)

    def traffic_bytes(self, rows: int, vocab: int, elem_bytes: int, grad_bytes: int, with_grad: bool) -> dict:
        """Bytes moved through device memory by the logits-sized streams of one fwd(+bwd) call
        (the teacher, when there is one, is read in the same passes as the student)."""
        streams = 2 if self.has_teacher else 1
        reads = self.logit_passes(with_grad) * streams * rows * vocab * elem_bytes
        writes = rows * vocab * grad_bytes if with_grad else 0
        return {"logit_reads": reads, "grad_writes": writes, "total": reads + writes}


def _float(value: float | None) -> float:
    """A spec value as a kernel scalar: None (an option left off, e.g. no cap) is inf."""
    return float("inf") if value is None else float(value)


def _check_objective_params() -> None:
    for name, row in OBJECTIVES.items():
        for param in row.params:
            if param not in Scalars._fields or param not in Policy.model_fields:
                raise RuntimeError(f"headloss.plan: objective {name!r} reads {param!r}, which must be both a "
                                   "spec.Policy field and a Scalars field of that name")


_check_objective_params()


def _term_scalars(spec: LossSpec) -> dict[str, dict[str, float]]:
    """Each present term's runtime scalars, by term: the one place a term's values are read."""
    t = spec.transform
    out: dict[str, dict[str, float]] = {}
    if not t.is_identity:
        out["transform"] = {
            "logit_scale": t.logit_scale,
            "softcap": t.softcap if t.softcap is not None else 1.0,
            "inv_temperature": 1.0 / t.temperature,
        }
    if spec.cross_entropy is not None:
        out["cross_entropy"] = {"w_ce": spec.cross_entropy.weight, "smoothing": spec.cross_entropy.label_smoothing}
    if spec.z_loss is not None:
        out["z_loss"] = {"w_z": spec.z_loss.weight}
    if spec.dft is not None:
        out["dft"] = {"w_dft": spec.dft.weight}
    if spec.entropy is not None:
        out["entropy"] = {"w_entropy": spec.entropy.weight}
    dist = spec.distillation
    if dist is not None:
        out["distillation"] = {
            "w_distill": dist.weight * (dist.temperature**2 if dist.scale_by_temperature_squared else 1.0)}
        if dist.dense:
            out["distillation"].update(inv_distill_temp=1.0 / dist.temperature, jsd_beta=dist.beta)
        elif dist.teacher == "topk" and dist.kind == 2:  # (a sparse teacher's JSD: renormalized or rest)
            out["distillation"]["jsd_beta"] = dist.beta
        if dist.log_prob_min_clamp is not None:
            out["distillation"]["topk_min_logprob"] = dist.log_prob_min_clamp
    pol = spec.policy
    if pol is not None:
        out["policy"] = {
            "eps_low": pol.eps_low,
            "eps_high": pol.eps_high,
            "pol_delta": pol.delta if pol.delta is not None else float("inf"),
            "dual_c": pol.dual_clip_c if pol.dual_clip_c is not None else float("inf"),
            "kl_beta": pol.kl_beta,
            "entropy_coef": pol.entropy_coef,
            **{name: _float(getattr(pol, name)) for name in OBJECTIVES[pol.objective].params},
        }
    return out


def _missing_targets_error(spec: LossSpec) -> ValueError:
    wanted = [
        name
        for name, on in (
            ("cross_entropy", spec.cross_entropy is not None),
            ("dft", spec.dft is not None),
            ("token_accuracy", spec.token_accuracy),
            ("outputs: logprobs", "logprobs" in spec.outputs),
            ("policy", spec.policy is not None),
        )
        if on
    ]
    return ValueError(f"targets: required by {', '.join(wanted)} but not given")


@memoize("plan.compile_plan", 256, "compile_plan's plans by (spec, has_targets)")
def compile_plan(spec: LossSpec, *, has_targets: bool = True) -> KernelPlan:
    """Map a spec to a kernel plan. Cached: the same spec and inputs give the same plan object."""
    if spec.needs_targets and not has_targets:
        raise _missing_targets_error(spec)
    pol = spec.policy
    # a token-level policy objective is row-local: the kernel's epilogue computes it (fused mode).
    # Sequence-level ratios need other rows: the objective runs after the stats pass on the deferred
    # mode's per-token log-probs (policy_sequence_kernel, or torch), whose gradient the backward kernel
    # turns into the logits' gradient
    sequence_policy = pol is not None and not pol.row_local
    deferred = spec.reduction == "none" or spec.differentiable_outputs or sequence_policy
    fused_policy = pol is not None and not deferred
    flags = _flags(spec, fused_policy)
    cols = _columns(spec, flags, has_targets, fused_policy)
    metrics = _metric_columns(spec, cols, fused_policy)
    extra = EXTREME_METRICS if fused_policy else ()  # the last program's values after the loss, means[cols.N]
    outputs = tuple(
        (name, col) for name, col in (("logprobs", "logp"), ("lse", "lse"), ("token_loss", "token_loss"),
                                      ("entropy", "entropy"))
        if name in spec.outputs
    )
    term_scalars = _term_scalars(spec)
    used = {name: value for values in term_scalars.values() for name, value in values.items()}
    requires, accepts = _plan_inputs(spec)
    key = json.dumps({"spec": spec.to_dict(), "has_targets": has_targets}, sort_keys=True)
    plan = KernelPlan(
        spec=spec,
        mode="deferred" if deferred else "fused",
        flags=flags,
        cols=cols,
        scalars=Scalars(**{name: float(value) for name, value in used.items()}),  # floats only (launch keys)
        used_scalars=tuple(used),
        requires=requires,
        accepts=accepts,
        metrics=metrics,
        outputs=outputs,
        key=key,
        metric_index=tuple(sorted(
            tuple((name, getattr(cols, col)) for name, col in metrics)
            + tuple((name, cols.N + 1 + i) for i, name in enumerate(extra))
            + ((("pg_clipfrac", cols.N + 1 + EXTREMES.region_mean),) if fused_policy else ()),
            key=lambda item: _METRIC_RANK[item[0]])),  # METRIC_ORDER's order: assemble keeps it
        means_size=cols.N + 1 + len(extra),
        output_index=tuple((name, getattr(cols, col)) for name, col in outputs),
        base=_base_of(spec) if deferred and pol is not None else None,
    )
    _BY_KEY[key] = plan
    return plan


def _base_of(spec: LossSpec) -> KernelPlan | None:
    """The fused plan of the row-local objective that the lm_head's corrected routes (routes: covariance,
    entropy-guess) run before a batch statistic corrects a few rows; None where the spec has none or
    its base still needs deferred mode (a top-entropy mask under a covariance objective)."""
    pol = spec.policy
    objective = OBJECTIVES[pol.objective]
    if objective.base is None and not (objective.row_local and pol.top_entropy_quantile < 1.0):
        return None
    candidate = compile_plan(spec.model_copy(update={"policy": base_policy(pol)}), has_targets=True)
    return candidate if candidate.mode == "fused" else None


def _flags(spec: LossSpec, fused_policy: bool) -> Flags:
    """The kernel variant's constexpr flags."""
    ce, dist, pol = spec.cross_entropy, spec.distillation, spec.policy
    wants_entropy = spec.entropy is not None or "entropy" in spec.outputs or pol is not None
    entropy_grad = wants_entropy and (
        (spec.entropy is not None and spec.entropy.weight != 0.0)
        or (spec.differentiable_outputs and "entropy" in spec.outputs)
        or (pol is not None and pol.entropy_coef != 0.0)
    )
    objective = objective_flags(pol) if fused_policy else None  # (the epilogue's fields, as the deferred kernels')
    dense = dist is not None and dist.dense
    topk = dist is not None and dist.teacher == "topk"
    token = dist is not None and dist.teacher == "token"
    return Flags(
        REDUCTION=("mean", "sum", "none").index(spec.reduction),
        HAS_CE=ce is not None,
        HAS_SMOOTHING=ce is not None and ce.label_smoothing > 0.0,
        HAS_Z=spec.z_loss is not None,
        HAS_DFT=spec.dft is not None,
        HAS_ENTROPY=wants_entropy,
        ENTROPY_GRAD=entropy_grad,
        ENTROPY_TOKEN_MEAN=fused_policy and pol.entropy_coef != 0.0 and pol.entropy_aggregation == "token-mean",
        HAS_ARGMAX=spec.token_accuracy or "predicted_tokens" in spec.outputs or dense or topk,
        HAS_SOFTCAP=spec.transform.softcap is not None,
        HAS_POLICY=fused_policy,
        OBJECTIVE=objective.OBJECTIVE if fused_policy else 0,
        CISPO_VERL=fused_policy and objective.CISPO_VERL,
        LOG_RATIO_CLAMP=fused_policy and objective.LOG_RATIO_CLAMP,
        KL_EST=objective.KL_EST if fused_policy else 0,
        KL_CLAMP=fused_policy and objective.KL_CLAMP,
        KL_K2_GRAD=fused_policy and objective.KL_K2_GRAD,
        KL_IS_CORR=fused_policy and objective.KL_IS_CORR,
        DISTILL_KIND=dist.kind if dense else -1,
        OWN_TEMP=dense and dist.temperature != 1.0,
        SPARSE=0 if dist is None else ("logits", "topk", "token").index(dist.teacher),
        TOPK_FORM=("verl", "renormalized", "rest").index(dist.topk) if topk else 0,
        TOPK_DIV=dist.kind if topk else 0,
        TOPK_CLAMP=topk and dist.log_prob_min_clamp is not None,
        TOKEN_EST=KL_ESTIMATORS[dist.estimator].kernel if token else 0,
        TOKEN_CLAMP=token and dist.estimator_clamp and dist.estimator == "k3",
        TOKEN_K2_GRAD=token and dist.estimator_grad == "k2" and dist.estimator != "k2",
    )


def _columns(spec: LossSpec, flags: Flags, has_targets: bool, fused_policy: bool) -> Columns:
    """The per-row values the kernel stores: each present column of ROW_COLUMNS, in its order."""
    dist, pol = spec.distillation, spec.policy
    present = {
        "token_loss": True,
        "lse": True,
        "logp": has_targets and ("logprobs" in spec.outputs or pol is not None),
        "ce": flags.HAS_CE,
        "nll": flags.HAS_SMOOTHING,
        "z_loss": flags.HAS_Z,
        "dft": flags.HAS_DFT,
        "entropy": flags.HAS_ENTROPY,
        "accuracy": spec.token_accuracy,
        "divergence": dist is not None,
        **{name: dist is not None and dist.dense for name in ("teacher_entropy", "lse_s2", "lse_t2", "jsd_s")},
        **{name: flags.SPARSE == 1 for name in ("student_mass", "teacher_mass")},
        "rest_mass": flags.TOPK_FORM == 2,
        "agreement": dist is not None and dist.teacher != "token",
        **{name: fused_policy for name in ("policy_loss", "counted", "ratio", "clip_low", "clip_high", "clip_dual",
                                           "ppo_kl")},
        "kl": flags.KL_EST != 0,
    }
    packed = [name for name in ROW_COLUMNS if present[name]]
    return Columns(**{name: packed.index(name) if name in packed else -1 for name in ROW_COLUMNS}, N=len(packed))


def _metric_columns(spec: LossSpec, cols: Columns, fused_policy: bool) -> tuple[tuple[str, str], ...]:
    """(metric, column) of every metric a column mean gives, in METRIC_ORDER."""
    metric_columns = {
        "ce": "ce", "nll": "nll", "z_loss": "z_loss", "dft": "dft", "token_accuracy": "accuracy",
        "distill/divergence": "divergence", "distill/teacher_entropy": "teacher_entropy",
        "distill/student_mass": "student_mass", "distill/teacher_mass": "teacher_mass",
        "distill/top1_agreement": "agreement",
    }
    if spec.entropy is not None or spec.policy is not None:
        metric_columns["entropy"] = "entropy"
    if fused_policy:
        metric_columns.update({"clip_ratio/low_mean": "clip_low", "clip_ratio/high_mean": "clip_high",
                               "logprob/mean": "logp", "kl": "kl", "pg_clipfrac_lower": "clip_dual",
                               "ppo_kl": "ppo_kl"})
    return tuple(sorted(((name, col) for name, col in metric_columns.items() if getattr(cols, col) >= 0),
                        key=lambda item: _METRIC_RANK[item[0]]))


def _plan_inputs(spec: LossSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the inputs a call must give, those it may give): what explain prints."""
    requires = ("logits", "targets") if spec.needs_targets else ("logits",)
    accepts: tuple[str, ...] = () if spec.needs_targets else ("targets",)
    dist = spec.distillation
    if dist is not None:
        requires += {"logits": ("teacher_logits",), "topk": ("teacher_ids", "teacher_logprobs"),
                     "token": ("teacher_logprobs",)}[dist.teacher]
    if spec.policy is not None:
        requires += ("advantages",) + (("ref_logprobs",) if spec.policy.kl_beta != 0.0 else ())
        accepts += ("old_logprobs", "loss_mask", "importance_weights", "rollout_logprobs", "sequence_ids")
    if spec.reduction == "mean":
        accepts += ("num_items_in_batch",)
    return requires, accepts


_BY_KEY: BoundedDict[str, KernelPlan] = cache("plan.by_key", 1024, "plans by key (plan_from_key: the ops' argument)")


def plan_from_key(key: str) -> KernelPlan:
    """The plan a key was made from (the custom ops carry plans as keys)."""
    plan = _BY_KEY.get(key)
    if plan is None:
        made_from = json.loads(key)
        plan = compile_plan(LossSpec.model_validate(made_from["spec"]), has_targets=made_from["has_targets"])
    return plan


# --- a spec in any form -> its plan, cached --------------------------------------------------------

SpecLike = LossSpec | dict[str, Any] | str | Path


def _frozen(value: Any) -> Any:
    """A spec given as data, with every number made a Python constant (so torch.compile
    specialises on it instead of tracing it symbolically) and dicts made hashable."""
    if isinstance(value, dict):
        return tuple((str(k), _frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ("__list__", *(_frozen(v) for v in value))
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, tuple) and value and value[0] == "__list__":
        return [_thawed(v) for v in value[1:]]
    if isinstance(value, tuple):
        return {k: _thawed(v) for k, v in value}
    return value


@torch.compiler.assume_constant_result
def plan_of_data(frozen: Any, has_targets: bool) -> KernelPlan:
    data = _thawed(frozen)
    spec = LossSpec.from_file(data) if isinstance(data, str) else LossSpec.model_validate(data)
    return compile_plan(spec, has_targets=has_targets)


def _spec_data(model: Any) -> Any:
    """A LossSpec as plain data through attribute reads only (which torch.compile can trace and
    guard on), without pydantic's serializer (which it cannot trace)."""
    names = FIELD_NAMES.get(type(model))
    if names is not None:
        return {name: _spec_data(getattr(model, name)) for name in names}
    if isinstance(model, tuple):
        return list(model)
    return model


_DEFAULT_SPEC = LossSpec()
_PLANS_BY_ID: BoundedDict[tuple[int, bool], tuple[LossSpec, KernelPlan]] = cache(
    "plan.by_id", 1024, "plan_for's plans by (id of the spec object, has_targets)")
_PLANS_BY_DATA: BoundedDict[tuple[str, bool], KernelPlan] = cache(
    "plan.by_data", 1024, "plan_for's plans by (the spec's data, has_targets)")


def plan_for(spec: SpecLike | None, has_targets: bool) -> KernelPlan:
    """The cached plan of a spec given in any form; a spec object seen before costs a dict lookup
    (no pydantic hashing or validation per call). Under torch.compile the spec is read once, at
    trace time, and the plan is a constant of the graph (a dict or a path never breaks it)."""
    if spec is None:
        spec = _DEFAULT_SPEC
    if isinstance(spec, LossSpec):
        if torch.compiler.is_compiling():
            return plan_of_data(_frozen(_spec_data(spec)), has_targets)
        hit = _PLANS_BY_ID.get((id(spec), has_targets))
        if hit is not None and hit[0] is spec:
            return hit[1]
        plan = compile_plan(spec, has_targets=has_targets)
        _PLANS_BY_ID[(id(spec), has_targets)] = (spec, plan)  # holds spec: its id is not reused meanwhile
        return plan
    if isinstance(spec, (dict, str, Path)):
        if torch.compiler.is_compiling():
            return plan_of_data(_frozen(spec), has_targets)
        key = (repr(spec) if isinstance(spec, dict) else f"path:{spec}", has_targets)
        plan = _PLANS_BY_DATA.get(key) if isinstance(spec, dict) else None  # a file may change: read it again
        if plan is None:
            plan = compile_plan(LossSpec.coerce(spec), has_targets=has_targets)
            if isinstance(spec, dict):
                _PLANS_BY_DATA[key] = plan
        return plan
    raise TypeError(f"spec: expected LossSpec, dict or a path, got {type(spec).__name__}")
