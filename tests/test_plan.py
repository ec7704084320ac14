"""compile_plan: spec -> kernel variant (flags) + runtime values (scalars)."""

import inspect

import pytest
import torch
from conftest import make_logits, make_targets, needs_kernel, with_

from headloss import CrossEntropy, Entropy, LogitTransform, LossSpec, ZLoss, compile_plan, head_loss
from headloss.kernels.head import head_forward_kernel
from headloss.plan import KernelFlags

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
    assert compile_plan(LossSpec(z_loss=ZLoss(weight=1e-4)), needs_grad=False) is not a


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
        ({"ignore_index": 0}, "ignore_index", 0),
    ],
    ids=["ce_weight", "smoothing", "z_weight", "entropy_weight", "softcap", "temperature", "logit_scale",
         "ignore_index"],
)
def test_value_changes_reuse_the_kernel_variant(update, scalar, value):
    base = compile_plan(RICH)
    changed = compile_plan(with_(RICH, **update))
    assert changed.flags == base.flags, "a value change must not select another kernel variant"
    assert getattr(changed.scalars, scalar) == pytest.approx(value)
    assert getattr(changed.scalars, scalar) != getattr(base.scalars, scalar)


@pytest.mark.parametrize(
    "update,flag",
    [
        ({"cross_entropy": CrossEntropy()}, "HAS_SMOOTHING"),
        ({"z_loss": None}, "HAS_Z"),
        ({"entropy": None}, "HAS_ENTROPY"),
        ({"entropy": Entropy(weight=0.0)}, "HAS_ENTROPY_GRAD"),
        ({"token_accuracy": False}, "HAS_ARGMAX"),
        ({"transform": LogitTransform(temperature=0.9)}, "HAS_SOFTCAP"),
        ({"reduction": "none"}, "FUSED_GRAD"),
    ],
    ids=["no_smoothing", "no_z", "no_entropy", "entropy_metric_only", "no_accuracy", "no_softcap", "deferred"],
)
def test_structural_changes_select_another_variant(update, flag):
    base = compile_plan(RICH)
    changed = compile_plan(with_(RICH, **update))
    assert getattr(base.flags, flag) is True
    assert getattr(changed.flags, flag) is False


def test_cross_entropy_only_plan_computes_nothing_else():
    plan = compile_plan(LossSpec())
    assert plan.flags == KernelFlags(
        HAS_TARGETS=True, HAS_CE=True, HAS_SMOOTHING=False, HAS_Z=False, HAS_ENTROPY=False,
        HAS_ENTROPY_GRAD=False, HAS_ARGMAX=False, STORE_LOGP=True, HAS_SOFTCAP=False, FUSED_GRAD=True,
        HAS_POLICY=False, HAS_OLD=False, HAS_IW=False, KL_EST=0, KL_IS_CORR=False,
        HAS_TEACHER=False, DISTILL_KIND=0, OWN_TEMP=False,
    )
    assert plan.mode == "fused" and plan.reduction == "mean"
    assert plan.requires == ("logits", "targets")
    assert plan.scalars.inv_temperature == 1.0 and plan.scalars.logit_scale == 1.0


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
    assert plan.flags.FUSED_GRAD is (mode == "fused")
    assert plan.logit_passes == 2


def test_no_grad_plan_has_no_gradient_pass():
    plan = compile_plan(RICH, needs_grad=False)
    assert plan.flags.FUSED_GRAD is False
    assert plan.mode == "fused" and plan.logit_passes == 1
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
    assert flags.HAS_ENTROPY_GRAD is entropy_grad


def test_plan_without_targets():
    spec = LossSpec(cross_entropy=None, entropy=Entropy(weight=0.1), outputs=("predicted_tokens",))
    plan = compile_plan(spec, has_targets=False)
    assert plan.flags.HAS_TARGETS is False and plan.flags.STORE_LOGP is False
    assert plan.flags.HAS_ARGMAX is True
    assert plan.requires == ("logits",)


def test_plan_without_targets_for_a_spec_needing_them_raises_naming_targets():
    with pytest.raises(ValueError, match="targets: required by cross_entropy, token_accuracy"):
        compile_plan(LossSpec(token_accuracy=True), has_targets=False)


def test_smoothing_flag_only_for_positive_smoothing():
    assert compile_plan(LossSpec(cross_entropy=CrossEntropy(label_smoothing=0.0))).flags.HAS_SMOOTHING is False
    assert compile_plan(LossSpec(cross_entropy=CrossEntropy(label_smoothing=1e-6))).flags.HAS_SMOOTHING is True
    assert compile_plan(LossSpec(cross_entropy=CrossEntropy(label_smoothing=1.0))).flags.HAS_SMOOTHING is True


def test_flags_are_the_forward_kernel_constexpr_arguments():
    kwargs = compile_plan(RICH).flags.as_kwargs()
    assert all(isinstance(value, bool) for name, value in kwargs.items() if name not in ("DISTILL_KIND", "KL_EST"))
    assert kwargs["DISTILL_KIND"] in (0, 1, 2) and kwargs["KL_EST"] in (0, 1, 2, 3)
    params = inspect.signature(head_forward_kernel.fn).parameters
    constexprs = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
    assert constexprs == set(kwargs) | {"BLOCK_V"}
