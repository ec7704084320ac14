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
from typing import Any, Literal

import torch

from .batch import MAX_SELECTED
from .bounded import BoundedDict, cache, memoize
from .layouts import EXTREME_METRICS, EXTREMES
from .policy_tables import OBJECTIVES
from .registry import METRIC_ORDER, Columns, Flags, Scalars, derive
from .spec import FIELD_NAMES, LossSpec, base_policy
from .validation import check_selected_given

Mode = Literal["fused", "deferred"]

_METRIC_RANK = {name: i for i, name in enumerate(METRIC_ORDER)}


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


@memoize("plan.compile_plan", 256, "compile_plan's plans by (spec, has_targets, selected_k)")
def compile_plan(spec: LossSpec, *, has_targets: bool = True, selected_k: int = 0) -> KernelPlan:
    """Map a spec to a kernel plan. Cached: the same spec and inputs give the same plan object.
    ``selected_k``: the call's selected ids per row (outputs: selected_logprobs; :func:`selecting`)."""
    pol = spec.policy
    # a token-level policy objective is row-local: the kernel's epilogue computes it (fused mode).
    # Sequence-level ratios need other rows: the objective runs after the stats pass on the deferred
    # mode's per-token log-probs (policy_sequence_kernel, or torch), whose gradient the backward kernel
    # turns into the logits' gradient
    sequence_policy = pol is not None and not pol.row_local
    deferred = spec.reduction == "none" or spec.differentiable_outputs or sequence_policy
    fused_policy = pol is not None and not deferred
    outputs = tuple(
        (name, col) for name, col in (("logprobs", "logp"), ("lse", "lse"), ("token_loss", "token_loss"),
                                      ("entropy", "entropy"))
        if name in spec.outputs
    )
    requires, accepts = _plan_inputs(spec)
    made_from = {"spec": spec.to_dict(), "has_targets": has_targets}
    if selected_k:
        made_from["selected_k"] = selected_k
    key = json.dumps(made_from, sort_keys=True)
    base = _base_of(spec, selected_k) if deferred and pol is not None else None
    flags, cols, used, metric_columns = derive(spec, has_targets, fused_policy, selected_k)  # (headloss.registry)
    metrics = tuple(sorted(metric_columns.items(), key=lambda item: _METRIC_RANK[item[0]]))
    extra = EXTREME_METRICS if fused_policy else ()  # the last program's values after the loss, means[cols.N]
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
        base=base,
    )
    _BY_KEY[key] = plan
    return plan


def _base_of(spec: LossSpec, selected_k: int = 0) -> KernelPlan | None:
    """The fused plan of the row-local objective that the lm_head's corrected routes (routes: covariance,
    entropy-guess) run before a batch statistic corrects a few rows; None where the spec has none or
    its base still needs deferred mode (a top-entropy mask under a covariance objective)."""
    pol = spec.policy
    objective = OBJECTIVES[pol.objective]
    if objective.base is None and not (objective.row_local and pol.top_entropy_quantile < 1.0):
        return None
    candidate = compile_plan(spec.model_copy(update={"policy": base_policy(pol)}), has_targets=True,
                             selected_k=selected_k)
    return candidate if candidate.mode == "fused" else None


def _plan_inputs(spec: LossSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the inputs a call must give, those it may give): what explain prints."""
    requires = ("logits", "targets") if spec.needs_targets else ("logits",)
    accepts: tuple[str, ...] = () if spec.needs_targets else ("targets",)
    dist = spec.distillation
    if dist is not None:
        requires += {"logits": ("teacher_logits",), "probs": ("teacher_probs",),
                     "topk": ("teacher_ids", "teacher_logprobs or teacher_probs"),
                     "token": ("teacher_logprobs",)}[dist.teacher]
    if spec.policy is not None:
        requires += ("advantages",) + (("ref_logprobs",) if spec.policy.kl_beta != 0.0 else ())
        accepts += ("old_logprobs", "loss_mask", "importance_weights", "rollout_logprobs", "sequence_ids")
    if spec.reduction == "mean":
        accepts += ("num_items_in_batch",)
    if spec.transform.per_row_temperature:  # each row's own, per row or per sequence
        requires += ("temperature",)
    if spec.token_weights is not None:  # per token, or per sequence
        requires += ("token_weights",)
    if "selected_logprobs" in spec.outputs:  # [.., K] ids, -1 where none
        requires += ("selected_ids",)
    return requires, accepts


_BY_KEY: BoundedDict[str, KernelPlan] = cache("plan.by_key", 1024, "plans by key (plan_from_key: the ops' argument)")


def plan_from_key(key: str) -> KernelPlan:
    """The plan a key was made from (the custom ops carry plans as keys)."""
    plan = _BY_KEY.get(key)
    return plan if plan is not None else _from_key(key)


def _from_key(key: str, selected_k: int | None = None) -> KernelPlan:
    """compile_plan of what ``key`` was made from, with ``selected_k`` selected ids where given."""
    made_from = json.loads(key)
    return compile_plan(LossSpec.model_validate(made_from["spec"]), has_targets=made_from["has_targets"],
                        selected_k=made_from.get("selected_k", 0) if selected_k is None else selected_k)


def selecting(plan: KernelPlan, k: int) -> KernelPlan:
    """``plan`` for a call with ``k`` selected ids per row (``selected_ids`` [.., k]; 0: none): its
    ``selected`` columns, the SELECTED flag. A call's selected ids must match its spec's outputs both ways."""
    check_selected_given(plan.spec, k > 0)
    if k > MAX_SELECTED:
        raise ValueError(f"selected_ids: {k} ids per row; at most {MAX_SELECTED} (the last dimension is K)")
    if plan.flags.SELECTED == k:
        return plan
    return _selecting(plan.key, k)


@torch.compiler.assume_constant_result
def _selecting(key: str, k: int) -> KernelPlan:
    return _from_key(key, k)


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


_DEFAULT_SPEC = LossSpec()
_PLANS_BY_ID: BoundedDict[tuple[int, bool], tuple[LossSpec, KernelPlan]] = cache(
    "plan.by_id", 1024, "plan_for's plans by (id of the spec object, has_targets)")
_PLANS_BY_DATA: BoundedDict[tuple[str, bool], KernelPlan] = cache(
    "plan.by_data", 1024, "plan_for's plans by (the spec's data, has_targets)")


def _plan_by_id(spec: LossSpec, has_targets: bool) -> KernelPlan:
    hit = _PLANS_BY_ID.get((id(spec), has_targets))
    if hit is not None and hit[0] is spec:
        return hit[1]
    plan = compile_plan(spec, has_targets=has_targets)
    _PLANS_BY_ID[(id(spec), has_targets)] = (spec, plan)  # holds spec: its id is not reused meanwhile
    return plan


SPEC_OBJECT_CONSTANT = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
"""Whether Dynamo hands a user object to an ``assume_constant_result`` function (torch 2.13 does; 2.11
raises AsPythonConstantNotImplementedError): then a LossSpec's plan is read from the object at trace time;
before, field by field in the traced code, whose floats are symbols under ``dynamic=True`` (refused)."""


@torch.compiler.assume_constant_result
def _plan_of_spec(spec: LossSpec, has_targets: bool) -> KernelPlan:
    """A LossSpec's plan under torch.compile, run at trace time on the spec object (a frozen model; the
    graph is guarded on which object it is): read field by field in the traced code, its floats would be
    symbolic under ``dynamic=True`` and the plan no constant."""
    return _plan_by_id(spec, has_targets)


def _spec_data(model: Any) -> Any:
    """A LossSpec as plain data through attribute reads only (which torch.compile can trace and
    guard on), without pydantic's serializer (which it cannot trace)."""
    names = FIELD_NAMES.get(type(model))
    if names is not None:
        return {name: _spec_data(getattr(model, name)) for name in names}
    if isinstance(model, tuple):
        return list(model)
    return model


def plan_for(spec: SpecLike | None, has_targets: bool) -> KernelPlan:
    """The cached plan of a spec given in any form; a spec object seen before costs a dict lookup
    (no pydantic hashing or validation per call). Under torch.compile the spec is read once, at
    trace time, and the plan is a constant of the graph (a dict or a path never breaks it; under
    ``dynamic=True`` a dict's numbers are traced as symbols, which a LossSpec object's are not where
    :data:`SPEC_OBJECT_CONSTANT`)."""
    if spec is None:
        spec = _DEFAULT_SPEC
    if isinstance(spec, LossSpec):
        if torch.compiler.is_compiling():  # (read at trace time: the plan is a constant of the graph)
            if SPEC_OBJECT_CONSTANT:
                return _plan_of_spec(spec, has_targets)
            return plan_of_data(_frozen(_spec_data(spec)), has_targets)
        return _plan_by_id(spec, has_targets)
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
