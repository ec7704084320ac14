"""The policy term's vocabulary, one row per value: objectives, KL estimators, importance-sampling
levels and loss types.

These tables are the only list of each. The spec's Literal types, the plan's kernel codes, the
kernels' constexpr branches, the torch formulas (policy/objectives.py) and their dispatch all read
them, and every piece checks that it covers every row: a value added here without its kernel piece
or its torch formula fails when the module loads (or, for a kernel, when the variant compiles),
never in an ``else`` that computes something else. The reference (headloss.reference) keeps its own
formulas, checked against the spec's names the same way.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Objective(NamedTuple):
    """One policy objective (``Policy.objective``)."""

    kernel: int | None  # its code in the kernels (Flags.OBJECTIVE); None: no row-local kernel piece
    scope: Literal["token", "sequence", "batch"]  # what its value depends on beyond the token's own values
    ratio_levels: tuple[str, ...]  # the importance_sampling values it accepts
    verl_clamp: bool  # convention "verl" clamps its log-ratio to +-20 before exp
    folds_weights: bool  # it folds the importance / rollout weights in itself (else they multiply it)
    base: str | None  # the row-local objective the lm_head runs fused before correcting a few rows
    source: str  # where its definition is read from
    params: tuple[str, ...] = ()  # its own runtime values: spec.Policy fields, plan.Scalars fields of the same name

    @property
    def row_local(self) -> bool:
        """A function of one token's values: the fused kernel's epilogue computes it."""
        return self.scope == "token"


ALL_LEVELS = ("token", "sequence", "sequence_token")

OBJECTIVES: dict[str, Objective] = {
    "clip": Objective(0, "token", ALL_LEVELS, True, False, None,
                      "TRL grpo/bnpo/dr_grpo/dapo/luspo, verl vanilla (dual clip); GSPO with sequence ratios"),
    "cispo": Objective(1, "token", ALL_LEVELS, True, False, None, "TRL cispo, verl cispo"),
    "sapo": Objective(2, "token", ALL_LEVELS, True, False, None, "TRL sapo, verl sapo",
                      ("sapo_tau_pos", "sapo_tau_neg")),
    "gpg": Objective(3, "token", ("token",), False, False, None, "verl gpg"),
    "dro": Objective(4, "token", ("token",), False, False, None, "verl dro", ("dro_beta",)),
    "dppo_tv": Objective(5, "token", ("token",), True, False, None, "verl dppo_tv", ("dppo_ratio_cap",)),
    "dppo_kl": Objective(6, "token", ("token",), True, False, None, "verl dppo_kl", ("dppo_ratio_cap",)),
    "reinforce": Objective(7, "token", ("token",), False, False, None,
                           "verl bypass_mode, rollout_correction loss_type reinforce, rollout_is token",
                           ("reinforce_is_max",)),
    "gmpo": Objective(None, "sequence", ("token",), False, True, None, "verl geo_mean"),
    "vespo": Objective(None, "sequence", ("token",), False, True, None, "TRL vespo"),
    "clip_cov": Objective(None, "batch", ("token",), False, False, "clip", "verl clip_cov"),
    "kl_cov": Objective(None, "batch", ("token",), False, False, "clip", "verl kl_cov"),
}

ObjectiveName = Literal[tuple(OBJECTIVES)]


class KLEstimator(NamedTuple):
    """One estimator of KL(pi || pi_ref) from the sampled token's log-probs (``Policy.kl_estimator``)."""

    kernel: int  # its code in the kernels (Flags.KL_EST; 0 means no KL term)
    formula: str
    verl: str  # verl's kl_penalty name


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": KLEstimator(1, "logp - ref", "kl"),
    "k2": KLEstimator(2, "(logp - ref)^2 / 2", "mse"),
    "k3": KLEstimator(3, "exp(ref - logp) - (ref - logp) - 1", "low_var_kl (with kl_clamp)"),
    "abs": KLEstimator(4, "|logp - ref|", "abs"),
}

KLName = Literal[tuple(KL_ESTIMATORS)]


class RatioLevel(NamedTuple):
    """One importance-sampling level (``Policy.importance_sampling``)."""

    kernel: int  # ObjectiveFlags.IS_MODE
    sequence: bool  # the ratio is a statistic of the sequence
    source: str


IMPORTANCE_SAMPLING: dict[str, RatioLevel] = {
    "token": RatioLevel(0, False, "r = pi / pi_old per token"),
    "sequence": RatioLevel(1, True, "TRL's GSPO: exp(masked mean of log r), gradient through every token"),
    "sequence_token": RatioLevel(2, True, "verl's gspo: the sequence's value, each token's own gradient"),
}

RatioLevelName = Literal[tuple(IMPORTANCE_SAMPLING)]


class LossType(NamedTuple):
    """One aggregation (``Policy.loss_type``): loss = sum over tokens of weight x per-token value."""

    over: Literal["sequences", "tokens"]  # a mean over sequences, or a normaliser of the token sum
    per_sequence: Literal["mean", "sum", "sum_norm", "-"]  # what each sequence contributes to the mean
    source: str


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType("sequences", "mean", "TRL grpo"),
    "bnpo": LossType("tokens", "-", "TRL bnpo: mean over the tokens"),
    "dr_grpo": LossType("tokens", "-", "TRL dr_grpo: sum / (sequences x max_completion_length)"),
    "dapo": LossType("tokens", "-", "TRL dapo: sum / (num_items_in_batch / num_processes)"),
    "token-mean": LossType("tokens", "-", "verl token-mean"),
    "seq-mean-token-sum": LossType("sequences", "sum", "verl seq-mean-token-sum (TRL luspo)"),
    "seq-mean-token-mean": LossType("sequences", "mean", "verl seq-mean-token-mean"),
    "seq-mean-token-sum-norm": LossType("sequences", "sum_norm", "verl seq-mean-token-sum-norm"),
}

LossTypeName = Literal[tuple(LOSS_TYPES)]


def kernel_objectives() -> dict[str, int]:
    """Objective name -> kernel code, for the objectives with a row-local kernel piece."""
    return {name: row.kernel for name, row in OBJECTIVES.items() if row.kernel is not None}


def _check() -> None:
    codes = [row.kernel for row in OBJECTIVES.values() if row.kernel is not None]
    if len(set(codes)) != len(codes):
        raise RuntimeError("policy_tables: two objectives share a kernel code")
    for name, row in OBJECTIVES.items():
        if row.row_local != (row.kernel is not None):
            raise RuntimeError(f"policy_tables: objective {name!r} is row-local exactly when it has a kernel code")
        if row.base is not None and not OBJECTIVES[row.base].row_local:
            raise RuntimeError(f"policy_tables: objective {name!r} has a base that is not row-local")
    if sorted(row.kernel for row in KL_ESTIMATORS.values()) != list(range(1, len(KL_ESTIMATORS) + 1)):
        raise RuntimeError("policy_tables: KL estimator codes must be 1..n (0 is no KL term)")
    if sorted(row.kernel for row in IMPORTANCE_SAMPLING.values()) != list(range(len(IMPORTANCE_SAMPLING))):
        raise RuntimeError("policy_tables: importance-sampling codes must be 0..n-1")


_check()
