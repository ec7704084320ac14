"""The Triton kernel (backend="triton", under TRITON_INTERPRET=1 on CPU) against the fp64 reference.

Every comparison runs the reference on the kernel's input values upcast to float64, and checks
the loss, every metric, every per-token output and the gradient w.r.t. the logits.
"""

from pathlib import Path

import pytest
import torch
from conftest import (
    ALL_OUTPUTS,
    DIFFERENTIABLE_EVERYTHING,
    DTYPE_IDS,
    DTYPES,
    assert_close_norm,
    assert_matches_reference,
    assert_nontrivial,
    make_logits,
    make_targets,
    needs_kernel,
    row_inputs,
    run_pair,
    seed_of,
    teacher_inputs,
    with_,
)
from hypothesis import given
from strategies import CI, cases

import headloss.env
from headloss import (
    CrossEntropy,
    Entropy,
    HeadLoss,
    LogitTransform,
    LossSpec,
    ZLoss,
    head_loss,
)
from headloss.kernels.launch import LAUNCH_OVERRIDES, LaunchConfig, launch_config
from headloss.reference import reference_head_loss

pytestmark = needs_kernel

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# name -> (spec, logits shape, fraction of ignored targets)
SPEC_CASES = {
    "plain_ce": (LossSpec(), (7, 37), 0.0),
    "ce_label_smoothing_with_ignored_rows": (
        LossSpec(cross_entropy=CrossEntropy(label_smoothing=0.1), outputs=("logprobs",)),
        (9, 300),
        0.3,
    ),
    "softcap_temperature_logit_scale": (
        LossSpec(
            cross_entropy=CrossEntropy(weight=0.8, label_smoothing=0.05),
            z_loss=ZLoss(weight=1e-2),
            transform=LogitTransform(logit_scale=1.7, softcap=4.0, temperature=0.6),
            outputs=("lse", "logprobs", "predicted_tokens"),
        ),
        (5, 130),
        0.2,
    ),
    "temperature_only": (
        LossSpec(transform=LogitTransform(temperature=2.5), outputs=("lse",)),
        (4, 1000),
        0.0,
    ),
    "z_loss_entropy_regulariser_accuracy_all_outputs": (
        LossSpec(
            z_loss=ZLoss(weight=0.05),
            entropy=Entropy(weight=0.2),
            token_accuracy=True,
            outputs=ALL_OUTPUTS,
        ),
        (6, 257),
        0.25,
    ),
    "entropy_bonus_negative_weight": (
        LossSpec(entropy=Entropy(weight=-0.3), outputs=("entropy",)),
        (5, 61),
        0.2,
    ),
    "entropy_as_metric_only": (
        LossSpec(entropy=Entropy(weight=0.0), outputs=("entropy", "token_loss")),
        (5, 77),
        0.2,
    ),
    "sum_reduction": (
        LossSpec(z_loss=ZLoss(weight=1e-3), reduction="sum", outputs=("token_loss",)),
        (6, 45),
        0.3,
    ),
    "none_reduction_3d": (
        LossSpec(
            cross_entropy=CrossEntropy(label_smoothing=0.2),
            entropy=Entropy(weight=0.1),
            reduction="none",
            outputs=("token_loss", "entropy"),
        ),
        (3, 4, 53),
        0.25,
    ),
    "differentiable_outputs_3d": (
        DIFFERENTIABLE_EVERYTHING,
        (2, 5, 41),
        0.3,
    ),
    "ignore_index_minus_one": (
        LossSpec(ignore_index=-1, token_accuracy=True, outputs=("predicted_tokens", "logprobs")),
        (8, 33),
        0.4,
    ),
    "ignore_index_zero_is_a_real_class_id": (
        LossSpec(ignore_index=0, z_loss=ZLoss(weight=1e-2), outputs=("lse",)),
        (8, 5),
        0.0,
    ),
    "no_cross_entropy_z_and_entropy": (
        LossSpec(cross_entropy=None, z_loss=ZLoss(weight=0.5), entropy=Entropy(weight=1.0)),
        (5, 90),
        0.2,
    ),
}

# a spec exercising every statistic, in each mode
RICH_FUSED = LossSpec(
    cross_entropy=CrossEntropy(label_smoothing=0.1),
    z_loss=ZLoss(weight=1e-2),
    entropy=Entropy(weight=0.1),
    token_accuracy=True,
    outputs=ALL_OUTPUTS,
)
RICH_DEFERRED = with_(RICH_FUSED, differentiable_outputs=True)
MODES = {"fused": RICH_FUSED, "deferred": RICH_DEFERRED}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_kernel_matches_fp64_reference(case, dtype):
    spec, shape, ignore_frac = SPEC_CASES[case]
    seed = seed_of(case, dtype)
    logits = make_logits(shape, dtype, seed=seed)
    targets = make_targets(shape[:-1], shape[-1], seed, ignore_frac, spec.ignore_index)
    pair = run_pair(logits, targets, spec)
    assert_matches_reference(pair)
    assert_nontrivial(pair)


# name -> (base shape, view of the base that is passed to head_loss)
SHAPE_CASES = {
    "vocab_1": ((6, 1), lambda t: t),
    "single_row": ((1, 1000), lambda t: t),
    "vocab_above_one_block": ((2, 4099), lambda t: t),
    "vocab_exactly_one_default_block": ((2, 2048), lambda t: t),
    "logits_3d": ((2, 3, 67), lambda t: t),
    "strided_3d_view_drop_last_position": ((2, 6, 45), lambda t: t[:, :-1, :]),
    "transposed_3d_view": ((4, 3, 29), lambda t: t.transpose(0, 1)),
    "column_slice_2d": ((5, 50), lambda t: t[:, 3:40]),
    # a launch of < 1024 rows with V >= 16384 takes the 4096 x 8 config (the lm_head's chunks)
    "few_rows_large_vocab_4096x8_config": ((2, 16411), lambda t: t),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(SHAPE_CASES))
def test_kernel_matches_reference_on_odd_shapes_and_strides(case, mode):
    base_shape, view = SHAPE_CASES[case]
    spec = MODES[mode]
    seed = seed_of(case, mode)
    base = make_logits(base_shape, torch.float32, seed=seed)
    viewed = view(base)
    targets = make_targets(viewed.shape[:-1], viewed.shape[-1], seed, 0.2)
    pair = run_pair(base, targets, spec, view=view)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    if viewed.data_ptr() == base.data_ptr() and viewed.numel() < base.numel():
        outside = torch.ones(base_shape, dtype=torch.bool)
        view(outside).fill_(False)
        assert torch.all(pair.grad[outside] == 0), "gradient written outside the view"


def test_launch_config_by_vocab_rows_and_teacher():
    assert launch_config(128256) == LaunchConfig(2048, 4)  # tuned at N = 8192
    assert launch_config(128256, rows=8192) == LaunchConfig(2048, 4)
    assert launch_config(128256, rows=512) == LaunchConfig(4096, 8)  # few programs: wider ones
    assert launch_config(128256, teacher=True, rows=512) == LaunchConfig(2048, 4)
    assert launch_config(128256, teacher=True, rows=8192) == LaunchConfig(1024, 4)
    assert launch_config(16411, rows=2) == LaunchConfig(4096, 8)
    assert launch_config(8000, rows=2) == LaunchConfig(2048, 4)
    assert launch_config(37, rows=2) == LaunchConfig(64, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_strided_view_matches_reference(dtype):
    base = make_logits((3, 5, 70), dtype, seed=11)
    targets = make_targets((3, 4), 70, 11, 0.25)
    pair = run_pair(base, targets, RICH_FUSED, view=lambda t: t[:, 1:, :])
    assert_matches_reference(pair)
    assert_nontrivial(pair)


@pytest.mark.parametrize(
    "vocab", [37, 48, 16, 5], ids=["full_blocks_and_tail", "full_blocks_only", "one_full_block", "tail_only"]
)
@pytest.mark.parametrize("mode", list(MODES))
def test_small_blocks_give_same_results_across_block_boundaries(mode, vocab, monkeypatch):
    monkeypatch.setitem(LAUNCH_OVERRIDES, "block_v", 16)  # (HEADLOSS_BLOCK_V is read at import)
    logits = make_logits((6, vocab), torch.float32, seed=seed_of("blocks", vocab))
    top = logits.abs().max() + 1.0
    logits[0, vocab - 1] = top  # max in the last column
    logits[1, 1] = logits[1, vocab - 1] = top  # tie across the first and last block: first index
    logits[2, vocab // 2] = logits[2, vocab - 2] = top  # tie further in: first index
    logits[3, 0] = top  # max in the first column
    targets = make_targets((6,), vocab, 21, 0.3)
    targets[:4] = torch.tensor([vocab - 1, 0, vocab // 2, 1]) % vocab  # planted rows are not ignored
    pair = run_pair(logits, targets, MODES[mode])
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    assert pair.out.predicted_tokens[:4].tolist() == [vocab - 1, 1, vocab // 2, 0]


@pytest.mark.parametrize("teacher", [False, True], ids=["last_block_first", "first_block_first"])
@pytest.mark.parametrize("vocab", [37, 48, 5], ids=["full_blocks_and_tail", "full_blocks_only", "tail_only"])
def test_gradient_pass_in_either_walk_matches_reference(teacher, vocab, monkeypatch):
    """Phase 3 walks a row last block first, or first block first with a teacher; either walk gives
    the reference's gradient, including the tail block, the target column written after the loop and
    an in-place gradient."""
    monkeypatch.setitem(LAUNCH_OVERRIDES, "block_v", 16)  # (HEADLOSS_BLOCK_V is read at import)
    logits = make_logits((6, vocab), torch.float32, seed=seed_of("order", vocab))
    targets = make_targets((6,), vocab, 22, 0.2)
    targets[0] = vocab - 1  # the target in the tail block
    spec, inputs = RICH_FUSED, {}
    if teacher:
        spec = with_(RICH_FUSED, distillation={"weight": 0.5, "temperature": 2.0})
        inputs = {"teacher_logits": make_logits((6, vocab), torch.float32, seed=seed_of("teacher", vocab))}
    pair = run_pair(logits, targets, spec, inputs=inputs)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    x = logits.clone().requires_grad_()
    head_loss(x, targets, spec, inplace_grad=True, **inputs).loss.backward()
    torch.testing.assert_close(x.grad, pair.grad, rtol=1e-5, atol=1e-6)


def test_scale_kernel_loops_over_more_rows_than_programs(monkeypatch):
    from headloss.kernels import head as head_module

    monkeypatch.setattr(head_module, "SCALE_PROGRAMS", 3)
    logits = make_logits((11, 40), torch.float32, seed=16)
    targets = make_targets((11,), 40, 16, 0.2)
    pair = run_pair(logits, targets, MODES["fused"], upstream=-2.5)
    assert_matches_reference(pair)
    assert_nontrivial(pair)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(0, 37), (2, 0, 37)], ids=["2d", "3d"])
def test_empty_batch_gives_zero_loss_and_empty_grad(shape, reduction):
    spec = LossSpec(z_loss=ZLoss(), entropy=Entropy(), token_accuracy=True, reduction=reduction,
                    outputs=ALL_OUTPUTS)
    logits = make_logits(shape, torch.float32, seed=1).requires_grad_()
    targets = torch.zeros(shape[:-1], dtype=torch.long)
    out = head_loss(logits, targets, spec, backend="triton")
    assert out.loss.shape == (() if reduction != "none" else shape[:-1])
    assert float(out.loss.detach().sum()) == 0.0
    for name, value in out.metrics.items():
        assert torch.isfinite(value.double()).all(), name
        assert float(value) == 0.0, name
    for name in ALL_OUTPUTS:
        assert getattr(out, name).shape == shape[:-1]
    out.loss.sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape


@pytest.mark.parametrize("mode", list(MODES))
def test_all_ignored_batch_gives_zero_loss_and_zero_grad(mode):
    spec = MODES[mode]
    logits = make_logits((5, 43), torch.float32, seed=3).requires_grad_()
    targets = torch.full((5,), -100)
    out = head_loss(logits, targets, spec, backend="triton")
    assert float(out.loss.detach()) == 0.0
    assert int(out.metrics["n_tokens"]) == 0
    for name, value in out.metrics.items():
        assert torch.isfinite(value.double()).all() and float(value) == 0.0, name
    assert torch.all(out.predicted_tokens == -1)
    for name in ("logprobs", "lse", "token_loss", "entropy"):
        assert torch.all(getattr(out, name) == 0), name
    objective = out.loss + out.logprobs.sum() + out.entropy.sum() if mode == "deferred" else out.loss
    objective.backward()
    assert logits.grad is not None
    assert torch.all(logits.grad == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_accuracy_counts_rows_whose_argmax_is_the_target(dtype):
    rows, vocab = 10, 23
    logits = make_logits((rows, vocab), torch.float32, seed=5, scale=1.0)
    targets = make_targets((rows,), vocab - 1, seed=5) + 1  # ids 1..V-1; 0 is ignore_index
    hit = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    ignored = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, 0], dtype=torch.bool)
    for r in range(rows):
        logits[r, targets[r]] = 5.0 if hit[r] else -5.0
        if ignored[r]:
            logits[r, 0] = 10.0  # argmax == ignore_index: must not count as a hit
    targets[ignored] = 0
    spec = LossSpec(ignore_index=0, token_accuracy=True, outputs=("predicted_tokens",))
    pair = run_pair(logits.to(dtype), targets, spec)
    assert_matches_reference(pair)
    expected = float((hit & ~ignored).sum()) / float((~ignored).sum())
    assert 0 < expected < 1
    assert float(pair.out.metrics["token_accuracy"]) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_predicted_tokens_are_minus_one_at_ignored_rows_and_first_index_on_ties(dtype):
    logits = make_logits((5, 19), torch.float32, seed=6, scale=1.0)
    logits[0, 2] = logits[0, 9] = 4.0
    logits[1, 18] = 4.0
    logits[2] = 0.5  # all equal: index 0
    logits[3, 7] = logits[3, 11] = logits[3, 12] = 4.0
    logits = logits.to(dtype)
    targets = torch.tensor([1, 2, 3, -100, 5])
    out = head_loss(logits, targets, LossSpec(outputs=("predicted_tokens",)), backend="triton")
    assert out.predicted_tokens.dtype == torch.int64
    assert out.predicted_tokens.tolist() == [2, 18, 0, -1, int(logits[4].argmax())]


def test_predicted_tokens_are_the_argmax_without_targets():
    logits = make_logits((2, 3, 31), torch.float32, seed=7)
    spec = LossSpec(cross_entropy=None, entropy=Entropy(), outputs=("predicted_tokens",))
    out = head_loss(logits, None, spec, backend="triton")
    assert torch.equal(out.predicted_tokens, logits.argmax(-1))


def test_reductions_are_consistent_with_each_other():
    logits = make_logits((9, 70), torch.float32, seed=8)
    targets = make_targets((9,), 70, 8, 0.3)
    base = LossSpec(z_loss=ZLoss(weight=1e-2), outputs=("token_loss",))
    outs = {
        r: head_loss(logits, targets, with_(base, reduction=r), backend="triton")
        for r in ("mean", "sum", "none")
    }
    n_valid = int((targets != -100).sum())
    assert 0 < n_valid < 9
    assert float(outs["sum"].loss) == pytest.approx(float(outs["mean"].loss) * n_valid, rel=1e-6)
    assert torch.allclose(outs["none"].loss, outs["none"].token_loss)
    assert float(outs["none"].loss.sum()) == pytest.approx(float(outs["sum"].loss), rel=1e-6)
    assert torch.all(outs["none"].loss[targets == -100] == 0)


@pytest.mark.parametrize(
    "num_items",
    [13, 6.5, torch.tensor(13), torch.tensor(13.0)],
    ids=["int", "float", "int_tensor", "float_tensor"],
)
@pytest.mark.parametrize("mode", list(MODES))
def test_num_items_in_batch_divides_the_summed_loss(num_items, mode):
    logits = make_logits((2, 4, 50), torch.float32, seed=9)
    targets = make_targets((2, 4), 50, 9, 0.25)
    pair = run_pair(logits, targets, MODES[mode], num_items_in_batch=num_items)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    summed = float(pair.ref.token_loss.detach().sum())
    assert float(pair.out.loss.detach()) == pytest.approx(summed / float(num_items), rel=1e-5)


def test_differentiable_outputs_gradient_matches_reference():
    spec = LossSpec(
        cross_entropy=CrossEntropy(label_smoothing=0.1),
        entropy=Entropy(weight=0.0),
        outputs=("logprobs", "entropy"),
        differentiable_outputs=True,
    )
    a, b = 0.7, -1.3
    logits = make_logits((7, 90), torch.float32, seed=10)
    targets = make_targets((7,), 90, 10, 0.25)

    def objective(out):
        return out.logprobs.sum() * a + out.entropy.sum() * b + out.loss

    pair = run_pair(logits, targets, spec, objective=objective)
    assert_matches_reference(pair)
    assert_nontrivial(pair)


@pytest.mark.parametrize(
    "entropy_weight,differentiable",
    [(0.0, True), (0.3, False), (-0.2, True)],
    ids=["metric_with_differentiable_output", "regulariser", "bonus_with_differentiable_output"],
)
def test_entropy_only_spec_runs_without_targets(entropy_weight, differentiable):
    spec = LossSpec(
        cross_entropy=None,
        entropy=Entropy(weight=entropy_weight),
        outputs=("entropy", "lse", "predicted_tokens"),
        differentiable_outputs=differentiable,
    )
    logits = make_logits((2, 3, 55), torch.float32, seed=12)
    pair = run_pair(logits, None, spec)
    assert_matches_reference(pair)
    assert int(pair.out.metrics["n_tokens"]) == 6
    assert float(pair.out.metrics["entropy"]) > 0
    assert float(pair.ref_grad.norm()) > 0


@pytest.mark.parametrize(
    "dtype,upstream,transform",
    [
        (torch.float32, 1.0, LogitTransform()),
        (torch.bfloat16, 3.5, LogitTransform()),
        (torch.float32, 1.0, LogitTransform(softcap=2.0, temperature=0.7, logit_scale=1.3)),
    ],
    ids=["fp32", "bf16_upstream_3.5", "fp32_softcap_temperature"],
)
@pytest.mark.parametrize("mode", list(MODES))
def test_inplace_grad_gives_same_gradient_and_overwrites_logits(mode, dtype, upstream, transform):
    logits = make_logits((6, 80), dtype, seed=13)
    targets = make_targets((6,), 80, 13, 0.3)
    spec = with_(MODES[mode], transform=transform)
    pair = run_pair(logits, targets, spec, inplace_grad=True, upstream=upstream)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    assert torch.equal(pair.leaf.detach(), pair.grad), "the logits do not hold the gradient"
    assert not torch.equal(pair.leaf.detach(), logits)


@pytest.mark.parametrize("mode", list(MODES))
def test_inplace_grad_on_strided_view_writes_only_the_view(mode):
    base = make_logits((2, 5, 40), torch.float32, seed=14)
    targets = make_targets((2, 4), 40, 14, 0.25)
    pair = run_pair(base, targets, MODES[mode], view=lambda t: t[:, :-1, :], inplace_grad=True)
    assert_matches_reference(pair)
    assert torch.equal(pair.leaf.detach()[:, :-1], pair.grad[:, :-1])
    assert torch.equal(pair.leaf.detach()[:, -1], base[:, -1]), "logits outside the view were overwritten"


@pytest.mark.parametrize("upstream", [3.5, 0.0, -2.0])
@pytest.mark.parametrize("mode", list(MODES))
def test_upstream_gradient_scales_the_logit_gradient(mode, upstream):
    logits = make_logits((5, 64), torch.float32, seed=15)
    targets = make_targets((5,), 64, 15, 0.2)
    pair = run_pair(logits, targets, MODES[mode], upstream=upstream)
    assert_matches_reference(pair)
    if upstream != 0.0:
        assert_nontrivial(pair)
    else:
        assert torch.all(pair.grad == 0)


def test_second_backward_through_a_fused_loss_raises_instead_of_a_wrong_gradient():
    # fused mode hands its one precomputed gradient to autograd; a second backward must not
    # rescale it again (silently wrong) or mutate the first result
    logits = make_logits((4, 40), torch.float32, seed=16).requires_grad_()
    targets = make_targets((4,), 40, 16)
    loss = head_loss(logits, targets, LossSpec(reduction="sum"), backend="triton").loss
    (first,) = torch.autograd.grad(loss * 2.0, logits, retain_graph=True)
    first_copy = first.clone()
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss * 3.0, logits)
    assert torch.equal(first, first_copy), "the first gradient changed"
    ref_logits = logits.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(reference_head_loss(ref_logits, targets, LossSpec(reduction="sum")).loss,
                                 ref_logits)
    assert_close_norm(first, 2.0 * ref, rtol=1e-5, atol=1e-9, name="first")


def test_repeated_backward_in_deferred_mode_recomputes_the_gradient():
    spec = LossSpec(reduction="none")
    logits = make_logits((4, 40), torch.float32, seed=16).requires_grad_()
    targets = make_targets((4,), 40, 16)
    loss = head_loss(logits, targets, spec, backend="triton").loss.sum()
    (first,) = torch.autograd.grad(loss * 2.0, logits, retain_graph=True)
    first_copy = first.clone()
    (second,) = torch.autograd.grad(loss * 3.0, logits)
    ref_logits = logits.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(reference_head_loss(ref_logits, targets, spec).loss.sum(), ref_logits)
    assert_close_norm(first, 2.0 * ref, rtol=1e-5, atol=1e-9, name="first")
    assert_close_norm(second, 3.0 * ref, rtol=1e-5, atol=1e-9, name="second")
    assert torch.equal(first, first_copy), "the first gradient changed after the second backward"


@pytest.mark.parametrize("mode", list(MODES))
def test_gradients_of_two_calls_accumulate_on_shared_logits(mode):
    spec = MODES[mode]
    logits = make_logits((5, 48), torch.float32, seed=27).requires_grad_()
    ref_logits = logits.detach().double().requires_grad_()
    for step in range(2):
        targets = make_targets((5,), 48, 27 + step, 0.2)
        head_loss(logits, targets, spec, backend="triton").loss.backward()
        reference_head_loss(ref_logits, targets, spec).loss.backward()
    assert_close_norm(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-9, name="accumulated grad")
    assert float(ref_logits.grad.norm()) > 0


# entropy as a metric only: summed in the gradient pass when there is one, else in the stats pass
METRIC_ENTROPY = LossSpec(entropy=Entropy(weight=0.0), token_accuracy=True, outputs=ALL_OUTPUTS)
NO_GRAD_SPECS = {**MODES, "metric_entropy": METRIC_ENTROPY}


@pytest.mark.parametrize("spec_name", list(NO_GRAD_SPECS))
@pytest.mark.parametrize("how", ["torch_no_grad", "logits_without_grad"])
def test_forward_without_grad_gives_the_same_values(how, spec_name):
    spec = NO_GRAD_SPECS[spec_name]
    logits = make_logits((6, 75), torch.float32, seed=17)
    targets = make_targets((6,), 75, 17, 0.3)
    with_grad = head_loss(logits.clone().requires_grad_(), targets, spec, backend="triton")
    if how == "torch_no_grad":
        with torch.no_grad():
            without = head_loss(logits.clone().requires_grad_(), targets, spec, backend="triton")
    else:
        without = head_loss(logits.clone(), targets, spec, backend="triton")
    assert not without.loss.requires_grad

    def same(got, want):
        tol = 0 if not want.is_floating_point() else 1e-6
        torch.testing.assert_close(got, want.detach(), rtol=tol, atol=tol)

    same(without.loss, with_grad.loss)
    assert without.metrics.keys() == with_grad.metrics.keys()
    for name, value in with_grad.metrics.items():
        same(without.metrics[name], value)
    for name in ALL_OUTPUTS:
        same(getattr(without, name), getattr(with_grad, name))
    pair = run_pair(logits, targets, spec, with_grad=False)
    assert_matches_reference(pair, check_grad=False)


@pytest.mark.parametrize(
    "transform",
    [LogitTransform(), LogitTransform(softcap=3.0, temperature=0.8)],
    ids=["identity", "softcap_temperature"],
)
@pytest.mark.parametrize("mode", ["fused", "deferred", "fused_metric_entropy"])
def test_masked_vocabulary_columns_give_finite_loss_and_zero_grad(mode, transform):
    spec = LossSpec(
        z_loss=ZLoss(weight=1e-2),
        entropy=Entropy(weight=0.0 if mode == "fused_metric_entropy" else 0.2),
        token_accuracy=True,
        outputs=ALL_OUTPUTS,
        transform=transform,
        differentiable_outputs=mode == "deferred",
    )
    masked = [3, 17, 18, 40]
    logits = make_logits((6, 41), torch.float32, seed=18)
    logits[:, masked] = float("-inf")
    targets = torch.tensor([1, 2, 5, 39, -100, 20])
    pair = run_pair(logits, targets, spec)
    assert torch.isfinite(pair.out.loss)
    for name, value in pair.out.metrics.items():
        assert torch.isfinite(value.double()).all(), name
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    assert torch.all(pair.grad[:, masked] == 0)
    assert torch.isfinite(pair.grad).all()


@pytest.mark.parametrize("mode", list(MODES))
def test_masked_column_zero_with_ignored_rows_gives_finite_loss(mode):
    # column 0 (often padding) masked and a row ignored: the ignored row must not leak -inf
    masked = [0, 9]
    logits = make_logits((5, 30), torch.float32, seed=26)
    logits[:, masked] = float("-inf")
    targets = torch.tensor([4, -100, 7, -100, 29])
    valid = targets != -100
    spec = with_(MODES[mode], cross_entropy=CrossEntropy(), entropy=Entropy(weight=0.1))
    leaf = logits.clone().requires_grad_()
    out = head_loss(leaf, targets, spec, backend="triton")
    on_valid = reference_head_loss(logits[valid].double().requires_grad_(), targets[valid], spec)
    assert torch.isfinite(out.loss)
    assert float(out.loss.detach()) == pytest.approx(float(on_valid.loss.detach()), rel=1e-5)
    for name in ("logprobs", "lse", "token_loss", "entropy"):
        got = getattr(out, name)
        assert torch.isfinite(got).all(), name
        assert torch.all(got[~valid] == 0), name
        assert_close_norm(got[valid], getattr(on_valid, name), rtol=1e-5, atol=1e-5, name=name)
    out.loss.backward()
    assert torch.isfinite(leaf.grad).all()
    assert torch.all(leaf.grad[~valid] == 0) and torch.all(leaf.grad[:, masked] == 0)
    assert float(leaf.grad.norm()) > 0


def test_int32_targets_match_int64_targets():
    logits = make_logits((6, 40), torch.float32, seed=19)
    targets = make_targets((6,), 40, 19, 0.3)
    spec = LossSpec(token_accuracy=True, outputs=("logprobs",))
    wide = head_loss(logits, targets, spec, backend="triton")
    narrow = head_loss(logits, targets.int(), spec, backend="triton")
    assert torch.equal(wide.loss, narrow.loss)
    assert torch.equal(wide.logprobs, narrow.logprobs)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: torch.stack([t, t.flip(0)], dim=1).reshape(-1)[::2],
        lambda t: torch.stack([t, t.flip(0)], dim=-1)[..., 0],
    ],
    ids=["every_other_element", "last_dim_slice"],
)
def test_non_contiguous_targets_give_the_same_loss_as_contiguous_ones(make):
    logits = make_logits((6, 37), torch.float32, seed=20)
    targets = make_targets((6,), 37, 20)
    strided = make(targets)
    assert torch.equal(strided, targets) and not strided.is_contiguous()
    expected = head_loss(logits, targets, LossSpec(), backend="triton").loss
    got = head_loss(logits, strided, LossSpec(), backend="triton").loss
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_uint8_targets_match_int64_targets(backend):
    # 156 is -100 modulo 256: a uint8 comparison with ignore_index=-100 would drop it
    logits = make_logits((3, 200), torch.float32, seed=22)
    targets = torch.tensor([156, 3, 199])
    expected = head_loss(logits, targets, LossSpec(), backend=backend)
    got = head_loss(logits, targets.to(torch.uint8), LossSpec(), backend=backend)
    assert int(got.metrics["n_tokens"]) == 3
    torch.testing.assert_close(got.loss, expected.loss)


@pytest.mark.parametrize("backend, policy", [("torch", False), ("triton", True), ("torch", True)],
                         ids=["torch", "triton-policy", "torch-policy"])
def test_shifted_uint8_labels_match_int64_labels(backend, policy):
    # a shift pads the labels with ignore_index (-100): in uint8 that padding cannot be written
    logits = make_logits((2, 5, 200), torch.float32, seed=23)
    labels = torch.tensor([[1, 156, 3, 199, 7], [9, 8, 156, 6, 5]])
    spec = LossSpec(cross_entropy=None, policy={"loss_type": "grpo"}) if policy else LossSpec()
    inputs = {"advantages": torch.tensor([0.5, -1.0])} if policy else {}
    expected = head_loss(logits, labels, spec, shift=True, backend=backend, **inputs)
    got = head_loss(logits, labels.to(torch.uint8), spec, shift=True, backend=backend, **inputs)
    assert int(got.metrics["n_tokens"]) == 8
    torch.testing.assert_close(got.loss, expected.loss)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16], ids=["int8", "int16"])
def test_narrow_signed_targets_keep_ignore_index(dtype):
    logits = make_logits((4, 100), torch.float32, seed=28)
    targets = torch.tensor([5, -100, 99, 0])
    expected = head_loss(logits, targets, LossSpec(token_accuracy=True), backend="triton")
    got = head_loss(logits, targets.to(dtype), LossSpec(token_accuracy=True), backend="triton")
    assert int(got.metrics["n_tokens"]) == 3
    torch.testing.assert_close(got.loss, expected.loss)


def test_backend_auto_runs_the_kernel_under_the_interpreter(monkeypatch):
    logits = make_logits((3, 20), torch.float32, seed=23).requires_grad_()
    targets = make_targets((3,), 20, 23)
    auto = head_loss(logits, targets)
    assert type(auto.loss.grad_fn).__name__ == "HeadFunctionBackward"
    monkeypatch.setattr(headloss.env, "INTERPRETER", False)
    fallback = head_loss(logits, targets)
    assert type(fallback.loss.grad_fn).__name__ != "FusedHeadBackward"
    torch.testing.assert_close(fallback.loss, auto.loss)


def test_head_loss_module_matches_the_function():
    spec = LossSpec(z_loss=ZLoss(weight=1e-3), token_accuracy=True)
    logits = make_logits((2, 3, 30), torch.bfloat16, seed=24)
    targets = make_targets((2, 3), 30, 24, 0.2)
    module = HeadLoss(spec.to_dict(), backend="triton")
    assert "spec=" in repr(module)
    got = module(logits, targets, num_items_in_batch=7)
    want = head_loss(logits, targets, spec, num_items_in_batch=7, backend="triton")
    assert torch.equal(got.loss, want.loss)
    assert got.metrics.keys() == want.metrics.keys()
    floats = got.metrics_as_floats()
    assert set(floats) == set(got.metrics) and all(isinstance(v, float) for v in floats.values())


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_file_runs_on_the_kernel_and_matches_reference(path):
    spec = LossSpec.from_file(path)
    logits = make_logits((2, 4, 60), torch.bfloat16, seed=25)
    targets = make_targets((2, 4), 60, 25, 0.25, spec.ignore_index) if spec.needs_targets else None
    inputs = {**teacher_inputs(spec, logits, targets, seed=26), **row_inputs(spec, (2, 4), seed=28)}
    if spec.policy is not None:
        logp = -torch.rand(2, 4, generator=torch.Generator().manual_seed(27)) * 4 - 2
        inputs.update(advantages=torch.tensor([0.7, -1.2]), old_logprobs=logp, ref_logprobs=logp - 0.1)
    pair = run_pair(logits, targets, spec, inputs=inputs)
    assert_matches_reference(pair)


@needs_kernel
@pytest.mark.slow
@CI
@given(case=cases())
def test_kernel_matches_fp64_reference_for_random_specs_and_shapes(case):
    spec, vocab, token_shape = case["spec"], case["vocab"], case["token_shape"]
    if case["strided"]:
        base_shape = (token_shape[0], token_shape[1] + 1, vocab)

        def view(t):
            return t[:, :-1, :]
    else:
        base_shape = (*token_shape, vocab)

        def view(t):
            return t

    logits = make_logits(base_shape, case["dtype"], seed=case["seed"], scale=case["scale"])
    targets = None
    if case["has_targets"]:
        targets = make_targets(token_shape, vocab, case["seed"], case["ignore_frac"], spec.ignore_index)
    pair = run_pair(
        logits, targets, spec,
        view=view, num_items_in_batch=case["num_items"], inplace_grad=case["inplace_grad"],
    )
    assert_matches_reference(pair)
