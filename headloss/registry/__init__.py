"""The terms of a LossSpec, one descriptor each: what the plan derives from a term, in one place.

A :class:`Term` declares, for its LossSpec field:

* ``flags``    its constexpr flags (:class:`Flag`: name, type, what it selects, its value when off),
  and ``flag_values``: how a spec and the call set them;
* ``scalars``  its runtime values (:class:`Scalar`: name, default), and ``scalar_values``: a present
  term's values (None where the term is absent: its scalars keep their defaults, unused);
* ``columns``  the per-row values its kernel pieces store (:class:`Column`), and ``stores``: which
  a call stores;
* ``metrics``  its metrics' names in their order, and ``metric_columns``: those that are a column's
  mean over the counted rows (the others come from elsewhere: the policy term's extremes);
* ``reads_targets``  whether a spec's term reads the targets (a missing target names it).

:data:`Flags`, :data:`Scalars`, :data:`ROW_COLUMNS` / :data:`Columns` and :data:`METRIC_ORDER` are
generated from :data:`TERMS`; headloss.plan holds no per-term table. The columns are packed in the
order of TERMS (then of each term's ``columns``), the metrics in the order of LossSpec's fields.
Adding a term: its spec sub-model (spec.py), its kernel pieces (kernels/terms.py), its descriptor here
(``terms.py``, or a module of its own as ``policy.py`` is) placed in TERMS (CONTRIBUTING.md).
"""

from __future__ import annotations

from collections import namedtuple
from typing import NamedTuple

from ..layouts import EXTREME_METRICS, OBJECTIVE_METRICS
from ..policy_tables import OBJECTIVES
from ..spec import LossSpec, Policy
from .base import Column, Flag, Scalar, Term, TermContext
from .policy import OBJECTIVE_SCALARS, POLICY, POLICY_METRICS, ObjectiveFlags, kernel_code, objective_flags
from .terms import CORE, CROSS_ENTROPY, DFT, DISTILLATION, ENTROPY, STUDENT_TOPK, TOKEN_ACCURACY, TRANSFORM, Z_LOSS

TERMS: tuple[Term, ...] = (CORE, CROSS_ENTROPY, Z_LOSS, DFT, ENTROPY, TRANSFORM, TOKEN_ACCURACY, DISTILLATION, POLICY,
                           STUDENT_TOPK)
"""Every term, in the packed row buffer's column order (and the order of Flags and Scalars)."""


# --- generated --------------------------------------------------------------------------------

def _flag_fields() -> list[tuple[str, type]]:
    return [(flag.name, flag.kind) for term in TERMS for flag in term.flags]


Flags = NamedTuple("Flags", _flag_fields())
Flags.__doc__ = ("Constexpr structure of one kernel variant (read by name in the kernels), generated from the "
                 "terms' flags (registry.TERMS).")

Scalars = namedtuple("Scalars", [s.name for term in TERMS for s in term.scalars],
                     defaults=[s.default for term in TERMS for s in term.scalars])
Scalars.__doc__ = ("Runtime values (fp32 in the kernels): changing one never recompiles. Python floats only "
                   "(kernels.launch keys a Scalars by its type). Generated from the terms' scalars.")

ROW_COLUMNS: dict[str, str] = {column.name: column.doc for term in TERMS for column in term.columns}
"""Every value a kernel may store per row, by name, in the packed buffer's order. A plan uses a subset."""

_WIDTHS = {column.name: column.width for term in TERMS for column in term.columns if column.width is not None}

Columns = NamedTuple("Columns", [(name, int) for name in ROW_COLUMNS] + [("N", int), ("N_REDUCED", int)])
Columns.__doc__ = ("Column of each per-row value in the packed row buffer (-1 when absent); N columns in all, the "
                   "first N_REDUCED of them the last program's reduction reads (the rest: blocks of a width).")

TERM_BY_FIELD: dict[str, Term] = {term.name: term for term in TERMS}

METRIC_ORDER: tuple[str, ...] = (
    "loss",
    *(name for field in LossSpec.model_fields if field in TERM_BY_FIELD for name in TERM_BY_FIELD[field].metrics),
    "n_tokens",
)
"""The order of ``out.metrics`` and ``out.packed_metrics()`` on every path and entry point, and of the
logging helpers: ``loss``, then each term's metrics in the order of LossSpec's fields (cross_entropy,
z_loss, dft, entropy, distillation, policy, token_accuracy), then ``n_tokens``. A name not listed here
(a caller's own) goes after the listed ones, before ``n_tokens``."""


def flags_of(context: TermContext) -> Flags:
    """The variant's flags: each term's values, its flags' ``off`` values where it sets none."""
    values = {flag.name: flag.off for term in TERMS for flag in term.flags}
    for term in TERMS:
        values.update(term.flag_values(context))
    return Flags(**values)


def scalars_of(spec: LossSpec) -> dict[str, float]:
    """The values the present terms read, by name, in the terms' order (the rest keep their defaults)."""
    out: dict[str, float] = {}
    for term in TERMS:
        values = term.scalar_values(spec)
        if values:
            out.update(values)
    return out


def columns_of(context: TermContext) -> Columns:
    """The per-row values a call's kernels store: each stored column of ROW_COLUMNS, in its order, then each
    column with a ``width`` (that many from its index on: the last columns, which the last program's
    reduction does not read)."""
    stored: dict[str, bool] = {}
    for term in TERMS:
        stored.update(term.stores(context))
    index = {name: -1 for name in ROW_COLUMNS}
    n = reduced = 0
    for name in sorted(ROW_COLUMNS, key=lambda name: name in _WIDTHS):  # (blocks last: unreduced, kernels.blocks)
        if stored.get(name, False):
            index[name] = n
            width = _WIDTHS.get(name)
            n += 1 if width is None else width(context)
            reduced += width is None
    return Columns(**index, N=n, N_REDUCED=reduced)


def metric_columns_of(context: TermContext, cols: Columns) -> dict[str, str]:
    """(metric -> column) of every metric a stored column's mean gives."""
    out: dict[str, str] = {}
    for term in TERMS:
        out.update(term.metric_columns(context))
    return {name: column for name, column in out.items() if getattr(cols, column) >= 0}


class Derived(NamedTuple):
    """What a plan takes from the terms: the variant's flags, its stored columns, the present terms'
    runtime values (by name, in the terms' order) and every (metric, column) a column mean gives."""

    flags: Flags
    cols: Columns
    scalars: dict[str, float]
    metric_columns: dict[str, str]


def derive(spec: LossSpec, has_targets: bool, fused_policy: bool, selected_k: int = 0) -> Derived:
    """The terms' share of a plan (headloss.plan.compile_plan): a spec that reads the targets without
    them is refused here, naming the terms that read them. ``selected_k``: the call's selected ids per
    row (the width of the ``selected`` columns)."""
    if spec.needs_targets and not has_targets:
        raise ValueError(f"targets: required by {', '.join(target_readers(spec))} but not given")
    context = TermContext(spec, has_targets, fused_policy, selected_k)
    context = context._replace(flags=flags_of(context))
    cols = columns_of(context)
    return Derived(context.flags, cols, scalars_of(spec), metric_columns_of(context, cols))


def target_readers(spec: LossSpec) -> list[str]:
    """The present terms that read the targets, as a missing target names them."""
    return [term.target_reason or term.name for term in TERMS if term.reads_targets(spec)]


def _check() -> None:
    """Each name declared once; every objective's own parameter is a Scalars field; every metric the
    kernels compute elsewhere has its place in METRIC_ORDER."""
    named = set(EXTREME_METRICS) | set(OBJECTIVE_METRICS)
    if len(set(METRIC_ORDER)) != len(METRIC_ORDER) or not named <= set(METRIC_ORDER):
        raise RuntimeError(f"headloss.registry: METRIC_ORDER must list each metric once (unlisted: "
                           f"{sorted(named - set(METRIC_ORDER))})")
    fields = set(LossSpec.model_fields)
    for term in TERMS:
        if term.name not in fields and term.name not in ("core", "transform"):
            raise RuntimeError(f"headloss.registry: term {term.name!r} is no LossSpec field")
    for kind, names in (("flag", [f[0] for f in _flag_fields()]), ("scalar", list(Scalars._fields)),
                        ("column", [c.name for t in TERMS for c in t.columns])):
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise RuntimeError(f"headloss.registry: {kind}s declared twice: {twice}")
    for name, row in OBJECTIVES.items():
        for param in row.params:
            if param not in Scalars._fields or param not in Policy.model_fields:
                raise RuntimeError(f"headloss.registry: objective {name!r} reads {param!r}, which must be both a "
                                   "spec.Policy field and a Scalars field (OBJECTIVE_SCALARS) of that name")


_check()


__all__ = ["CORE", "CROSS_ENTROPY", "DFT", "DISTILLATION", "ENTROPY", "METRIC_ORDER", "OBJECTIVE_SCALARS", "POLICY",
           "POLICY_METRICS", "ROW_COLUMNS", "TERMS", "TERM_BY_FIELD", "TOKEN_ACCURACY", "TRANSFORM", "Z_LOSS",
           "Column", "Columns", "Derived", "Flag", "Flags", "ObjectiveFlags", "Scalar", "Scalars", "Term",
           "TermContext", "columns_of", "derive", "flags_of", "kernel_code", "metric_columns_of", "objective_flags",
           "scalars_of", "target_readers"]
