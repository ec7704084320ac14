"""The LossSpec's sub-models, one per term (and the logit transform): plain data, frozen, unknown fields
rejected. headloss.spec assembles them into LossSpec (and re-exports each); the math of each term is in
its docstring and in headloss.spec's.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .policy_tables import (
    IMPORTANCE_SAMPLING,
    KL_ESTIMATORS,
    OBJECTIVES,
    KLName,
    LossTypeName,
    ObjectiveName,
    RatioLevelName,
)

OutputName = Literal["predicted_tokens", "logprobs", "lse", "token_loss", "entropy", "selected_logprobs", "topk_ids",
                     "topk_logprobs", "overlap_count", "overlap_token_advantage"]
"""Per-token tensors a spec may ask for (each shaped like the targets, fp32 or int64; ``selected_logprobs``
like the call's ``selected_ids``, [.., K]: the log-prob of each selected id, 0 where the id is -1;
``topk_ids`` / ``topk_logprobs`` [.., k]: the student's ``student_topk`` most likely ids and their log-probs;
``overlap_count`` / ``overlap_token_advantage``: with ``student_topk`` and a top-k teacher, verl's overlap
diagnostics of each token)."""

OUTPUT_NAMES: tuple[str, ...] = OutputName.__args__


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class CrossEntropy(_Frozen):
    """Cross-entropy against hard labels, with optional label smoothing (torch's convention)."""

    weight: float = Field(1.0, ge=0.0, description="weight of the term in the combined loss")
    label_smoothing: float = Field(0.0, ge=0.0, le=1.0, description="eps in [0, 1]")


class ZLoss(_Frozen):
    """z-loss (PaLM): weight * lse**2, keeps the softmax normaliser near 1."""

    weight: float = Field(1e-4, ge=0.0, description="weight of lse**2 in the combined loss")


class DFT(_Frozen):
    """Dynamic fine-tuning (Wu et al. 2025; TRL SFT ``loss_type="dft"``, Liger ``use_token_scaling``):
    per-token loss ``-sg(p[y]) * log p[y]``, the cross-entropy scaled by the target's detached
    probability. Its gradient is the cross-entropy's times ``p[y]``."""

    weight: float = Field(1.0, ge=0.0, description="weight of the term in the combined loss")


class Entropy(_Frozen):
    """Entropy of the softmax.

    ``weight = 0`` computes it as a metric only (no gradient). A positive weight penalises
    entropy, a negative weight is an entropy *bonus* (RL: ``loss - coef * H`` is ``weight=-coef``).
    """

    weight: float = Field(0.0, description="signed weight of H in the combined loss; 0 = metric only")


VERL_ESTIMATORS: dict[str, tuple[str, bool]] = {
    "kl": ("k1", False), "k1": ("k1", False), "abs": ("abs", False), "mse": ("k2", False), "k2": ("k2", False),
    "low_var_kl": ("k3", True), "k3": ("k3", True),
}
"""verl's kl_penalty names -> (headloss's estimator, verl's clamps): verl's k3 is always low_var_kl's
clamped form. The distillation's ``estimator`` takes them (and their '+' forms)."""


class Distillation(_Frozen):
    """Divergence between the student and a teacher over the same vocabulary.

    ``teacher`` says what the call gives of the teacher (docs/distillation.md sets the conventions
    side by side):

    * ``"logits"``  its logits ``teacher_logits`` [.., V] (or its hidden states and lm_head on the
      fused head). Both are taken at the distillation ``temperature`` T (student: the transformed
      logits / T, teacher: its logits / T); p = student, q = teacher softmax:

      - ``forward_kl``  KL(q || p) = sum q (log q - log p)     (Hinton; TRL's beta = 0)
      - ``reverse_kl``  KL(p || q)                              (TRL's beta = 1)
      - ``jsd``         beta KL(q || M) + (1 - beta) KL(p || M), M = beta q + (1 - beta) p
        (TRL's generalized JSD; beta 0 and 1 are the two KLs above)
    * ``"topk"``  its top-k: ``teacher_ids`` [.., K] (padded with -1) and ``teacher_logprobs``
      [.., K], or their probabilities ``teacher_probs`` [.., K] (each in [0, 1]; 0 is no entry).
      ``topk`` names how K entries make a divergence: ``"verl"`` (verl's
      ``forward_kl_topk``: sum_k q_k (log q_k - log p_k) over the unnormalised entries, clamped at
      0, with its optional ``log_prob_min_clamp``; forward KL only), ``"renormalized"`` (both sides
      renormalised over the K ids) or ``"rest"`` (the K ids plus one outcome for the rest of the
      vocabulary, teacher mass 1 - sum q_k, student 1 - sum p_k).
    * ``"token"``  the teacher's log-prob of each target token, ``teacher_logprobs`` shaped like the
      targets: the per-token ``estimator`` of KL(student || teacher) as verl's ``kl_penalty``
      (k1 logp - lq, k2 (logp - lq)^2 / 2, k3 exp(lq - logp) - (lq - logp) - 1, abs |logp - lq|;
      ``estimator_clamp``: verl's low_var_kl clamps; ``estimator_grad="k2"``: verl's "k3+").
    * ``"probs"``  its probabilities ``teacher_probs`` [.., V] (cached soft labels), each row summing
      to 1 (within 1e-3); a zero probability adds nothing. Every divergence of ``"logits"``, with
      q the given probabilities (the kernels read log q in the same passes).

    A top-k, per-token or probability teacher is taken as given, so ``temperature`` stays 1 there.
    ``scale_by_temperature_squared`` multiplies the term by T**2 (keeps gradient magnitudes
    comparable across temperatures). Gradient flows into the student only.
    """

    weight: float = Field(1.0, ge=0.0, description="weight of the divergence in the combined loss")
    teacher: Literal["logits", "topk", "token", "probs"] = Field("logits",
                                                                 description="what the call gives of the teacher")
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = Field(0.5, ge=0.0, le=1.0, description="jsd interpolation (ignored by the KLs)")
    temperature: float = Field(1.0, gt=0.0)
    scale_by_temperature_squared: bool = False
    topk: Literal["verl", "renormalized", "rest"] = Field("verl", description="teacher 'topk': the K entries' "
                                                          "convention")
    log_prob_min_clamp: float | None = Field(None, le=0.0, description="topk 'verl': both sides' log-probs "
                                             "clamped below at this value")
    estimator: KLName = Field("k3", description="teacher 'token': the per-token KL estimator")
    estimator_clamp: bool = Field(False, description="teacher 'token': verl's low_var_kl clamps of k3")
    estimator_grad: Literal["estimator", "k2"] = Field("estimator", description="teacher 'token': 'k2' keeps "
                                                       "the estimator's value with the k2 gradient")

    @model_validator(mode="before")
    @classmethod
    def _verl_estimator_names(cls, data: Any) -> Any:
        """verl's kl_penalty names as the estimator: kl (k1), mse (k2), low_var_kl (k3 with its clamps),
        and with a trailing '+' (the k2 gradient, verl's straight-through form) any of verl's names, k3+
        being verl's clamped k3. headloss's own k1, k2, k3, abs keep their meaning (k3 unclamped)."""
        if not isinstance(data, dict) or not isinstance(data.get("estimator"), str):
            return data
        name = data["estimator"]
        base = name[:-1] if name.endswith("+") else name
        if base not in VERL_ESTIMATORS or (name == base and name in KL_ESTIMATORS):  # (headloss's own names)
            return data
        estimator, clamp = VERL_ESTIMATORS[base]
        data = {**data, "estimator": estimator}
        if clamp:
            data["estimator_clamp"] = True
        if name.endswith("+") and estimator != "k2":
            data["estimator_grad"] = "k2"
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Distillation:
        if self.teacher != "logits" and self.temperature != 1.0:
            raise ValueError(f"temperature: a {self.teacher!r} teacher is taken as given; temperature applies to "
                             f"teacher logits only (got {self.temperature})")
        if self.teacher == "topk" and self.topk == "verl" and self.divergence != "forward_kl":
            raise ValueError(f"divergence: topk 'verl' is verl's forward KL over the unnormalised top-k; use topk "
                             f"'renormalized' or 'rest' for {self.divergence!r}")
        if self.log_prob_min_clamp is not None and not (self.teacher == "topk" and self.topk == "verl"):
            raise ValueError("log_prob_min_clamp: only verl's top-k convention reads it (teacher 'topk', topk 'verl')")
        if self.teacher == "token" and self.divergence != "forward_kl":
            raise ValueError("divergence: a 'token' teacher takes its estimator instead")
        return self

    @property
    def kind(self) -> int:
        """0 forward KL, 1 reverse KL, 2 mixture JSD (TRL maps beta 0/1 to the KLs)."""
        if self.divergence == "forward_kl" or (self.divergence == "jsd" and self.beta == 0.0):
            return 0
        if self.divergence == "reverse_kl" or (self.divergence == "jsd" and self.beta == 1.0):
            return 1
        return 2

    @property
    def dense(self) -> bool:
        """The teacher is a full row: logits (or hidden states and an lm_head), or probabilities."""
        return self.teacher == "logits" or self.teacher == "probs"


PolicyLossType = LossTypeName
PolicyObjective = ObjectiveName
"""The policy term's values come from headloss.policy_tables, the one list of each."""


class Policy(_Frozen):
    """The GRPO family of policy objectives (TRL's GRPOTrainer, verl's compute_policy_loss) as one
    term of the head's loss, computed from the same pass over the logits as the others.

    A per-token objective on log p(target) (``objective``: the row-local ones run in the kernel's
    epilogue, gmpo and vespo need each sequence, clip_cov and kl_cov the batch) with its importance
    ratio (``importance_sampling``), masks, rollout correction, a KL penalty (``kl_beta``) and an
    entropy bonus, aggregated by ``loss_type`` (TRL's and verl's names) and added to the reduced
    loss. ``convention`` picks TRL's or verl's definition where the two differ.

    Per-call inputs: ``advantages`` ([B] or [B, T]), ``old_logprobs`` (absent: on-policy),
    ``ref_logprobs`` (with kl_beta > 0), ``loss_mask``, ``importance_weights``, ``rollout_logprobs``.
    Every formula and the source it follows: docs/policy.md; every value of objective, estimator,
    ratio level and loss type is a row of :mod:`headloss.policy_tables`.
    """

    objective: PolicyObjective = "clip"
    vespo_k_pos: float = Field(2.0, description="VESPO's k for A >= 0")
    vespo_lambda_pos: float = Field(3.0, description="VESPO's lambda for A >= 0 (at least 1e-4)")
    vespo_k_neg: float = Field(3.0, description="VESPO's k for A < 0")
    vespo_lambda_neg: float = Field(2.0, description="VESPO's lambda for A < 0 (at least 1e-4)")
    cov_ratio: float = Field(0.0002, gt=0.0, le=1.0, description="clip_cov / kl_cov: share of the batch's tokens")
    clip_cov_lb: float = Field(1.0, description="clip_cov: covariance lower bound")
    clip_cov_ub: float = Field(5.0, description="clip_cov: covariance upper bound")
    kl_cov_coef: float = Field(0.1, ge=0.0, description="kl_cov: weight of |log r| (verl's ppo_kl_coef)")
    off_policy_mask: float | None = Field(None, description="TRL's off_policy_mask_threshold")
    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="rollout correction weights from old_logprobs - rollout_logprobs (per token, or the "
        "sequence's sum), replacing importance_weights")
    rollout_is_mode: Literal["truncate", "mask"] = Field("truncate", description="clamp the weights to [min, max], "
                                                         "or zero those outside it (IcePop)")
    rollout_is_min: float | None = Field(None, ge=0.0, description="lower bound (None: none)")
    rollout_is_max: float | None = Field(2.0, gt=0.0, description="upper bound (None: none)")
    rollout_is_batch_normalize: bool = Field(False, description="verl: divide the weights by their batch mean")
    top_entropy_quantile: float = Field(1.0, gt=0.0, le=1.0, description="TRL's top_entropy_quantile rho")
    convention: Literal["trl", "verl"] = "trl"
    loss_type: PolicyLossType = "dapo"
    eps_low: float = Field(0.2, ge=0.0, le=1.0, description="ratio clipped below at 1 - eps_low")
    eps_high: float = Field(0.2, ge=0.0, description="ratio clipped above at 1 + eps_high")
    delta: float | None = Field(None, gt=1.0, description="two-sided clip: ratio capped at delta (INTELLECT-2)")
    dual_clip_c: float | None = Field(None, gt=1.0, description="verl's dual clip for negative advantages")
    sapo_tau_pos: float = Field(1.0, gt=0.0, description="SAPO's gate temperature for A > 0")
    sapo_tau_neg: float = Field(1.05, gt=0.0, description="SAPO's gate temperature for A <= 0")
    dro_beta: float | None = Field(None, gt=0.0, description="DRO's weight of (log r)^2 / 2 (required by dro)")
    reinforce_is_max: float = Field(2.0, gt=0.0, description="reinforce: truncation of the detached token ratio "
                                    "(verl's rollout_is_threshold in bypass mode)")
    dppo_ratio_cap: float = Field(3.0, gt=0.0, description="DPPO's truncation of the detached ratio "
                                  "(verl's clip_ratio_c, whose actor default is 3.0)")
    kl_beta: float = Field(0.0, ge=0.0, description="weight of the KL(pi || pi_ref) penalty")
    kl_estimator: KLName = "k3"
    kl_clamp: bool = Field(False, description="verl's clamps: ref - logp to [-20, 20], the k3 value to [-10, 10]")
    kl_grad: Literal["estimator", "k2"] = Field("estimator", description="'k2': the estimator's value with the "
                                                "k2 gradient (verl's 'k3+')")
    kl_importance_correction: bool = Field(False, description="KL times the importance ratio (DeepSeek-V3.2)")
    importance_sampling: RatioLevelName = "token"
    max_completion_length: int | None = Field(None, gt=0, description="dr_grpo's normaliser")
    num_processes: int = Field(1, gt=0, description="dapo: num_items_in_batch / num_processes; a mean over "
                               "sequences: num_sequences_in_batch / num_processes")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus: loss -= coef * aggregated entropy")
    entropy_aggregation: Literal["loss", "token-mean"] = Field(
        "loss", description="the bonus's entropy aggregated like the KL penalty (verl) or as a mean over the "
        "counted tokens (TRL, over the top-entropy mask's tokens when it is on)")
    kl_entropy_loss_type: PolicyLossType | None = Field(
        None, description="aggregation of the KL penalty and the entropy bonus (None: loss_type); verl's gspo "
        "and sapo aggregate their objective by seq-mean-token-mean and these by loss_agg_mode")

    @model_validator(mode="after")
    def _dr_grpo_needs_length(self) -> Policy:
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("max_completion_length: required by loss_type 'dr_grpo'")
        if self.kl_entropy_loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("max_completion_length: required by kl_entropy_loss_type 'dr_grpo'")
        if self.objective == "dro" and self.dro_beta is None:
            raise ValueError("dro_beta: required by objective 'dro'")
        if self.importance_sampling not in OBJECTIVES[self.objective].ratio_levels:
            raise ValueError(f"importance_sampling: {self.importance_sampling!r} has no meaning for objective "
                             f"{self.objective!r} (it defines its own ratio)")
        if self.rollout_is_mode == "truncate" and self.rollout_is is not None and self.rollout_is_min is None \
                and self.rollout_is_max is None:
            raise ValueError("rollout_is_max: truncation needs a bound (rollout_is_min or rollout_is_max)")
        if None not in (self.rollout_is_min, self.rollout_is_max) and self.rollout_is_min > self.rollout_is_max:
            raise ValueError("rollout_is_min: larger than rollout_is_max")
        if self.objective == "gmpo" and self.loss_type not in ("grpo", "seq-mean-token-mean"):
            raise ValueError("loss_type: objective 'gmpo' is a mean over sequences ('grpo' or 'seq-mean-token-mean')")
        return self

    # The derived facts are module functions (below) that these properties call: code that
    # torch.compile traces calls the functions, because Dynamo cannot run a property of a pydantic
    # model it did not see built (the plan's spec under compile is such a model).

    @property
    def clamps_log_ratio(self) -> bool:
        """verl's token-level losses clamp log r to +-20 before exp (its ratio and its ppo_kl); its
        sequence-level gspo does not."""
        return clamps_log_ratio(self)

    @property
    def separate_kl_entropy(self) -> bool:
        """The KL penalty or the entropy bonus aggregates apart from the objective: by its own
        kl_entropy_loss_type, or (verl's geo_mean, whose objective is a mean over every sequence) by
        agg_loss over the sequences with counted tokens."""
        return separate_kl_entropy(self)

    @property
    def row_local(self) -> bool:
        """The objective needs nothing but each token's own values (the fused kernel computes it)."""
        return row_local(self)


def base_policy(policy: Policy) -> Policy:
    """The row-local objective the fused lm_head runs before a batch statistic corrects a few rows
    (policy_tables: ``base``): for clip_cov the clip objective without dual clip, cap or +-20 clamp, for
    kl_cov unclipped (-A r); for a row-local objective under the top-entropy mask, the objective
    without the mask."""
    base = OBJECTIVES[policy.objective].base
    if base is None:
        return policy.model_copy(update={"top_entropy_quantile": 1.0})
    update = dict(objective=base, convention="trl", delta=None, dual_clip_c=None)
    if policy.objective == "kl_cov":
        update.update(eps_low=1.0, eps_high=math.inf)  # clip(r, 0, inf) = r
    return policy.model_copy(update=update)


def clamps_log_ratio(policy: Policy) -> bool:
    """:attr:`Policy.clamps_log_ratio` (traceable by torch.compile)."""
    return (policy.convention == "verl" and OBJECTIVES[policy.objective].verl_clamp
            and not IMPORTANCE_SAMPLING[policy.importance_sampling].sequence)


def separate_kl_entropy(policy: Policy) -> bool:
    """:attr:`Policy.separate_kl_entropy` (traceable by torch.compile)."""
    if policy.kl_beta == 0.0 and (policy.entropy_coef == 0.0 or policy.entropy_aggregation != "loss"):
        return False
    return (policy.kl_entropy_loss_type not in (None, policy.loss_type)
            or (policy.convention == "verl" and policy.objective == "gmpo"))


def row_local(policy: Policy) -> bool:
    """:attr:`Policy.row_local` (traceable by torch.compile)."""
    return (OBJECTIVES[policy.objective].row_local and not IMPORTANCE_SAMPLING[policy.importance_sampling].sequence
            and policy.off_policy_mask is None and policy.top_entropy_quantile == 1.0
            and not separate_kl_entropy(policy))


class TokenWeights(_Frozen):
    """Per-token weights, the call's ``token_weights`` (float, >= 0, shaped like the targets or one per
    sequence): each counted token's value of every term, and its gradient, is multiplied by its weight.

    ``normalize`` says what ``reduction: mean`` divides the weighted sum by: ``"weights"`` (default) the
    summed weights of the counted tokens, a weighted mean; ``"tokens"`` their count, as an unweighted
    mean does (HF's and TRL's SFT losses divide by tokens; a weighted mean keeps the loss's scale whatever
    the weights' scale). ``num_items_in_batch``, when given, is the divisor either way (for gradient
    accumulation: the summed weights, or tokens, of the whole step). Metrics stay unweighted means over
    the counted tokens; the ``token_loss`` output is the weighted per-token loss.
    """

    normalize: Literal["weights", "tokens"] = Field(
        "weights", description="reduction mean divides by the counted tokens' summed weights, or their count")


class LogitTransform(_Frozen):
    """Applied to every logit before anything else: x = softcap(logit_scale * z) / temperature.

    ``softcap(u) = c * tanh(u / c)`` (Gemma 2); ``None`` disables it. ``per_row_temperature``: the
    temperature is the call's ``temperature`` input, one per row (or per sequence) -- a batch whose
    rollouts were sampled at different temperatures scores each row at its own; ``temperature`` stays 1.
    """

    logit_scale: float = Field(1.0, gt=0.0)
    softcap: float | None = Field(None, gt=0.0)
    temperature: float = Field(1.0, gt=0.0)
    per_row_temperature: bool = Field(False, description="the temperature is the call's `temperature` input, "
                                                         "one per row or per sequence")

    @model_validator(mode="after")
    def _one_temperature(self):
        if self.per_row_temperature and self.temperature != 1.0:
            raise ValueError("transform: per_row_temperature takes each row's temperature from the call's "
                             f"`temperature` input; temperature must stay 1, got {self.temperature}")
        return self

    @property
    def is_identity(self) -> bool:
        return (self.logit_scale == 1.0 and self.softcap is None and self.temperature == 1.0
                and not self.per_row_temperature)
