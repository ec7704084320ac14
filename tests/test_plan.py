"""compile_plan: spec -> kernel variant (flags) + runtime values (scalars)."""

import ast
import inspect
import re

import pytest
import torch
from conftest import make_logits, make_targets, needs_kernel, with_
from hypothesis import given
from strategies import CI, valid_specs

from headloss import DFT, CrossEntropy, Entropy, LogitTransform, LossSpec, ZLoss, head_loss
from headloss.kernels import blocks, head, policy, primitives, shard, sparse, terms, topk
from headloss.plan import compile_plan, plan_from_key
from headloss.registry import ROW_COLUMNS, Columns, Flags, Scalars

RICH = LossSpec(
    cross_entropy=CrossEntropy(label_smoothing=0.1),
    z_loss=ZLoss(weight=1e-3),
    entropy=Entropy(weight=0.2),
    token_accuracy=True,
    transform=LogitTransform(softcap=10.0, temperature=0.9),
)


def test_plan_is_cached_per_equal_spec():
    a = compile_plan(LossSpec(z_loss=ZLoss(weight=1e-4)))
    b = compile_plan(LossSpec.model_validate({"z_loss": {"weight": 1e-4}}))
    assert a is b
    assert compile_plan(LossSpec(z_loss=ZLoss(weight=1e-4), cross_entropy=None), has_targets=False) is not a


def test_plan_key_gives_the_plan_back():
    plan = compile_plan(RICH)
    assert plan_from_key(plan.key) is plan
    compile_plan.cache_clear()
    rebuilt = plan_from_key(plan.key)  # a fresh process (or a cleared cache) rebuilds it from the key
    assert rebuilt.spec == plan.spec and rebuilt.flags == plan.flags and rebuilt.cols == plan.cols


@pytest.mark.parametrize(
    "update,scalar,value",
    [
        ({"cross_entropy": CrossEntropy(weight=0.3, label_smoothing=0.1)}, "w_ce", 0.3),
        ({"cross_entropy": CrossEntropy(label_smoothing=0.25)}, "smoothing", 0.25),
        ({"z_loss": ZLoss(weight=0.5)}, "w_z", 0.5),
        ({"entropy": Entropy(weight=-0.7)}, "w_entropy", -0.7),
        ({"transform": LogitTransform(softcap=3.0, temperature=0.9)}, "softcap", 3.0),
        ({"transform": LogitTransform(softcap=10.0, temperature=4.0)}, "inv_temperature", 0.25),
        ({"transform": LogitTransform(softcap=10.0, temperature=0.9, logit_scale=2.0)}, "logit_scale", 2.0),
        ({"dft": DFT(weight=0.3)}, "w_dft", 0.3),
    ],
    ids=["ce_weight", "smoothing", "z_weight", "entropy_weight", "softcap", "temperature", "logit_scale", "dft_weight"],
)
def test_value_changes_reuse_the_kernel_variant(update, scalar, value):
    base = compile_plan(with_(RICH, dft=DFT(weight=1.0)))
    changed = compile_plan(with_(RICH, **{"dft": DFT(weight=1.0), **update}))
    assert changed.flags == base.flags, "a value change must not select another kernel variant"
    assert changed.cols == base.cols
    assert getattr(changed.scalars, scalar) == pytest.approx(value)
    assert getattr(changed.scalars, scalar) != getattr(base.scalars, scalar)
    assert all(isinstance(v, float) for v in changed.scalars), "scalars reach the kernels as fp32"


@pytest.mark.parametrize(
    "update,flag",
    [
        ({"cross_entropy": CrossEntropy()}, "HAS_SMOOTHING"),
        ({"z_loss": None}, "HAS_Z"),
        ({"entropy": None}, "HAS_ENTROPY"),
        ({"entropy": Entropy(weight=0.0)}, "ENTROPY_GRAD"),
        ({"token_accuracy": False}, "HAS_ARGMAX"),
        ({"transform": LogitTransform(temperature=0.9)}, "HAS_SOFTCAP"),
    ],
    ids=["no_smoothing", "no_z", "no_entropy", "entropy_metric_only", "no_accuracy", "no_softcap"],
)
def test_structural_changes_select_another_variant(update, flag):
    base = compile_plan(RICH)
    changed = compile_plan(with_(RICH, **update))
    assert getattr(base.flags, flag) is True
    assert getattr(changed.flags, flag) is False


def test_cross_entropy_only_plan_computes_nothing_else():
    plan = compile_plan(LossSpec())
    assert plan.flags == Flags(
        REDUCTION=0, WEIGHT_NORM=False, SELECTED=0, HAS_CE=True, HAS_SMOOTHING=False, HAS_Z=False, HAS_DFT=False,
        HAS_ENTROPY=False, ENTROPY_GRAD=False, ENTROPY_TOKEN_MEAN=False, HAS_ARGMAX=False, HAS_SOFTCAP=False,
        HAS_POLICY=False,
        OBJECTIVE=0, CISPO_VERL=False, LOG_RATIO_CLAMP=False, KL_EST=0, KL_CLAMP=False, KL_K2_GRAD=False,
        KL_IS_CORR=False, DISTILL_KIND=-1, OWN_TEMP=False, SPARSE=0, TEACHER_PROBS=False, TOPK_FORM=0, TOPK_DIV=0,
        TOPK_CLAMP=False, TOKEN_EST=0, TOKEN_CLAMP=False, TOKEN_K2_GRAD=False, STUDENT_TOPK=0,
    )
    assert plan.mode == "fused" and plan.reduction == "mean"
    assert plan.requires == ("logits", "targets")
    assert plan.accepts == ("num_items_in_batch",)
    assert plan.scalars == Scalars(w_ce=1.0) and plan.used_scalars == ("w_ce", "smoothing")
    # the packed rows hold the token loss, the lse and the ce: nothing else is stored
    assert plan.cols.N == 3 and (plan.cols.token_loss, plan.cols.lse, plan.cols.ce) == (0, 1, 2)
    assert all(getattr(plan.cols, name) == -1 for name in ROW_COLUMNS if name not in ("token_loss", "lse", "ce"))
    assert plan.metrics == (("ce", "ce"),) and plan.outputs == ()


@needs_kernel
def test_unrequested_values_are_absent_from_the_result():
    logits = make_logits((4, 30), torch.float32, seed=2).requires_grad_()
    out = head_loss(logits, make_targets((4,), 30, 2), LossSpec(), backend="triton")
    assert set(out.metrics) == {"loss", "ce", "n_tokens"}
    for name in ("predicted_tokens", "logprobs", "lse", "token_loss", "entropy"):
        assert getattr(out, name) is None, name


@pytest.mark.parametrize(
    "spec,mode",
    [
        (LossSpec(), "fused"),
        (LossSpec(outputs=("logprobs", "entropy")), "fused"),
        (LossSpec(reduction="sum"), "fused"),
        (LossSpec(reduction="none"), "deferred"),
        (LossSpec(outputs=("logprobs",), differentiable_outputs=True), "deferred"),
    ],
    ids=["mean", "detached_outputs", "sum", "reduction_none", "differentiable_outputs"],
)
def test_mode_is_deferred_only_for_reduction_none_or_differentiable_outputs(spec, mode):
    plan = compile_plan(spec)
    assert plan.mode == mode
    assert plan.logit_passes(with_grad=True) == 2


def test_no_grad_plan_has_no_gradient_pass():
    plan = compile_plan(RICH)
    assert plan.logit_passes(with_grad=False) == 1
    traffic = plan.traffic_bytes(rows=8, vocab=100, elem_bytes=2, grad_bytes=2, with_grad=False)
    assert traffic == {"logit_reads": 1600, "grad_writes": 0, "total": 1600}


def test_traffic_with_gradient_counts_two_reads_and_one_write():
    plan = compile_plan(RICH)
    traffic = plan.traffic_bytes(rows=8, vocab=100, elem_bytes=2, grad_bytes=4, with_grad=True)
    assert traffic == {"logit_reads": 3200, "grad_writes": 3200, "total": 6400}


@pytest.mark.parametrize(
    "spec,entropy_grad",
    [
        (LossSpec(entropy=Entropy(weight=0.0)), False),
        (LossSpec(entropy=Entropy(weight=0.1)), True),
        (LossSpec(entropy=Entropy(weight=-0.1)), True),
        (LossSpec(outputs=("entropy",)), False),
        (LossSpec(outputs=("entropy",), differentiable_outputs=True), True),
        (LossSpec(entropy=Entropy(weight=0.0), differentiable_outputs=True, outputs=("lse",)), False),
    ],
    ids=["metric", "penalty", "bonus", "detached_output", "differentiable_output", "differentiable_other_output"],
)
def test_entropy_gradient_only_when_entropy_carries_gradient(spec, entropy_grad):
    flags = compile_plan(spec).flags
    assert flags.HAS_ENTROPY is True
    assert flags.ENTROPY_GRAD is entropy_grad


def test_plan_without_targets():
    spec = LossSpec(cross_entropy=None, entropy=Entropy(weight=0.1), outputs=("predicted_tokens",))
    plan = compile_plan(spec, has_targets=False)
    assert plan.cols.logp == -1
    assert plan.flags.HAS_ARGMAX is True
    assert plan.requires == ("logits",) and "targets" in plan.accepts


def test_plan_without_targets_for_a_spec_needing_them_raises_naming_targets():
    with pytest.raises(ValueError, match="targets: required by cross_entropy, token_accuracy"):
        compile_plan(LossSpec(token_accuracy=True), has_targets=False)


def test_smoothing_flag_only_for_positive_smoothing():
    assert compile_plan(LossSpec(cross_entropy=CrossEntropy(label_smoothing=0.0))).flags.HAS_SMOOTHING is False
    assert compile_plan(LossSpec(cross_entropy=CrossEntropy(label_smoothing=1e-6))).flags.HAS_SMOOTHING is True
    assert compile_plan(LossSpec(cross_entropy=CrossEntropy(label_smoothing=1.0))).flags.HAS_SMOOTHING is True


def test_kernels_take_the_plan_as_named_tuples_by_keyword():
    """No positional option lists: the kernels take the flags, columns and scalars as one named
    tuple each and read them by name, and launchers pass every argument by keyword."""
    for kernel in (head.head_kernel, head.head_backward_kernel):
        params = inspect.signature(kernel.fn).parameters
        assert {"S", "F", "C", "geo"} <= set(params)
        assert "constexpr" in str(params["F"].annotation) and "constexpr" in str(params["C"].annotation)
        assert len(params) <= 20, f"{kernel.fn.__name__} takes {len(params)} parameters"
    tree = ast.parse("\n".join(inspect.getsource(m) for m in (head, shard, policy)))
    calls = [node for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "launch"]
    assert len(calls) >= 10
    for call in calls:  # launch(kernel, grid, num_warps, every kernel argument by keyword)
        assert len(call.args) == 3 and call.keywords, ast.unparse(call)[:80]


def test_every_flag_column_and_scalar_is_read_by_name_in_the_kernels():
    """A field no kernel reads is dead; a field read by a name the plan lacks would not compile."""
    source = "\n".join(inspect.getsource(m) for m in (head, shard, policy, blocks, terms, primitives, sparse, topk))
    for name in Flags._fields:
        assert f"F.{name}" in source, f"flag {name} is never read"
    for name in Columns._fields:
        assert f"C.{name}" in source, f"column {name} is never written or read"
    for name in Scalars._fields:
        assert f"S.{name}" in source, f"scalar {name} is never read"


def test_columns_are_packed_without_gaps():
    for spec in (LossSpec(), RICH, with_(RICH, dft=DFT(), outputs=("logprobs", "entropy"))):
        cols = compile_plan(spec).cols
        used = sorted(i for i in cols[:-2] if i >= 0)
        assert used == list(range(cols.N))


@CI
@given(spec=valid_specs())
def test_the_registry_names_every_reader_of_the_targets(spec):
    """A spec needs targets exactly where some term of the registry reads them, and a call without them
    names those terms."""
    from headloss.registry import target_readers

    assert spec.needs_targets == bool(target_readers(spec))
    if spec.needs_targets:
        with pytest.raises(ValueError, match="targets: required by " + re.escape(", ".join(target_readers(spec)))):
            compile_plan(spec, has_targets=False)


def test_the_registry_generates_flags_scalars_columns_and_the_metric_order():
    """Each name once, every term's pieces in the generated records, the columns in the terms' order."""
    from headloss.registry import METRIC_ORDER, TERMS

    assert list(Flags._fields) == [flag.name for term in TERMS for flag in term.flags]
    assert list(Scalars._fields) == [s.name for term in TERMS for s in term.scalars]
    assert Scalars() == Scalars(**{s.name: s.default for term in TERMS for s in term.scalars})
    assert list(ROW_COLUMNS) == [c.name for term in TERMS for c in term.columns] == list(Columns._fields[:-2])
    assert METRIC_ORDER[0] == "loss" and METRIC_ORDER[-1] == "n_tokens" and len(set(METRIC_ORDER)) == len(METRIC_ORDER)
    for name in ("flags", "scalars", "columns"):
        names = [part.name for term in TERMS for part in getattr(term, name)]
        assert len(names) == len(set(names)), name
