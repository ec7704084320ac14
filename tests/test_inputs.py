"""Bad inputs and bad specs fail early with an error that names the offending argument or field."""

import math

import pytest
import torch
from conftest import make_logits, make_targets, needs_kernel
from pydantic import ValidationError

import headloss.env
from headloss import CrossEntropy, Entropy, LossSpec, ZLoss, head_loss

V = 11


def _logits(shape=(4, V), dtype=torch.float32):
    return make_logits(shape, dtype, seed=1)


def _targets(shape=(4,)):
    return make_targets(shape, V, seed=1)


# --- inputs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "logits,targets,error,match",
    [
        pytest.param(torch.randint(0, 5, (4, V)), _targets(), TypeError, "logits", id="integer_logits"),
        pytest.param(_logits().tolist(), _targets(), TypeError, "logits", id="logits_not_a_tensor"),
        pytest.param(_logits((V,)), torch.tensor(3), ValueError, "logits", id="1d_logits"),
        pytest.param(_logits((2, 2, 2, V)), torch.zeros(2, 2, 2, dtype=torch.long), ValueError, "logits",
                     id="4d_logits"),
        pytest.param(_logits((4, 0)), _targets(), ValueError, "logits", id="empty_vocabulary"),
        pytest.param(_logits((V, 4)).t(), _targets(), ValueError, "logits.*stride", id="non_unit_last_stride"),
        pytest.param(_logits(), _targets((5,)), ValueError, "targets", id="targets_shape_mismatch"),
        pytest.param(_logits((2, 3, V)), _targets((6,)), ValueError, "targets", id="targets_flat_for_3d"),
        pytest.param(_logits(), _targets().float(), TypeError, "targets", id="float_targets"),
        pytest.param(_logits(), _targets().bool(), TypeError, "targets", id="bool_targets"),
        pytest.param(_logits(), [1, 2, 3, 4], TypeError, "targets", id="targets_not_a_tensor"),
        pytest.param(_logits(), torch.zeros(4, dtype=torch.long, device="meta"), ValueError, "targets",
                     id="targets_on_another_device"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(logits, targets, error, match, backend):
    if backend == "triton" and not headloss.env.INTERPRETER:
        pytest.skip("backend='triton' on CPU needs TRITON_INTERPRET=1")
    with pytest.raises(error, match=match):
        head_loss(logits, targets, backend=backend)


@pytest.mark.parametrize("bad", [V, V + 5, -1, -7], ids=["V", "V_plus_5", "minus_1", "minus_7"])
def test_out_of_range_targets_raise_when_validated(bad):
    targets = _targets()
    targets[2] = bad
    with pytest.raises(ValueError, match=rf"targets: value {bad} at position \(2,\)"):
        head_loss(_logits(), targets, validate=True)


def test_ignore_index_is_not_out_of_range():
    targets = _targets()
    targets[1] = -1
    out = head_loss(_logits(), targets, LossSpec(ignore_index=-1), validate=True)
    assert torch.isfinite(out.loss) and int(out.metrics["n_tokens"]) == 3


def test_out_of_range_3d_targets_name_their_position():
    targets = _targets((2, 3))
    targets[1, 2] = V
    with pytest.raises(ValueError, match=r"targets: .*position \(1, 2\)"):
        head_loss(_logits((2, 3, V)), targets, validate=True)


@pytest.mark.parametrize("bad", [V, 10_000, -3], ids=["V", "far_above", "negative"])
@pytest.mark.parametrize(
    "backend,mode",
    [("triton", "fused"), ("triton", "deferred"), ("torch", "mean"), ("torch", "none")],
)
def test_unvalidated_out_of_range_targets_give_nan_loss_not_a_crash(bad, backend, mode):
    if backend == "triton" and not headloss.env.INTERPRETER:
        pytest.skip("backend='triton' on CPU needs TRITON_INTERPRET=1")
    spec = LossSpec(outputs=("logprobs",), reduction="none" if mode in ("deferred", "none") else "mean")
    targets = _targets()
    targets[2] = bad
    logits = _logits().requires_grad_()
    out = head_loss(logits, targets, spec, validate=False, backend=backend)
    assert torch.isnan(out.loss).any()
    assert torch.isnan(out.metrics["ce"])
    assert torch.isnan(out.logprobs[2]) and torch.isfinite(out.logprobs[[0, 1, 3]]).all()
    if spec.reduction == "none":
        assert torch.isfinite(out.loss[[0, 1, 3]]).all()
    out.loss.sum().backward()
    assert logits.grad is not None


@needs_kernel
def test_headloss_validate_env_zero_disables_validation(monkeypatch):
    monkeypatch.setenv("HEADLOSS_VALIDATE", "0")
    targets = _targets()
    targets[0] = V
    out = head_loss(_logits(), targets, backend="triton")
    assert torch.isnan(out.loss)
    monkeypatch.setenv("HEADLOSS_VALIDATE", "1")
    with pytest.raises(ValueError, match="targets"):
        head_loss(_logits(), targets, backend="triton")


@pytest.mark.parametrize(
    "spec,error,match",
    [
        pytest.param(LossSpec(), ValueError, "targets: required by cross_entropy", id="cross_entropy"),
        pytest.param(LossSpec(cross_entropy=None, token_accuracy=True), ValueError,
                     "targets: required by token_accuracy", id="token_accuracy"),
        pytest.param(LossSpec(cross_entropy=None, outputs=("logprobs",)), ValueError,
                     "targets: required by outputs: logprobs", id="logprobs_output"),
    ],
)
def test_spec_needing_targets_without_targets_names_targets(spec, error, match):
    with pytest.raises(error, match=match):
        head_loss(_logits(), None, spec)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_num_items_in_batch_with_non_mean_reduction_raises(reduction):
    with pytest.raises(ValueError, match="num_items_in_batch: only valid with reduction='mean'"):
        head_loss(_logits(), _targets(), LossSpec(reduction=reduction), num_items_in_batch=4)


@pytest.mark.parametrize(
    "value",
    [0, -3, 0.0, -0.5, math.nan, "4", torch.tensor([1, 2])],
    ids=["zero", "negative", "zero_float", "negative_float", "nan", "string", "two_elements"],
)
def test_bad_num_items_in_batch_raises_naming_it(value):
    with pytest.raises(ValueError, match="num_items_in_batch"):
        head_loss(_logits(), _targets(), num_items_in_batch=value)


def test_unknown_backend_raises_naming_backend():
    with pytest.raises(ValueError, match="backend"):
        head_loss(_logits(), _targets(), backend="cuda")


@needs_kernel
def test_triton_backend_rejects_float64_logits():
    with pytest.raises(TypeError, match="logits: the Triton kernel takes"):
        head_loss(_logits(dtype=torch.float64), _targets(), backend="triton")


def test_triton_backend_without_interpreter_on_cpu_raises_naming_backend(monkeypatch):
    monkeypatch.setattr(headloss.env, "INTERPRETER", False)
    with pytest.raises(ValueError, match="backend: 'triton' needs CUDA"):
        head_loss(_logits(), _targets(), backend="triton")


def test_spec_of_a_wrong_type_raises_naming_spec():
    with pytest.raises(TypeError, match="spec"):
        head_loss(_logits(), _targets(), 42)


# --- specs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,field",
    [
        pytest.param({"cross_entropyy": {}}, "cross_entropyy", id="unknown_top_level_field"),
        pytest.param({"cross_entropy": {"wieght": 1.0}}, "wieght", id="unknown_nested_field"),
        pytest.param({"transform": {"soft_cap": 3.0}}, "soft_cap", id="unknown_transform_field"),
        pytest.param({"cross_entropy": {"weight": math.nan}}, "weight", id="nan_ce_weight"),
        pytest.param({"z_loss": {"weight": math.inf}}, "weight", id="inf_z_weight"),
        pytest.param({"entropy": {"weight": -math.inf}}, "weight", id="minus_inf_entropy_weight"),
        pytest.param({"transform": {"temperature": math.nan}}, "temperature", id="nan_temperature"),
        pytest.param({"transform": {"softcap": math.inf}}, "softcap", id="inf_softcap"),
        pytest.param({"cross_entropy": {"label_smoothing": math.nan}}, "label_smoothing", id="nan_smoothing"),
        pytest.param({"cross_entropy": {"label_smoothing": -0.1}}, "label_smoothing", id="negative_smoothing"),
        pytest.param({"cross_entropy": {"label_smoothing": 1.01}}, "label_smoothing", id="smoothing_above_1"),
        pytest.param({"transform": {"temperature": 0.0}}, "temperature", id="zero_temperature"),
        pytest.param({"transform": {"temperature": -1.0}}, "temperature", id="negative_temperature"),
        pytest.param({"transform": {"logit_scale": 0.0}}, "logit_scale", id="zero_logit_scale"),
        pytest.param({"transform": {"softcap": 0.0}}, "softcap", id="zero_softcap"),
        pytest.param({"transform": {"softcap": -5.0}}, "softcap", id="negative_softcap"),
        pytest.param({"cross_entropy": {"weight": -1.0}}, "weight", id="negative_ce_weight"),
        pytest.param({"z_loss": {"weight": -1e-4}}, "weight", id="negative_z_weight"),
        pytest.param({"reduction": "avg"}, "reduction", id="unknown_reduction"),
        pytest.param({"outputs": ["logits"]}, "outputs", id="unknown_output"),
        pytest.param({"outputs": ["lse", "entropy", "lse"]}, "outputs", id="duplicate_outputs"),
        pytest.param({"ignore_index": 1.5}, "ignore_index", id="fractional_ignore_index"),
        pytest.param({"token_accuracy": "sometimes"}, "token_accuracy", id="non_bool_token_accuracy"),
    ],
)
def test_invalid_spec_raises_validation_error_naming_the_field(data, field):
    with pytest.raises(ValidationError, match=field):
        LossSpec.model_validate(data)
    with pytest.raises(ValidationError, match=field):
        head_loss(_logits(), _targets(), data)


def test_duplicate_outputs_error_lists_the_duplicate():
    with pytest.raises(ValidationError, match=r"outputs lists \['lse'\] more than once"):
        LossSpec(outputs=("lse", "logprobs", "lse"))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(cross_entropy=None),
        dict(cross_entropy=None, z_loss=None, entropy=None, token_accuracy=False, outputs=()),
    ],
    ids=["no_cross_entropy", "everything_off"],
)
def test_spec_requesting_nothing_raises(kwargs):
    with pytest.raises(ValidationError, match="nothing requested"):
        LossSpec(**kwargs)


def test_reduction_none_without_terms_raises():
    with pytest.raises(ValidationError, match="reduction: 'none' needs at least one loss term"):
        LossSpec(cross_entropy=None, outputs=("lse",), reduction="none")


@pytest.mark.parametrize(
    "spec",
    [
        LossSpec(cross_entropy=None, outputs=("lse",)),
        LossSpec(cross_entropy=None, token_accuracy=True),
        LossSpec(cross_entropy=CrossEntropy(weight=0.0), z_loss=ZLoss(weight=0.0)),
        LossSpec(cross_entropy=None, entropy=Entropy(weight=0.0), reduction="none"),
    ],
    ids=["output_only", "accuracy_only", "zero_weights", "metric_entropy_reduction_none"],
)
def test_minimal_valid_specs_are_accepted(spec):
    assert LossSpec.model_validate(spec.to_dict()) == spec


def test_spec_file_with_unknown_suffix_raises_naming_path(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text("reduction = 'sum'\n")
    with pytest.raises(ValueError, match="path: unknown spec file type '.toml'"):
        LossSpec.from_file(path)


def test_spec_file_holding_a_list_raises(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("- cross_entropy\n- z_loss\n")
    with pytest.raises(ValueError, match="mapping"):
        LossSpec.from_file(path)


def test_spec_file_with_a_bad_field_raises_naming_the_field(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("# bad\ntransform:\n  temperature: 0\n")
    with pytest.raises(ValidationError, match="temperature"):
        head_loss(_logits(), _targets(), str(path))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_lazily_negated_view_is_read_with_its_sign(backend):
    """torch._neg_view(x) stores x and a negative bit: the kernels read stored values, so head_loss
    resolves the sign first; both backends equal the loss of -x, gradient included."""
    if backend == "triton" and not headloss.env.INTERPRETER:
        pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
    spec = LossSpec(z_loss={"weight": 1e-2}, token_accuracy=True)
    x = torch.randn(5, 13, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 13, (5,), generator=torch.Generator().manual_seed(4))
    plain = (-x).requires_grad_()
    want = head_loss(plain, y, spec, backend=backend)
    want.loss.backward()
    leaf = x.clone().requires_grad_()
    for _ in range(2):  # the second call has the signature of a plain tensor's call
        leaf.grad = None
        got = head_loss(torch._neg_view(leaf), y, spec, backend=backend)
        got.loss.backward()
        assert torch.allclose(got.loss, want.loss, rtol=1e-6)
        assert torch.allclose(got.metrics["token_accuracy"], want.metrics["token_accuracy"])
        assert torch.allclose(leaf.grad, -plain.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_narrow_integer_targets_are_checked_by_their_values(backend):
    """uint8 targets against V = 300: 255 is in range (a check in uint8 would wrap 300 to 44)."""
    logits = make_logits((4, 300), seed=2)
    targets = torch.tensor([255, 1, 200, 44], dtype=torch.uint8)
    out = head_loss(logits, targets, backend=backend)
    want = torch.nn.functional.cross_entropy(logits.double(), targets.long())
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"targets: value 255 at position \(0,\) is outside \[0, 200\)"):
        head_loss(logits[:, :200], targets, backend=backend)


def test_a_group_that_is_not_a_process_group_is_an_error_naming_group():
    import torch.distributed as dist

    from headloss import linear_head_loss

    logits, targets = _logits(), _targets()
    with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
        head_loss(logits, targets, group="tp")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        for call in (lambda: head_loss(logits, targets, group="tp"),
                     lambda: head_loss(logits, targets, group="tp", backend="torch"),
                     lambda: linear_head_loss(torch.randn(4, 3), torch.randn(V, 3), targets, group=7)):
            with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup"):
                call()
        assert head_loss(logits, targets, group=dist.group.WORLD).loss.isfinite()  # a real group works
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_float64_teacher_logits_are_read_as_float32_with_a_lower_precision_student(backend):
    from headloss import linear_head_loss

    spec = LossSpec(distillation={"divergence": "jsd", "temperature": 1.5})
    logits, targets = _logits(), _targets()
    teacher = make_logits((4, V), torch.float64, seed=7)
    got = head_loss(logits, targets, spec, teacher_logits=teacher, backend=backend)
    want = head_loss(logits, targets, spec, teacher_logits=teacher.float(), backend=backend)
    torch.testing.assert_close(got.loss, want.loss)
    hidden, weight = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), torch.randn(V, 3)
    got = linear_head_loss(hidden, weight, targets, spec, teacher_logits=teacher, backend=backend)
    want = linear_head_loss(hidden, weight, targets, spec, teacher_logits=teacher.float(), backend=backend)
    torch.testing.assert_close(got.loss, want.loss)


@pytest.mark.parametrize("chunk_bytes", [0, -4096, 1.5e6, True, "1MB"])
def test_chunk_bytes_must_be_a_positive_integer(chunk_bytes):
    from headloss import linear_head_loss

    with pytest.raises(ValueError, match="chunk_bytes: expected a positive number of bytes"):
        linear_head_loss(torch.randn(4, 3), torch.randn(V, 3), _targets(), chunk_bytes=chunk_bytes)
