"""A call's optional inputs as typed objects: what the public entry points bundle their keywords into.

:class:`Teacher` is the distillation term's teacher, :class:`PolicyBatch` the policy term's inputs
(:class:`headloss.spec.Policy`). Every layer below the entry points takes these by name; the list of
the policy inputs is written here once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Teacher:
    """The teacher of the distillation term: its logits [.., V], or its hidden states [.., Ht] with its
    lm_head weight [V, Ht] (and bias [V]), whose logits the lm_head computes chunk by chunk; or a sparse
    teacher (spec.Distillation.teacher): its top-k ``ids`` [.., K] with their ``logprobs`` [.., K], or
    ``logprobs`` at the target tokens."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None

    @property
    def given(self) -> bool:
        return any(t is not None for t in (self.logits, self.hidden, self.weight, self.bias, self.ids,
                                           self.logprobs))

    @property
    def sparse(self) -> bool:
        """A top-k or per-token teacher is given."""
        return self.ids is not None or self.logprobs is not None

    @property
    def computed(self) -> bool:
        """The teacher's logits are computed from its hidden states (the lm_head's chunks)."""
        return self.hidden is not None


@dataclass(frozen=True)
class PolicyBatch:
    """The policy term's inputs of one call, as given (checked and flattened by headloss.policy.inputs).

    Per-token tensors are shaped like the targets; ``advantages`` [B] or like the targets (packed rows:
    [S] per sequence or [N]); ``sequence_ids`` [N] name each row's sequence for [N, V] rows.
    ``num_sequences_in_batch`` divides sequence-mean losses (verl's global batch);
    ``entropy_quantile_group`` is the process group of the top-entropy quantile (TRL)."""

    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    importance_weights: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    sequence_ids: torch.Tensor | None = None
    num_sequences_in_batch: int | float | torch.Tensor | None = None
    entropy_quantile_group: Any = None

    def given(self) -> dict[str, Any]:
        """Every input by name (None where not given): the form headloss.policy.inputs checks."""
        return {name: getattr(self, name) for name in POLICY_INPUTS}

    @property
    def empty(self) -> bool:
        return all(value is None for value in self.given().values())

    def map_tokens(self, fn: Callable[[torch.Tensor | None, str], torch.Tensor | None]) -> PolicyBatch:
        """The batch with ``fn(tensor, name)`` applied to its per-row tensors (every input but the two
        batch-wide ones)."""
        return replace(self, **{name: fn(getattr(self, name), name) for name in TOKEN_INPUTS})


POLICY_INPUTS = tuple(f.name for f in fields(PolicyBatch))
"""The policy inputs by name, in the order of PolicyBatch's fields."""
TOKEN_INPUTS = POLICY_INPUTS[:-2]
"""The policy inputs that hold a value per row (or per sequence): every one but the two batch-wide ones."""


@dataclass(frozen=True)
class Layout:
    """How a call's rows map to tokens: next-token ``shift``, or packed sequences (``cu_seqlens`` [S + 1]
    or ``position_ids`` [N] / [1, N]; headloss.packed)."""

    shift: bool = False
    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None or self.position_ids is not None


@dataclass(frozen=True, kw_only=True)
class Options:
    """How a call runs (headloss.api documents each): the checks, the backend, the route, the group."""

    validate: Any = None
    backend: str = "auto"
    route: str | None = None
    group: Any = None
    inplace_grad: bool = False  # head_loss: the gradient over the logits


@dataclass(frozen=True, kw_only=True)
class LinearOptions(Options):
    """The fused lm_head's options besides :class:`Options`' (headloss.chunks: the budget's cut)."""

    chunk_bytes: int
    fp32_weight_grad: bool
    compact: bool
    hidden_grad: str

    def __post_init__(self):
        if self.hidden_grad not in ("reduced", "partial"):
            raise ValueError(f"hidden_grad: expected 'reduced' or 'partial', got {self.hidden_grad!r}")
