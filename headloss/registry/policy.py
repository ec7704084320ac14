"""The policy term's descriptor: its epilogue flags (and the deferred mode's objective flags), its runtime
values (the objectives' own among them), its columns and metrics."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..bounded import memoize
from ..policy_tables import IMPORTANCE_SAMPLING, KL_ESTIMATORS, OBJECTIVES
from ..spec import LossSpec
from .base import Column, Flag, Scalar, Term, TermContext, inf_scalar

POLICY_METRICS = (
    "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
    "clip_ratio/region_mean", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio/mean", "ratio/min", "ratio/max",
    "logprob/mean", "kl", "vespo/phi_seq_mean", "high_entropy/fraction", "high_entropy/entropy",
)
"""The policy term's metrics (TRL's and verl's names, headloss.policy.metrics), in their order."""

OBJECTIVE_SCALARS = (Scalar("sapo_tau_pos", 1.0), Scalar("sapo_tau_neg", 1.0), Scalar("dro_beta", 0.0),
                     Scalar("dppo_ratio_cap", float("inf")), Scalar("reinforce_is_max", float("inf")))
"""The objectives' own values (policy_tables Objective.params: the spec.Policy fields of these names)."""


class ObjectiveFlags(NamedTuple):
    """Constexpr structure of the policy objective's kernel pieces: the fused epilogue's policy flags
    (the same names in :data:`Flags`) and the deferred mode's sequence-level ones (kernels.policy's
    policy_sequence_kernel reads all of them)."""

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


def kernel_code(objective: str) -> int:
    """An objective's kernel code: the kernels run row-local objectives only (the plan routes the
    others through their sequence or batch statistics first)."""
    code = OBJECTIVES[objective].kernel
    if code is None:
        raise ValueError(f"policy.objective: {objective!r} needs its sequence's or the batch's values; the "
                         "kernels' epilogue runs row-local objectives only")
    return code


@memoize("registry.objective_flags", 256, "objective_flags' answers by (spec.Policy, sequence-level clip means)")
def objective_flags(pol, seq_clip_means: bool = False) -> ObjectiveFlags:
    """The policy term's flags (a spec.Policy; cached). ``seq_clip_means``: the call's clip fractions are
    TRL's means over sequences (PolicyTokens.sequence_level)."""
    kl = pol.kl_beta != 0.0
    return ObjectiveFlags(
        OBJECTIVE=kernel_code(pol.objective),
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


_EPILOGUE_FLAGS = ("OBJECTIVE", "CISPO_VERL", "LOG_RATIO_CLAMP", "KL_EST", "KL_CLAMP", "KL_K2_GRAD", "KL_IS_CORR")
"""The objective's flags the fused epilogue reads (kernels.terms' ``_objective`` and ``kl_estimator``)."""


def _policy_flags(c: TermContext) -> dict[str, Any]:
    if not c.fused_policy:  # (deferred mode's objective kernels take objective_flags)
        return {}
    objective = objective_flags(c.spec.policy)
    return {"HAS_POLICY": True, **{name: getattr(objective, name) for name in _EPILOGUE_FLAGS}}


def _policy_scalars(spec: LossSpec) -> dict[str, float] | None:
    pol = spec.policy
    if pol is None:
        return None
    return {"eps_low": pol.eps_low, "eps_high": pol.eps_high, "pol_delta": inf_scalar(pol.delta),
            "dual_c": inf_scalar(pol.dual_clip_c), "kl_beta": pol.kl_beta, "entropy_coef": pol.entropy_coef,
            **{name: inf_scalar(getattr(pol, name)) for name in OBJECTIVES[pol.objective].params}}


POLICY = Term(
    "policy",
    flags=(Flag("HAS_POLICY", bool, "token-level policy objective in the epilogue (fused mode)"),
           Flag("OBJECTIVE", int, "policy objective: its kernel code (policy_tables.OBJECTIVES)", 0),
           Flag("CISPO_VERL", bool, "CISPO's coefficient clip(r, 1 - eps_low, 1 + eps_high), else TRL's "
                "min(r, eps_high)"),
           Flag("LOG_RATIO_CLAMP", bool, "verl: log-ratio clamped to [-20, 20] before exp"),
           Flag("KL_EST", int, "policy KL penalty: 0 none, else the estimator's kernel code "
                "(policy_tables.KL_ESTIMATORS)", 0),
           Flag("KL_CLAMP", bool, "verl's k3 clamps (ref - logp to +-20, the value to +-10)"),
           Flag("KL_K2_GRAD", bool, "the estimator's value with the k2 gradient (verl's \"k3+\")"),
           Flag("KL_IS_CORR", bool, "KL times the importance ratio")),
    scalars=(Scalar("eps_low", 0.0), Scalar("eps_high", 0.0),
             Scalar("pol_delta", float("inf"), "two-sided clip cap, inf when off"),
             Scalar("dual_c", float("inf"), "dual clip constant, inf when off"), Scalar("kl_beta", 0.0),
             Scalar("entropy_coef", 0.0), *OBJECTIVE_SCALARS),
    columns=(Column("policy_loss", "aggregation weight x per-token policy loss"),
             Column("counted", "1 where the token counts (the policy term's per-sequence metrics)"),
             Column("ratio", "importance ratio"),
             Column("kl", "per-token KL estimate"),
             Column("clip_low", "1 where the objective clips the token below (clip: ratio < 1 - eps_low, A < 0)"),
             Column("clip_high", "1 where the objective clips the token above (clip: ratio > 1 + eps_high, A > 0)"),
             Column("clip_dual", "verl's pg_clipfrac_lower indicator (dual clip active; DPPO: ratio truncated, "
                    "token kept)"),
             Column("ppo_kl", "old - logp (verl's ppo_kl is its mean)")),
    metrics=POLICY_METRICS,
    flag_values=_policy_flags,
    scalar_values=_policy_scalars,
    stores=lambda c: {**{name: c.fused_policy for name in ("policy_loss", "counted", "ratio", "clip_low",
                                                           "clip_high", "clip_dual", "ppo_kl")},
                      "kl": c.flags.KL_EST != 0},
    metric_columns=lambda c: {"clip_ratio/low_mean": "clip_low", "clip_ratio/high_mean": "clip_high",
                              "logprob/mean": "logp", "kl": "kl", "pg_clipfrac_lower": "clip_dual",
                              "ppo_kl": "ppo_kl"} if c.fused_policy else {},
    reads_targets=lambda spec: spec.policy is not None,
)
