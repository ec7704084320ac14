"""LossSpec: which losses, metrics and per-token outputs an LM head needs.

A spec is plain data (pydantic v2, frozen, unknown fields rejected). It says *what* to compute;
:mod:`headloss.plan` decides *how* (which kernel variant, which runtime scalars).

Conventions (x is the transformed logit row, see :class:`LogitTransform`; lse = logsumexp(x)):

* cross-entropy      ce   = (1 - eps) * (lse - x[y]) + eps * (lse - mean(x))
* z-loss             z    = lse ** 2
* entropy            H    = lse - sum(softmax(x) * x)
* DFT                dft  = -sg(p[y]) * log p[y]   (cross-entropy scaled by the detached target probability)
* distillation       D    = KL / JSD between student and teacher at temperature T_d (or from the
                            teacher's top-k, or an estimator at the target token)
* per-token loss     L    = w_ce * ce + w_z * z + w_dft * dft + w_H * H + w_D * D   (0 at ignored positions)
* policy (GRPO)      a clipped surrogate on log p(target), aggregated by its own loss_type and
                     added to the reduced loss (see :class:`Policy`)
* token weights      with token_weights, w * L per token (w: the call's token_weights)
* reduction          mean: sum(w * L) / (non-ignored tokens, their summed weights, or num_items_in_batch)
                     sum:  sum(w * L)
                     none: w * L per token (differentiable)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from .spec_terms import (
    DFT,
    OUTPUT_NAMES,
    VERL_ESTIMATORS,
    CrossEntropy,
    Distillation,
    Entropy,
    LogitTransform,
    OutputName,
    Policy,
    PolicyLossType,
    PolicyObjective,
    TokenWeights,
    ZLoss,
    _Frozen,
    base_policy,
    clamps_log_ratio,
    row_local,
    separate_kl_entropy,
)

__all__ = [
    "OutputName",
    "OUTPUT_NAMES",
    "CrossEntropy",
    "ZLoss",
    "DFT",
    "Entropy",
    "VERL_ESTIMATORS",
    "Distillation",
    "PolicyLossType",
    "PolicyObjective",
    "Policy",
    "base_policy",
    "clamps_log_ratio",
    "separate_kl_entropy",
    "row_local",
    "LogitTransform",
    "TokenWeights",
    "LossSpec",
    "FIELD_NAMES",
]


class LossSpec(_Frozen):
    """Everything the head computes in one pass over the logits.

    ``LossSpec()`` is plain mean cross-entropy. Terms set to ``None`` are absent; a present
    term contributes ``weight * value`` to the loss and its mean value to ``metrics``.
    """

    cross_entropy: CrossEntropy | None = CrossEntropy()
    z_loss: ZLoss | None = None
    dft: DFT | None = None
    entropy: Entropy | None = None
    distillation: Distillation | None = None
    policy: Policy | None = None
    token_accuracy: bool = Field(False, description="metric: fraction of non-ignored argmax == target")
    student_topk: int | None = Field(
        None, ge=1, le=64,
        description="the student's k most likely ids per row, found in the same pass (outputs topk_ids, "
        "topk_logprobs; ties to the lower id); with a top-k teacher also verl's overlap metrics (and outputs "
        "overlap_count, overlap_token_advantage)")
    outputs: tuple[OutputName, ...] = Field((), description="per-token tensors to return")
    differentiable_outputs: bool = Field(
        False,
        description="per-token outputs (logprobs, entropy, lse, token_loss) carry gradient; "
        "runs the deferred mode (gradient pass in backward, logits kept until then)",
    )
    transform: LogitTransform = LogitTransform()
    token_weights: TokenWeights | None = Field(
        None, description="per-token weights (the call's token_weights) on every term and its gradient")
    ignore_index: int = -100
    reduction: Literal["mean", "sum", "none"] = "mean"

    @field_validator("outputs")
    @classmethod
    def _outputs_unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        seen = [name for name in value if value.count(name) > 1]
        if seen:
            raise ValueError(f"outputs lists {sorted(set(seen))} more than once")
        return tuple(sorted(value, key=OUTPUT_NAMES.index))

    @model_validator(mode="after")
    def _topk_outputs(self) -> LossSpec:
        asked = [name for name in ("topk_ids", "topk_logprobs") if name in self.outputs]
        if asked and self.student_topk is None:
            raise ValueError(f"outputs: {', '.join(asked)} need student_topk (k, 1 to 64)")
        overlap = [name for name in ("overlap_count", "overlap_token_advantage") if name in self.outputs]
        if overlap and not self.topk_overlap:
            raise ValueError(f"outputs: {', '.join(overlap)} (verl's overlap of the student's top-k with the "
                             "teacher's ids) need student_topk and distillation with teacher: topk")
        return self

    @model_validator(mode="after")
    def _something_requested(self) -> LossSpec:
        if not (self.terms or self.token_accuracy or self.outputs):
            raise ValueError(
                "nothing requested: give at least one term (cross_entropy, z_loss, dft, entropy, distillation, "
                "policy), "
                "token_accuracy: true, or an entry in outputs"
            )
        if self.reduction == "none" and not self.terms:
            raise ValueError("reduction: 'none' needs at least one loss term to reduce")
        if self.policy is not None and self.reduction == "none":
            raise ValueError("reduction: 'none' cannot hold the policy term, which aggregates by policy.loss_type")
        return self

    # --- derived facts ---------------------------------------------------------------------

    @property
    def terms(self) -> dict[str, CrossEntropy | ZLoss | DFT | Entropy | Distillation | Policy]:
        """The present loss terms by name, in a fixed order."""
        named = {
            "cross_entropy": self.cross_entropy,
            "z_loss": self.z_loss,
            "dft": self.dft,
            "entropy": self.entropy,
            "distillation": self.distillation,
            "policy": self.policy,
        }
        return {name: term for name, term in named.items() if term is not None}

    @property
    def topk_overlap(self) -> bool:
        """The student's top-k beside a top-k teacher: verl's overlap diagnostics are computed."""
        return self.student_topk is not None and self.distillation is not None and \
            self.distillation.teacher == "topk"

    @property
    def needs_targets(self) -> bool:
        return (
            self.cross_entropy is not None
            or self.dft is not None
            or self.token_accuracy
            or "logprobs" in self.outputs
            or self.policy is not None
            or (self.distillation is not None and self.distillation.teacher == "token")
        )

    # --- construction and serialisation ---------------------------------------------------

    @classmethod
    def coerce(cls, spec: LossSpec | dict[str, Any] | str | Path | None) -> LossSpec:
        """Accept a LossSpec, a plain dict, or a path to a YAML/JSON file (None: the default spec)."""
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, dict):
            return cls.model_validate(spec)
        if isinstance(spec, (str, Path)):
            return cls.from_file(spec)
        raise TypeError(f"spec: expected LossSpec, dict or a path, got {type(spec).__name__}")

    @classmethod
    def from_file(cls, path: str | Path) -> LossSpec:
        """Load from ``.yaml``/``.yml`` or ``.json``."""
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"path: {path} is a directory, not a spec file (.yaml, .yml or .json)")
        if path.suffix not in (".yaml", ".yml", ".json"):
            raise ValueError(f"path: unknown spec file type {path.suffix!r} ({path}); use .yaml, .yml or .json")
        try:
            text = path.read_text()
        except OSError as error:  # same exception type, with the path and the role of the file
            raise type(error)(f"{path}: cannot read the spec file ({error.strerror or error})") from None
        data = _parse_spec_text(path, text)
        if data is None:
            raise ValueError(
                f"{path}: the file holds no spec (it is empty or only comments); "
                "write {} for the default spec (mean cross-entropy)"
            )
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a spec file holds a mapping, got {type(data).__name__}")
        return cls.model_validate(data)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _parse_spec_text(path: Path, text: str) -> Any:
    """YAML or JSON text -> data (None for an empty or comment-only file); syntax errors name the
    file and the line."""
    if path.suffix == ".json":
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            where = f"line {error.lineno}, column {error.colno}"
            raise ValueError(f"{path}: invalid JSON at {where}: {error.msg}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{path}: invalid YAML{where}: {problem}") from None


FIELD_NAMES: dict[type, tuple[str, ...]] = {cls: tuple(cls.model_fields) for cls in _Frozen.__subclasses__()}
"""Field names of every spec model, as plain tuples (read where pydantic's own metadata cannot be, e.g.
while torch.compile traces a call)."""
