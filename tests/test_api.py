"""The kernel boundary's promises, on both paths: the DFT term, trainer-shaped calls (shift), a
loss of its own, num_items_in_batch checks, device-side validation, and the same behaviour on the
Triton path (under the interpreter) and the plain-torch reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    assert_close_norm,
    assert_matches_reference,
    assert_nontrivial,
    make_logits,
    make_targets,
    needs_kernel,
    run_pair,
    seed_of,
)

import headloss
from headloss import DFT, LossSpec, head_loss, linear_head_loss
from headloss.policy.logprobs import policy_loss
from headloss.reference import reference_head_loss

BACKENDS = ["torch", pytest.param("triton", marks=needs_kernel)]
V = 37


# --- DFT ------------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "spec",
    [
        LossSpec(cross_entropy=None, dft=DFT()),
        LossSpec(cross_entropy={"weight": 0.5, "label_smoothing": 0.1}, dft=DFT(weight=0.7), z_loss={"weight": 1e-3},
                 transform={"softcap": 5.0, "temperature": 0.7}, outputs=("token_loss",)),
        LossSpec(cross_entropy=None, dft=DFT(weight=2.0), reduction="none"),
        LossSpec(cross_entropy=None, dft=DFT(), outputs=("logprobs",), differentiable_outputs=True),
    ],
    ids=["alone", "with_ce_z_softcap", "reduction_none", "deferred"],
)
def test_dft_kernel_matches_the_fp64_reference(spec, dtype):
    seed = seed_of("dft", spec.model_dump_json(), dtype)
    logits = make_logits((3, 5, 130), dtype, seed=seed)
    targets = make_targets((3, 5), 130, seed=seed, ignore_frac=0.2)
    pair = run_pair(logits, targets, spec)
    assert_matches_reference(pair)
    assert_nontrivial(pair)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dft_value_and_gradient_equal_the_hand_computed_ones(backend):
    """loss = -p_y log p_y (p_y held constant), d/dx_i = p_y (p_i - [i = y])."""
    logits = make_logits((1, 4), torch.float64 if backend == "torch" else torch.float32, seed=3).requires_grad_()
    targets = torch.tensor([2])
    out = head_loss(logits, targets, LossSpec(cross_entropy=None, dft=DFT()), backend=backend)
    out.loss.backward()
    p = torch.softmax(logits.detach().double(), -1)[0]
    p_y = p[2]
    assert float(out.loss.detach()) == pytest.approx(float(-p_y * torch.log(p_y)), rel=1e-6)
    assert float(out.metrics["dft"]) == pytest.approx(float(-p_y * torch.log(p_y)), rel=1e-6)
    want = p_y * (p - torch.nn.functional.one_hot(torch.tensor(2), 4).double())
    assert torch.allclose(logits.grad[0].double(), want, atol=1e-6)


# --- trainer shapes (shift) --------------------------------------------------------------------------


def _shift_case(convention: str, dtype=torch.float32, seed=0):
    """full logits [B, T, V] and either HF labels [B, T] or completion ids [B, T - 1]."""
    batch, seq = 3, 6
    logits = make_logits((batch, seq, V), dtype, seed=seed)
    width = seq if convention == "labels" else seq - 1
    targets = make_targets((batch, width), V, seed=seed, ignore_frac=0.2)
    return logits, targets


def _sliced(logits: torch.Tensor, targets: torch.Tensor, convention: str):
    """What a trainer does without shift: slice the logits (and the labels)."""
    if convention == "labels":
        return logits[:, :-1], targets[:, 1:]
    return logits[:, :-1], targets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("convention", ["labels", "completion_ids"])
@pytest.mark.parametrize(
    "spec",
    [LossSpec(z_loss={"weight": 1e-3}, token_accuracy=True, outputs=("predicted_tokens", "logprobs", "entropy")),
     LossSpec(reduction="none", outputs=("logprobs",), differentiable_outputs=True)],
    ids=["fused", "deferred"],
)
def test_shift_equals_slicing_the_logits_and_writes_a_full_size_gradient(spec, convention, backend):
    logits, targets = _shift_case(convention, seed=seed_of("shift", convention, backend, spec.reduction))
    a = logits.clone().requires_grad_()
    out = head_loss(a, targets, spec, shift=True, backend=backend)
    b = logits.clone().requires_grad_()
    view, sliced_targets = _sliced(b, targets, convention)
    ref = head_loss(view, sliced_targets, spec, backend=backend)
    weights = torch.rand(out.loss.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    (out.loss * weights[..., : out.loss.shape[-1]] if spec.reduction == "none" else out.loss).sum().backward()
    if spec.reduction == "none":
        ref_loss = ref.loss if convention == "completion_ids" else torch.nn.functional.pad(ref.loss, (0, 1))
        (ref_loss * weights[..., : ref_loss.shape[-1]]).sum().backward()
    else:
        ref.loss.backward()
    assert a.grad.shape == logits.shape and a.grad.is_contiguous()
    assert torch.all(a.grad[:, -1] == 0), "the last row of each sequence is not scored"
    assert_close_norm(a.grad, b.grad, rtol=1e-6, atol=1e-8, name="grad")
    assert out.logprobs.shape == targets.shape
    if convention == "labels":  # entry t belongs to logits row t, which predicts labels[:, t + 1]
        assert_close_norm(out.logprobs[:, :-1], ref.logprobs, rtol=1e-6, atol=1e-7, name="logprobs")
        assert torch.all(out.logprobs[:, -1] == 0)
    else:
        assert_close_norm(out.logprobs, ref.logprobs, rtol=1e-6, atol=1e-7, name="logprobs")
    if spec.reduction != "none":
        assert float(out.loss.detach()) == pytest.approx(float(ref.loss.detach()), rel=1e-6)
        assert int(out.metrics["n_tokens"]) == int(ref.metrics["n_tokens"])


@needs_kernel
def test_shift_reads_the_logits_in_place_for_a_policy_term():
    """TRL's call shape: logits [B, K + 1, V] against completion ids [B, K] with the GRPO inputs."""
    spec = LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": 0.04, "eps_high": 0.28})
    logits, ids = _shift_case("completion_ids", seed=7)
    ids = ids.clamp(min=0)
    gen = torch.Generator().manual_seed(7)
    inputs = dict(advantages=torch.randn(3, generator=gen), old_logprobs=-torch.rand(3, 5, generator=gen) - 3,
                  ref_logprobs=-torch.rand(3, 5, generator=gen) - 3,
                  loss_mask=(torch.rand(3, 5, generator=gen) > 0.2).long())
    a = logits.clone().requires_grad_()
    out = head_loss(a, ids, spec, shift=True, backend="triton", **inputs)
    out.loss.backward()
    r = logits.double().requires_grad_()
    ref = reference_head_loss(r[:, :-1], ids, spec, **{k: v.double() if v.is_floating_point() else v
                                                       for k, v in inputs.items()})
    ref.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(float(ref.loss.detach()), rel=1e-5, abs=1e-6)
    assert_close_norm(a.grad, r.grad, rtol=1e-5, atol=1e-8, name="grad")
    for name in ("clip_ratio/high_mean", "kl", "entropy", "ratio/mean"):
        assert float(out.metrics[name]) == pytest.approx(float(ref.metrics[name]), rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_shift_errors_name_the_argument(backend):
    logits, labels = _shift_case("labels")
    with pytest.raises(ValueError, match="targets: shape .* fits neither shift convention"):
        head_loss(logits, labels[:, :-2], shift=True, backend=backend)
    with pytest.raises(ValueError, match="shift: needs logits"):
        head_loss(logits.reshape(-1, V), labels.reshape(-1), shift=True, backend=backend)
    with pytest.raises(ValueError, match="targets: shift=True needs targets"):
        head_loss(logits, None, LossSpec(cross_entropy=None, entropy={}), shift=True, backend=backend)


@needs_kernel
@pytest.mark.parametrize("convention", ["labels", "completion_ids"])
def test_linear_head_takes_both_shift_conventions(convention):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 6, 8, generator=gen).requires_grad_()
    weight = torch.randn(V, 8, generator=gen).requires_grad_()
    width = 6 if convention == "labels" else 5
    targets = make_targets((2, width), V, seed=5, ignore_frac=0.2)
    spec = LossSpec(outputs=("logprobs",))
    out = linear_head_loss(hidden, weight, targets, spec, shift=True, backend="triton")
    logits = torch.nn.functional.linear(hidden, weight)
    ref = head_loss(logits, targets, spec, shift=True, backend="torch")
    assert float(out.loss.detach()) == pytest.approx(float(ref.loss.detach()), rel=1e-5)
    assert out.logprobs.shape == targets.shape
    assert_close_norm(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-6, name="logprobs")


# --- the loss is a tensor of its own --------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize(
    "spec", [LossSpec(), LossSpec(reduction="none"), LossSpec(outputs=("logprobs",), differentiable_outputs=True)],
    ids=["fused", "none", "deferred"],
)
def test_in_place_scaling_of_the_loss_works_and_scales_the_gradient(spec, entry, backend):
    """HF Trainer does ``loss *= scale`` and ``loss /= n``: the returned loss is never a view."""
    gen = torch.Generator().manual_seed(9)
    logits = make_logits((4, V), seed=9)
    hidden, weight = torch.randn(4, 8, generator=gen), torch.randn(V, 8, generator=gen)
    targets = make_targets((4,), V, seed=9)
    grads = []
    for scale in (1.0, 3.0):
        leaf = (logits if entry == "logits" else hidden).clone().requires_grad_()
        out = (head_loss(leaf, targets, spec, backend=backend) if entry == "logits"
               else linear_head_loss(leaf, weight, targets, spec, backend=backend))
        loss = out.loss
        assert loss._base is None, "the loss is a view"
        before = float(out.metrics["loss"])
        loss *= scale
        loss /= 2.0
        assert float(out.metrics["loss"]) == before, "the 'loss' metric shares the loss's storage"
        loss.sum().backward()
        grads.append(leaf.grad)
    assert_close_norm(grads[1], 3.0 * grads[0], rtol=1e-5, atol=1e-8, name="grad of 3x the loss")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_packed_metrics_hold_every_metric_in_order_exactly_and_detached(entry, backend):
    """out.packed_metrics(): one float64 tensor of every metric in the dict's order (what a graphed or
    compiled step returns instead of one output per metric), equal to each metric exactly -- n_tokens
    too, past fp32's integers -- and detached even where the outputs are differentiable."""
    gen = torch.Generator().manual_seed(41)
    spec = LossSpec(z_loss={"weight": 1e-3}, entropy={"weight": 0.1}, token_accuracy=True,
                    outputs=("logprobs",), differentiable_outputs=True)
    targets = make_targets((3, 5), V, seed=41)
    leaf = (make_logits((3, 5, V), seed=41) if entry == "logits" else torch.randn(3, 5, 8, generator=gen))
    leaf.requires_grad_()
    out = (head_loss(leaf, targets, spec, backend=backend) if entry == "logits"
           else linear_head_loss(leaf, torch.randn(V, 8, generator=gen), targets, spec, backend=backend))
    packed = out.packed_metrics()
    assert packed.dtype == torch.float64 and packed.shape == (len(out.metrics),) and not packed.requires_grad
    assert len(out.metrics) >= 6  # loss, n_tokens, ce, z_loss, entropy, token_accuracy
    for value, (name, metric) in zip(packed.tolist(), out.metrics.items()):
        assert value == float(metric), name
    assert out.metrics_as_floats() == dict(zip(out.metrics, packed.tolist()))
    out.metrics["grad_norm"] = leaf.square().sum()  # a metric a caller adds, still in the graph
    assert out.metrics["grad_norm"].requires_grad and not out.packed_metrics().requires_grad
    big = head_loss(make_logits((1, V), seed=42), make_targets((1,), V, seed=42), LossSpec(), backend=backend)
    big.metrics["n_tokens"] = torch.tensor(2**24 + 1)  # a count fp32 would round
    assert big.packed_metrics()[list(big.metrics).index("n_tokens")].item() == 2**24 + 1


# --- num_items_in_batch -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "value",
    [0, -3, 0.0, float("inf"), float("-inf"), float("nan"), torch.tensor(0), torch.tensor(-2.0),
     torch.tensor(float("inf")), torch.tensor(float("nan")), torch.tensor([float("-inf")])],
    ids=["0", "-3", "0.0", "inf", "-inf", "nan", "t0", "t-2", "tinf", "tnan", "t[-inf]"],
)
def test_num_items_that_is_not_a_positive_finite_number_is_an_error(value, backend):
    with pytest.raises(ValueError, match="num_items_in_batch: expected a positive"):
        head_loss(make_logits((4, V)), make_targets((4,), V), num_items_in_batch=value, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "value", [8, 8.0, np.int64(8), np.float32(8.0), torch.tensor(8), torch.tensor([8.0]), torch.tensor([[8]])],
    ids=["int", "float", "np.int64", "np.float32", "t()", "t[1]", "t[1,1]"],
)
def test_num_items_as_any_one_number_gives_a_scalar_loss(value, backend):
    logits, targets = make_logits((4, V), seed=2), make_targets((4,), V, seed=2)
    out = head_loss(logits, targets, num_items_in_batch=value, backend=backend)
    ref = head_loss(logits, targets, LossSpec(reduction="sum"), backend=backend)
    assert out.loss.shape == ()
    assert float(out.loss.detach()) == pytest.approx(float(ref.loss.detach()) / 8.0, rel=1e-6)


@pytest.mark.parametrize("value", [torch.ones(2), True, "8", [8]], ids=["two_elements", "bool", "str", "list"])
def test_num_items_of_the_wrong_kind_is_an_error_naming_it(value):
    with pytest.raises((ValueError, TypeError), match="num_items_in_batch"):
        head_loss(make_logits((4, V)), make_targets((4,), V), num_items_in_batch=value)


# --- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("validate", [True, "sync"])
def test_out_of_range_target_is_raised_in_the_call_on_cpu(backend, validate):
    targets = make_targets((2, 3), V)
    targets[1, 2] = V + 4
    with pytest.raises(ValueError, match=rf"targets: value {V + 4} at position \(1, 2\) is outside \[0, {V}\)"):
        head_loss(make_logits((2, 3, V)), targets, validate=validate, backend=backend)


@needs_kernel
def test_unvalidated_out_of_range_target_gives_nan_in_its_row_only():
    targets = make_targets((4,), V)
    targets[1] = -5
    logits = make_logits((4, V)).requires_grad_()
    out = head_loss(logits, targets, LossSpec(reduction="none"), validate=False, backend="triton")
    assert torch.isnan(out.loss[1]) and torch.isfinite(out.loss[[0, 2, 3]]).all()


def test_validate_rejects_other_values_naming_it():
    with pytest.raises(ValueError, match="validate: expected True, False or 'sync'"):
        head_loss(make_logits((4, V)), make_targets((4,), V), validate="always")


def test_check_pending_raises_an_error_written_by_an_earlier_call():
    """The asynchronous path (as on CUDA): a verdict written to the board is raised by the next check."""
    from headloss.layouts import TEACHER_KEY, TEACHER_MARK, VERDICT
    from headloss.validation import CheckContext, board_for

    board = board_for(torch.device("cpu"))
    slot, dirty = board.take(CheckContext((2, 3), V, -100))
    slot[VERDICT.where], slot[VERDICT.value] = 4, 99
    slot[0] = 1
    dirty[0] = 1
    with pytest.raises(ValueError, match=r"targets: value 99 at position \(1, 1\) .* after that call returned"):
        headloss.check_pending()
    headloss.check_pending()  # raised once, then cleared
    # a sparse teacher's verdict (kernels.sparse.check_teacher_kernel's): its own error, whatever the target fields
    slot, dirty = board.take(CheckContext((2, 3), V, -100, teacher_k=3))
    slot[VERDICT.teacher] = TEACHER_MARK - (TEACHER_KEY.N * 7 + TEACHER_KEY.logprob)  # entry 7 (row 2, entry 1)
    slot[0] = dirty[0] = 1
    with pytest.raises(ValueError, match=r"teacher_logprobs: the value at row 2, entry 1 is not a log-probability"):
        headloss.check_pending()
    headloss.check_pending()


# --- the same promises on both paths -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_backward_through_a_fused_loss_raises_on_both_paths(backend):
    logits = make_logits((4, V)).requires_grad_()
    out = head_loss(logits, make_targets((4,), V), backend=backend)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same fused-mode loss"):
        out.loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_backward_through_a_deferred_loss_accumulates_on_both_paths(backend):
    logits = make_logits((4, V)).requires_grad_()
    out = head_loss(logits, make_targets((4,), V), LossSpec(reduction="none"), backend=backend)
    out.loss.sum().backward(retain_graph=True)
    once = logits.grad.clone()
    out.loss.sum().backward()
    assert_close_norm(logits.grad, 2 * once, rtol=1e-6, atol=0, name="grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logits_in_an_ignored_row_give_zero_gradient_there(backend):
    logits = make_logits((4, V))
    logits[2] = float("nan")
    targets = make_targets((4,), V)
    targets[2] = -100
    leaf = logits.requires_grad_()
    out = head_loss(leaf, targets, backend=backend)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.all(leaf.grad[2] == 0) and torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inf_logits_with_label_smoothing_give_an_infinite_loss_like_torch(backend):
    logits = make_logits((3, V))
    logits[1, 5] = float("-inf")
    targets = make_targets((3,), V)
    targets[1] = 4
    out = head_loss(logits, targets, LossSpec(cross_entropy={"label_smoothing": 0.1}), backend=backend)
    want = torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1)
    assert math.isinf(float(want)) and math.isinf(float(out.loss.detach()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_hidden_states_in_an_ignored_row_reach_no_gradient(backend):
    gen = torch.Generator().manual_seed(12)
    hidden = torch.randn(5, 8, generator=gen)
    hidden[3] = float("nan")
    weight = torch.randn(V, 8, generator=gen).requires_grad_()
    targets = make_targets((5,), V, seed=12)
    targets[3] = -100
    leaf = hidden.requires_grad_()
    out = linear_head_loss(leaf, weight, targets, backend=backend)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.all(leaf.grad[3] == 0) and torch.isfinite(leaf.grad).all() and torch.isfinite(weight.grad).all()


def _distill_pair(backend, teacher, student, spec):
    student = student.clone().requires_grad_()
    out = head_loss(student, make_targets(student.shape[:-1], V, seed=13), spec, teacher_logits=teacher,
                    backend=backend)
    out.loss.backward()
    return out, student.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_nan_teacher_logits_give_nan_not_a_dropped_divergence(divergence, backend):
    spec = LossSpec(cross_entropy={"weight": 0.5}, distillation={"divergence": divergence})
    teacher = make_logits((3, V), seed=14)
    teacher[1, 4] = float("nan")
    out, grad = _distill_pair(backend, teacher, make_logits((3, V), seed=15), spec)
    assert math.isnan(float(out.loss.detach())) and math.isnan(float(out.metrics["distill/divergence"]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_masked_vocabulary_columns_give_finite_values_on_both_paths(divergence, backend):
    """-inf in the same columns of teacher and student (a masked vocabulary): every value finite."""
    spec = LossSpec(distillation={"divergence": divergence}, entropy={"weight": 0.0})
    teacher, student = make_logits((3, V), seed=16), make_logits((3, V), seed=17)
    teacher[:, -5:] = float("-inf")
    student[:, -5:] = float("-inf")
    out, grad = _distill_pair(backend, teacher, student, spec)
    for name, value in out.metrics.items():
        assert math.isfinite(float(value)), name
    assert torch.isfinite(grad).all() and torch.all(grad[:, -5:] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_inputs_at_masked_positions_never_reach_the_loss(backend):
    spec = LossSpec(cross_entropy=None, policy={"loss_type": "grpo", "kl_beta": 0.04})
    logits, ids = make_logits((2, 4, V), seed=18), make_targets((2, 4), V, seed=18)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]])
    gen = torch.Generator().manual_seed(18)
    clean = dict(advantages=torch.randn(2, 4, generator=gen), old_logprobs=-torch.rand(2, 4, generator=gen) - 3,
                 ref_logprobs=-torch.rand(2, 4, generator=gen) - 3, importance_weights=torch.rand(2, 4, generator=gen))
    dirty = {k: torch.where(mask.bool(), v, float("nan") if k != "ref_logprobs" else float("-inf"))
             for k, v in clean.items()}
    results = []
    for inputs in (clean, dirty):
        leaf = logits.clone().requires_grad_()
        out = head_loss(leaf, ids, spec, loss_mask=mask, backend=backend, **inputs)
        out.loss.backward()
        results.append((float(out.loss.detach()), leaf.grad, {k: float(v) for k, v in out.metrics.items()}))
    assert math.isfinite(results[1][0]) and results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, V), (0, 4, V), (2, 0, V)], ids=["no_rows", "no_sequences", "empty_sequences"])
def test_policy_on_zero_rows_gives_loss_zero(shape, backend):
    spec = LossSpec(cross_entropy=None, policy={"loss_type": "dapo"})
    logits = torch.zeros(shape).requires_grad_()
    ids = torch.zeros(shape[:-1], dtype=torch.long)
    inputs = {"advantages": torch.zeros(shape[:-1])}
    if len(shape) == 2:
        inputs["sequence_ids"] = torch.zeros(0, dtype=torch.long)
    out = head_loss(logits, ids, spec, backend=backend, **inputs)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and logits.grad.shape == logits.shape
    assert float(out.metrics["ratio/mean"]) == 1.0 and int(out.metrics["n_tokens"]) == 0


# --- the interpreter's numpy warnings ------------------------------------------------------------


@needs_kernel
def test_interpreter_warnings_are_ignored_inside_the_call_and_the_callers_filters_kept():
    """Under TRITON_INTERPRET=1 numpy warns on values a kernel computes and discards (a GSPO call's
    deferred objective does): headloss ignores them around its launches, and only there."""
    import warnings

    gen = torch.Generator().manual_seed(19)
    logits = torch.randn(2, 4, 11, generator=gen).requires_grad_()
    ids = torch.randint(0, 11, (2, 4), generator=gen)
    spec = LossSpec(cross_entropy=None, policy={"importance_sampling": "sequence"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("error", "the caller's own filter")
        before = list(warnings.filters)
        out = head_loss(logits, ids, spec, backend="triton", advantages=torch.randn(2, generator=gen),
                        old_logprobs=-torch.rand(2, 4, generator=gen) - 2)
        out.loss.backward()
        after = list(warnings.filters)
        np.float64(0.0) / np.float64(0.0)  # the caller's own numpy warning still reaches it
    assert out.route == "deferred+kernels"
    assert [str(w.message) for w in caught if "triton" in w.filename] == []
    assert after == before
    assert [w.category for w in caught] == [RuntimeWarning]


# --- the door's keywords -------------------------------------------------------------------------------


def _entry_calls():
    logits, hidden, weight = torch.randn(3, 11), torch.randn(3, 5), torch.randn(11, 5)
    targets = torch.randint(0, 11, (3,))
    logp = torch.randn(1, 3)
    return {
        "head_loss": lambda **kw: head_loss(logits, targets, **kw),
        "linear_head_loss": lambda **kw: linear_head_loss(hidden, weight, targets, **kw),
        "HeadLoss": lambda **kw: headloss.HeadLoss()(logits, targets, **kw),
        "LinearHeadLoss": lambda **kw: headloss.LinearHeadLoss()(hidden, weight, targets, **kw),
        "policy_loss": lambda **kw: policy_loss(logp, headloss.Policy(), advantages=torch.randn(1), **kw),
    }


@pytest.mark.parametrize("entry", ["head_loss", "linear_head_loss", "HeadLoss", "LinearHeadLoss", "policy_loss"])
def test_an_unknown_keyword_is_a_type_error_naming_it(entry):
    call = _entry_calls()[entry]
    caller = {"HeadLoss": "head_loss", "LinearHeadLoss": "linear_head_loss"}.get(entry, entry)
    with pytest.raises(TypeError, match=rf"{caller}\(\) got an unexpected keyword argument 'advantage'"):
        call(advantage=torch.randn(3))
    if entry in ("head_loss", "HeadLoss"):  # the lm_head's own keywords are not head_loss's
        with pytest.raises(TypeError, match="unexpected keyword argument 'teacher_hidden'"):
            call(teacher_hidden=torch.randn(3, 5))


def test_policy_loss_without_advantages_names_them():
    with pytest.raises(TypeError, match="missing required keyword argument: 'advantages'"):
        policy_loss(torch.randn(1, 3), headloss.Policy(), loss_mask=torch.ones(1, 3))


def test_the_module_forms_take_the_same_keywords_and_give_the_same_values():
    torch.manual_seed(3)
    logits, targets = torch.randn(2, 4, 37), torch.randint(0, 37, (2, 4))
    spec = LossSpec(cross_entropy=None, policy={"loss_type": "dapo"}, entropy={"weight": 0.0})
    inputs = dict(advantages=torch.randn(2), old_logprobs=-torch.rand(2, 4), loss_mask=torch.ones(2, 4), shift=False)
    want = head_loss(logits, targets, spec, backend="torch", **inputs)
    got = headloss.HeadLoss(spec, backend="torch")(logits, targets, **inputs)
    torch.testing.assert_close(got.loss, want.loss)
    assert list(got.metrics) == list(want.metrics)
    hidden, weight = torch.randn(2, 4, 6), torch.randn(37, 6)
    want = linear_head_loss(hidden, weight, targets, spec, backend="torch", **inputs)
    got = headloss.LinearHeadLoss(spec, backend="torch")(hidden, weight, targets, **inputs)
    torch.testing.assert_close(got.loss, want.loss)


def test_every_keyword_of_the_door_is_documented():
    from headloss.batch import HeadInputs, LinearInputs, PolicyInputs

    head_doc = head_loss.__doc__
    for name in HeadInputs.__annotations__:
        assert name in head_doc, name
    for name in set(LinearInputs.__annotations__) - set(HeadInputs.__annotations__):
        assert name in linear_head_loss.__doc__, name
    assert set(PolicyInputs.__annotations__) <= set(HeadInputs.__annotations__)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_the_output_is_a_pytree_node_whose_leaves_hold_its_tensors(entry, backend):
    """torch.utils._pytree finds the loss inside a HeadLossOutput (what FSDP2's backward hooks, DDP and
    activation checkpointing look through), the lazily made output too, and builds it back."""
    import torch.utils._pytree as pytree

    torch.manual_seed(5)
    spec = LossSpec(z_loss={"weight": 1e-3}, entropy={"weight": 0.0}, outputs=("logprobs", "predicted_tokens"))
    targets = torch.randint(0, 37, (6,))
    if entry == "logits":
        leaf = torch.randn(6, 37, requires_grad=True)
        out = head_loss(leaf, targets, spec, backend=backend)
    else:
        leaf, weight = torch.randn(6, 8, requires_grad=True), torch.randn(37, 8)
        out = linear_head_loss(leaf, weight, targets, spec, backend=backend)
    leaves, tree = pytree.tree_flatten(out)
    assert leaves[0] is out.loss and any(t is out.logprobs for t in leaves)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    assert len(tensors) == 1 + len(out.metrics) + 2  # the loss, every metric, two per-token outputs
    again = pytree.tree_unflatten(leaves, tree)
    assert type(again) is headloss.HeadLossOutput and again.route == out.route
    assert list(again.metrics) == list(out.metrics) and again.logprobs is out.logprobs
    doubled = pytree.tree_map(lambda t: 2 * t if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)
    doubled.loss.backward()
    out2 = head_loss(leaf, targets, spec, backend=backend) if entry == "logits" else \
        linear_head_loss(leaf, weight, targets, spec, backend=backend)
    grad, leaf.grad = leaf.grad, None
    (2 * out2.loss).backward()
    torch.testing.assert_close(grad, leaf.grad)
