"""The descriptors of every call's parts (core, transform) and of the SFT and distillation terms."""

from __future__ import annotations

from typing import Any

from ..policy_tables import KL_ESTIMATORS
from ..spec import LossSpec
from .base import Column, Flag, Scalar, Term, TermContext, weighted_term

CORE = Term(
    "core",
    flags=(Flag("REDUCTION", int, "0 mean, 1 sum, 2 none", 0),
           Flag("HAS_ARGMAX", bool, "running argmax (accuracy, predicted tokens, teacher agreement)"),
           Flag("WEIGHT_NORM", bool, "token weights: a mean (and TRL's entropy mean) divides by the counted "
                "tokens' summed weights"),
           Flag("SELECTED", int, "the selected ids per row (outputs: selected_logprobs), 0 without", 0)),
    columns=(Column("token_loss", "combined per-token loss (before reduction)"),
             Column("lse", "logsumexp of the transformed logits"),
             Column("logp", "log p(target)"),
             Column("selected", "log p of each selected id (SELECTED columns; 0 where the id is -1)",
                    width=lambda c: c.selected_k)),
    flag_values=lambda c: {
        "REDUCTION": ("mean", "sum", "none").index(c.spec.reduction),
        "HAS_ARGMAX": c.spec.token_accuracy or "predicted_tokens" in c.spec.outputs or (
            c.spec.distillation is not None and c.spec.distillation.teacher in ("logits", "topk")),
        "WEIGHT_NORM": c.spec.token_weights is not None and c.spec.token_weights.normalize == "weights",
        "SELECTED": c.selected_k,
    },
    stores=lambda c: {"token_loss": True, "lse": True,
                      "logp": c.has_targets and ("logprobs" in c.spec.outputs or c.spec.policy is not None),
                      "selected": c.selected_k > 0},
    reads_targets=lambda spec: "logprobs" in spec.outputs,
    target_reason="outputs: logprobs",
)

TRANSFORM = Term(
    "transform",
    flags=(Flag("HAS_SOFTCAP", bool, "c * tanh(u / c) in the transform"),),
    scalars=(Scalar("logit_scale", 1.0), Scalar("softcap", 1.0), Scalar("inv_temperature", 1.0)),
    flag_values=lambda c: {"HAS_SOFTCAP": c.spec.transform.softcap is not None},
    scalar_values=lambda spec: None if spec.transform.is_identity else {
        "logit_scale": spec.transform.logit_scale,
        "softcap": spec.transform.softcap if spec.transform.softcap is not None else 1.0,
        "inv_temperature": 1.0 / spec.transform.temperature},
)

CROSS_ENTROPY = Term(
    "cross_entropy",
    flags=(Flag("HAS_CE", bool, "cross-entropy term"),
           Flag("HAS_SMOOTHING", bool, "label smoothing > 0: needs sum(x)")),
    scalars=(Scalar("w_ce", 0.0), Scalar("smoothing", 0.0)),
    columns=(Column("ce", "cross-entropy (with smoothing)"),
             Column("nll", "-log p(target) (with label smoothing, where it differs from ce)")),
    metrics=("ce", "nll"),
    flag_values=lambda c: {"HAS_CE": c.spec.cross_entropy is not None,
                           "HAS_SMOOTHING": c.spec.cross_entropy is not None
                           and c.spec.cross_entropy.label_smoothing > 0.0},
    scalar_values=lambda spec: None if spec.cross_entropy is None else {
        "w_ce": spec.cross_entropy.weight, "smoothing": spec.cross_entropy.label_smoothing},
    stores=lambda c: {"ce": c.flags.HAS_CE, "nll": c.flags.HAS_SMOOTHING},
    metric_columns=lambda c: {"ce": "ce", "nll": "nll"},
    reads_targets=lambda spec: spec.cross_entropy is not None,
)

Z_LOSS = weighted_term("z_loss", "HAS_Z", "w_z", "z-loss term", "lse ** 2")

DFT = weighted_term("dft", "HAS_DFT", "w_dft", "DFT term", "-sg(p(target)) * log p(target)", reads_targets=True)


def _entropy_flags(c: TermContext) -> dict[str, Any]:
    spec, pol = c.spec, c.spec.policy
    wanted = spec.entropy is not None or "entropy" in spec.outputs or pol is not None
    return {
        "HAS_ENTROPY": wanted,
        "ENTROPY_GRAD": wanted and ((spec.entropy is not None and spec.entropy.weight != 0.0)
                                    or (spec.differentiable_outputs and "entropy" in spec.outputs)
                                    or (pol is not None and pol.entropy_coef != 0.0)),
        "ENTROPY_TOKEN_MEAN": c.fused_policy and pol.entropy_coef != 0.0 and pol.entropy_aggregation == "token-mean",
    }


ENTROPY = Term(
    "entropy",
    flags=(Flag("HAS_ENTROPY", bool, "entropy computed: needs sum(e * x) or the gradient pass's sum(p * (lse - x))"),
           Flag("ENTROPY_GRAD", bool, "entropy carries gradient (weight != 0, differentiable output, policy bonus)"),
           Flag("ENTROPY_TOKEN_MEAN", bool, "the policy's entropy bonus is a mean over the counted tokens (TRL)")),
    scalars=(Scalar("w_entropy", 0.0),),
    columns=(Column("entropy", "entropy of the softmax"),),
    metrics=("entropy",),  # (the policy term's entropy too: one metric, one place)
    flag_values=_entropy_flags,
    scalar_values=lambda spec: None if spec.entropy is None else {"w_entropy": spec.entropy.weight},
    stores=lambda c: {"entropy": c.flags.HAS_ENTROPY},
    metric_columns=lambda c: {"entropy": "entropy"} if c.spec.entropy is not None or c.spec.policy is not None
    else {},
)

TOKEN_ACCURACY = Term(
    "token_accuracy",
    columns=(Column("accuracy", "1 where argmax == target"),),
    metrics=("token_accuracy",),
    stores=lambda c: {"accuracy": c.spec.token_accuracy},
    metric_columns=lambda c: {"token_accuracy": "accuracy"},
    reads_targets=lambda spec: spec.token_accuracy,
)


def _distillation_flags(c: TermContext) -> dict[str, Any]:
    dist = c.spec.distillation
    if dist is None:
        return {}
    topk, token = dist.teacher == "topk", dist.teacher == "token"
    return {
        "DISTILL_KIND": dist.kind if dist.dense else -1,
        "OWN_TEMP": dist.dense and dist.temperature != 1.0,
        "SPARSE": {"topk": 1, "token": 2}.get(dist.teacher, 0),
        "TEACHER_PROBS": dist.teacher == "probs",
        "TOPK_FORM": ("verl", "renormalized", "rest").index(dist.topk) if topk else 0,
        "TOPK_DIV": dist.kind if topk else 0,
        "TOPK_CLAMP": topk and dist.log_prob_min_clamp is not None,
        "TOKEN_EST": KL_ESTIMATORS[dist.estimator].kernel if token else 0,
        "TOKEN_CLAMP": token and dist.estimator_clamp and dist.estimator == "k3",
        "TOKEN_K2_GRAD": token and dist.estimator_grad == "k2" and dist.estimator != "k2",
    }


def _distillation_scalars(spec: LossSpec) -> dict[str, float] | None:
    dist = spec.distillation
    if dist is None:
        return None
    out = {"w_distill": dist.weight * (dist.temperature**2 if dist.scale_by_temperature_squared else 1.0)}
    if dist.dense:
        out.update(inv_distill_temp=1.0 / dist.temperature, jsd_beta=dist.beta)
    elif dist.teacher == "topk" and dist.kind == 2:  # (a sparse teacher's JSD: renormalized or rest)
        out["jsd_beta"] = dist.beta
    if dist.log_prob_min_clamp is not None:
        out["topk_min_logprob"] = dist.log_prob_min_clamp
    return out


def _distillation_stores(c: TermContext) -> dict[str, bool]:
    dist = c.spec.distillation
    dense = dist is not None and dist.dense
    return {"divergence": dist is not None, "teacher_entropy": dense,
            "student_mass": c.flags.SPARSE == 1, "teacher_mass": c.flags.SPARSE == 1,
            "agreement": dist is not None and dist.teacher != "token", "rest_mass": c.flags.TOPK_FORM == 2,
            "lse_s2": dense, "lse_t2": dense, "jsd_s": dense}


STUDENT_TOPK = Term(
    "student_topk",
    flags=(Flag("STUDENT_TOPK", int, "the student's top-k per row, bounded in the stats pass (k; 0 off)", 0),),
    columns=(Column("topk_logprobs", "the student's k most likely ids' log-probs, in order (STUDENT_TOPK columns)",
                    width=lambda c: c.spec.student_topk or 0),
             Column("topk_ids", "their ids, as int32 bits (STUDENT_TOPK columns)",
                    width=lambda c: c.spec.student_topk or 0),
             Column("overlap", "top-k teacher: the fraction of the student's k ids among the teacher's ids"),
             Column("overlap_advantage", "top-k teacher: the mean of -q (log q - log p) over the teacher's ids in "
                    "the student's top-k (0 without one)")),
    metrics=("distill/overlap_ratio", "distill/overlap_token_advantage"),
    flag_values=lambda c: {"STUDENT_TOPK": c.spec.student_topk or 0},
    stores=lambda c: {"topk_logprobs": c.spec.student_topk is not None, "topk_ids": c.spec.student_topk is not None,
                      "overlap": c.spec.topk_overlap, "overlap_advantage": c.spec.topk_overlap},
    metric_columns=lambda c: {"distill/overlap_ratio": "overlap",
                              "distill/overlap_token_advantage": "overlap_advantage"},
)

DISTILLATION = Term(
    "distillation",
    flags=(Flag("DISTILL_KIND", int, "dense teacher: -1 none, 0 forward KL, 1 reverse KL, 2 mixture JSD (an extra "
                "pass)", -1),
           Flag("OWN_TEMP", bool, "distillation temperature != 1: the student's softmax at T_d is its own"),
           Flag("SPARSE", int, "sparse teacher: 0 none, 1 top-k, 2 per-token estimator (kernels.sparse)", 0),
           Flag("TEACHER_PROBS", bool, "dense teacher given as probabilities: log2 q on load, rows checked to "
                "sum to 1"),
           Flag("TOPK_FORM", int, "top-k: 0 verl's unnormalised forward KL, 1 renormalised over the ids, 2 ids "
                "plus the rest", 0),
           Flag("TOPK_DIV", int, "top-k forms 1 and 2: 0 forward KL, 1 reverse KL, 2 mixture JSD", 0),
           Flag("TOPK_CLAMP", bool, "verl's log_prob_min_clamp (scalar topk_min_logprob)"),
           Flag("TOKEN_EST", int, "per-token estimator: its kernel code (policy_tables.KL_ESTIMATORS)", 0),
           Flag("TOKEN_CLAMP", bool, "verl's low_var_kl clamps of k3"),
           Flag("TOKEN_K2_GRAD", bool, "the estimator's value with the k2 gradient")),
    scalars=(Scalar("w_distill", 0.0, "weight (x T**2 when scaled)"), Scalar("inv_distill_temp", 1.0),
             Scalar("jsd_beta", 0.0), Scalar("topk_min_logprob", float("-inf"), "verl's log_prob_min_clamp")),
    columns=(Column("divergence", "distillation divergence"),
             Column("teacher_entropy", "teacher entropy at the distillation temperature"),
             Column("student_mass", "top-k teacher: the student's probability on the teacher's ids"),
             Column("teacher_mass", "top-k teacher: the teacher's probability on its ids"),
             Column("agreement", "1 where the student's argmax is the teacher's (top-k: its top id)"),
             Column("rest_mass", "top-k 'rest': the student's probability off the teacher's ids (deferred backward)"),
             Column("lse_s2", "student log2-normaliser at the distillation temperature (deferred backward)"),
             Column("lse_t2", "teacher log2-normaliser (deferred backward)"),
             Column("jsd_s", "KL(p || mixture) of the JSD (deferred backward)")),
    metrics=("distill/divergence", "distill/teacher_entropy", "distill/student_mass", "distill/teacher_mass",
             "distill/top1_agreement"),
    flag_values=_distillation_flags,
    scalar_values=_distillation_scalars,
    stores=_distillation_stores,
    metric_columns=lambda c: {"distill/divergence": "divergence", "distill/teacher_entropy": "teacher_entropy",
                              "distill/student_mass": "student_mass", "distill/teacher_mass": "teacher_mass",
                              "distill/top1_agreement": "agreement"},
    reads_targets=lambda spec: spec.distillation is not None and spec.distillation.teacher == "token",
    target_reason="distillation (teacher 'token')",
)
