"""A call's optional inputs: the entry points' keywords and the typed objects they become.

:class:`PolicyInputs`, :class:`HeadInputs` and :class:`LinearInputs` are the per-call keywords of the
entry points (``**inputs: Unpack[...]``), each list written here once. :meth:`CallInputs.of` bundles
them into a :class:`Teacher`, a :class:`PolicyBatch` (the policy term's inputs by name) and a row
:class:`Layout`, which every layer below the entry points takes by name; :class:`Options` holds how
the call runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

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
    probs: torch.Tensor | None = None  # as given (teacher 'probs'): the layers below read them as ``logits``

    @property
    def present(self) -> bool:
        """Any part of a teacher is given."""
        return any(t is not None for t in (self.logits, self.hidden, self.weight, self.bias, self.ids,
                                           self.logprobs, self.probs))

    @property
    def sparse(self) -> bool:
        """A top-k or per-token teacher is given."""
        return self.ids is not None or self.logprobs is not None

    @property
    def computed(self) -> bool:
        """The teacher's logits are computed from its hidden states (the lm_head's chunks)."""
        return self.hidden is not None


class PolicyInputs(TypedDict, total=False):
    """The policy term's inputs (:class:`headloss.spec.Policy`, docs/policy.md): keywords of every entry
    point, and the one list of them.

    Per-token tensors are shaped like the targets; ``advantages`` [B] or like the targets (packed rows:
    [S] per sequence or [N]); ``sequence_ids`` [N] name each row's sequence for [N, V] rows.
    ``num_sequences_in_batch`` divides sequence-mean losses (verl's global batch);
    ``entropy_quantile_group`` is the process group of the top-entropy quantile (TRL)."""

    advantages: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    loss_mask: torch.Tensor | None
    importance_weights: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None
    sequence_ids: torch.Tensor | None
    num_sequences_in_batch: int | float | torch.Tensor | None
    entropy_quantile_group: Any


class HeadInputs(PolicyInputs, total=False):
    """:func:`headloss.head_loss`'s per-call keywords besides the logits, targets, spec and options (its
    docstring says each): the teacher, the policy inputs, the rows' layout and the route."""

    teacher_logits: torch.Tensor | None
    teacher_ids: torch.Tensor | None
    teacher_logprobs: torch.Tensor | None
    teacher_probs: torch.Tensor | None
    num_items_in_batch: int | float | torch.Tensor | None
    shift: bool
    cu_seqlens: torch.Tensor | None
    position_ids: torch.Tensor | None
    temperature: torch.Tensor | None
    token_weights: torch.Tensor | None
    selected_ids: torch.Tensor | None
    route: str | None


class LinearInputs(HeadInputs, total=False):
    """:func:`headloss.linear_head_loss`'s per-call keywords: head_loss's, the lm_head's bias and a teacher
    whose logits the chunks compute from its hidden states."""

    bias: torch.Tensor | None
    teacher_hidden: torch.Tensor | None
    teacher_weight: torch.Tensor | None
    teacher_bias: torch.Tensor | None


MAX_SELECTED = 64
"""The most selected ids per row (``selected_ids`` [.., K], K <= 64): one register block of the head kernel."""

POLICY_INPUTS = tuple(PolicyInputs.__annotations__)
"""The policy inputs by name, in PolicyInputs' order."""
TOKEN_INPUTS = POLICY_INPUTS[:-2]
"""The policy inputs that hold a value per row (or per sequence): every one but the two batch-wide ones."""
_ACCEPTED = {kind: frozenset(kind.__annotations__) for kind in (PolicyInputs, HeadInputs, LinearInputs)}


def check_keywords(inputs: Mapping[str, Any], accepted: type, caller: str) -> None:
    """A TypeError naming the first keyword of ``inputs`` that ``accepted`` (one of the TypedDicts above)
    does not hold, as Python's own for a ``caller`` with these keywords written out."""
    names = _ACCEPTED[accepted]
    for name in inputs:
        if name not in names:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")


@dataclass(frozen=True)
class PolicyBatch:
    """The policy term's inputs of one call, as given (checked and flattened by headloss.policy.inputs):
    every name of :data:`POLICY_INPUTS`, None where not given."""

    inputs: Mapping[str, Any]

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> PolicyBatch:
        for name in given:
            if name in _POLICY_NAMES:
                return cls({name: given.get(name) for name in POLICY_INPUTS})
        return _NO_POLICY_INPUTS  # (most calls: no policy input; one shared empty batch)

    def by_name(self) -> dict[str, Any]:
        """Every input by name (None where not given), a copy: the form headloss.policy.inputs checks."""
        return dict(self.inputs)

    @property
    def sequence_ids(self) -> torch.Tensor | None:
        return self.inputs["sequence_ids"]

    @property
    def empty(self) -> bool:
        return self is _NO_POLICY_INPUTS or all(value is None for value in self.inputs.values())

    def map_tokens(self, fn: Callable[[torch.Tensor | None, str], torch.Tensor | None]) -> PolicyBatch:
        """The batch with ``fn(tensor, name)`` applied to its per-row tensors (every input but the two
        batch-wide ones)."""
        return PolicyBatch({**self.inputs, **{name: fn(self.inputs[name], name) for name in TOKEN_INPUTS}})


_POLICY_NAMES = frozenset(POLICY_INPUTS)
_NO_POLICY_INPUTS = PolicyBatch(dict.fromkeys(POLICY_INPUTS))  # (never written: by_name() and map_tokens copy)


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
    compact: Any  # True, False, or a headloss.scored.ScoredRows (checked in headloss.lm_head)
    hidden_grad: str
    weight_grad: str = "return"

    def __post_init__(self):
        if self.hidden_grad not in ("reduced", "partial"):
            raise ValueError(f"hidden_grad: expected 'reduced' or 'partial', got {self.hidden_grad!r}")
        if self.weight_grad not in ("return", "main_grad"):
            raise ValueError(f"weight_grad: expected 'return' or 'main_grad', got {self.weight_grad!r}")


@dataclass(frozen=True)
class CallInputs:
    """A call's per-call keywords bundled at the door (headloss.api): what headloss.logits.run_head and
    headloss.lm_head.run_linear take."""

    teacher: Teacher
    batch: PolicyBatch
    layout: Layout
    num_items_in_batch: Any = None
    route: str | None = None
    bias: torch.Tensor | None = None  # the lm_head's
    temperature: torch.Tensor | None = None  # per row or per sequence (spec.LogitTransform.per_row_temperature)
    token_weights: torch.Tensor | None = None  # per row or per sequence (spec.TokenWeights)
    selected_ids: torch.Tensor | None = None  # [.., K] per row, -1 where none (outputs: selected_logprobs)

    @property
    def selected_k(self) -> int:
        """The selected ids per row (their last dimension; a constant under torch.compile, which recompiles
        for another K), 0 without them; ids that are no int tensor of K >= 1 are refused, naming them."""
        ids = self.selected_ids
        if ids is None:
            return 0
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            got = getattr(ids, "dtype", type(ids).__name__)
            raise TypeError(f"selected_ids: expected an int64 or int32 tensor, got {got}")
        if ids.dim() == 0 or ids.shape[-1] == 0:
            raise ValueError(f"selected_ids: shape {tuple(ids.shape)} holds no ids (K, the last dimension, is 0 or "
                             "missing)")
        k = ids.shape[-1]
        if torch.compiler.is_compiling():  # K a constant of the graph (a symbol where shapes turned dynamic)
            k = next((i for i in range(1, MAX_SELECTED + 1) if k == i), k)
        return k

    @classmethod
    def of(cls, inputs: Mapping[str, Any], accepted: type, caller: str) -> CallInputs:
        """The bundle of ``inputs``, the keywords of a ``caller`` taking ``accepted`` (HeadInputs or
        LinearInputs): an unknown keyword is a TypeError naming it, as Python's own."""
        check_keywords(inputs, accepted, caller)
        get = inputs.get
        teacher = Teacher(get("teacher_logits"), get("teacher_hidden"), get("teacher_weight"), get("teacher_bias"),
                          get("teacher_ids"), get("teacher_logprobs"), get("teacher_probs"))
        layout = Layout(get("shift", False), get("cu_seqlens"), get("position_ids"))
        return cls(teacher, PolicyBatch.of(inputs), layout, get("num_items_in_batch"), get("route"), get("bias"),
                   get("temperature"), get("token_weights"), get("selected_ids"))
