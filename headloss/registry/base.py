"""The parts of a term's descriptor (headloss.registry): its flags, scalars, columns, and the Term itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..spec import LossSpec


@dataclass(frozen=True)
class Flag:
    """A constexpr flag of the kernel variant (``F.<name>`` in the kernels)."""

    name: str
    kind: type  # bool or int
    doc: str
    off: Any = False  # its value where the term is absent


@dataclass(frozen=True)
class Scalar:
    """A runtime value of the kernels (``S.<name>``, fp32): a new value never recompiles."""

    name: str
    default: float
    doc: str = ""


@dataclass(frozen=True)
class Column:
    """A per-row value the kernels store in the packed row buffer (``C.<name>``; -1 where absent), or with
    ``width`` a block of that many columns from ``C.<name>`` on (the selected ids' log-probs: one per id)."""

    name: str
    doc: str
    width: Callable[[TermContext], int] | None = None


class TermContext(NamedTuple):
    """What a term's rules read: the spec, the call's targets, whether the policy term is the fused
    epilogue's, the call's selected ids per row, and (for ``stores`` and ``metric_columns``) the variant's flags."""

    spec: LossSpec
    has_targets: bool
    fused_policy: bool
    selected_k: int = 0  # the call's selected ids per row (outputs: selected_logprobs), else 0
    flags: Any = None


def _nothing(context: TermContext) -> dict:
    return {}


@dataclass(frozen=True)
class Term:
    """One term (or part of every call: ``core``, ``transform``) and everything the plan derives from it."""

    name: str  # its LossSpec field, or "core" / "transform"
    flags: tuple[Flag, ...] = ()
    scalars: tuple[Scalar, ...] = ()
    columns: tuple[Column, ...] = ()
    metrics: tuple[str, ...] = ()
    flag_values: Callable[[TermContext], dict[str, Any]] = _nothing
    scalar_values: Callable[[LossSpec], dict[str, float] | None] = lambda spec: None
    stores: Callable[[TermContext], dict[str, bool]] = _nothing
    metric_columns: Callable[[TermContext], dict[str, str]] = _nothing
    reads_targets: Callable[[LossSpec], bool] = lambda spec: False
    target_reason: str = ""  # how a missing target names it (default: its name)


def inf_scalar(value: float | None) -> float:
    """A spec value as a kernel scalar: None (an option left off, e.g. no cap) is inf."""
    return float("inf") if value is None else float(value)


def weighted_term(field: str, flag: str, scalar: str, doc: str, formula: str, reads_targets: bool = False) -> Term:
    """The descriptor of a term of one weight (its LossSpec sub-model has ``weight``): the spec's field sets
    the bool ``flag`` (``doc``) and the runtime ``scalar`` (the weight); the term stores its per-row value
    (``formula``) in a column of the field's name, whose mean is the metric of that name."""

    def given(spec: LossSpec) -> bool:
        return getattr(spec, field) is not None

    return Term(
        field,
        flags=(Flag(flag, bool, doc),),
        scalars=(Scalar(scalar, 0.0),),
        columns=(Column(field, formula),),
        metrics=(field,),
        flag_values=lambda c: {flag: given(c.spec)},
        scalar_values=lambda spec: {scalar: getattr(spec, field).weight} if given(spec) else None,
        stores=lambda c: {field: getattr(c.flags, flag)},
        metric_columns=lambda c: {field: field},
        reads_targets=given if reads_targets else (lambda spec: False),
    )
