"""The fused lm_head (headloss.linear_head_loss) on CPU: the real Triton kernels under TRITON_INTERPRET=1 against
the materialised fp64 reference.

The oracle is ``reference_head_loss(F.linear(hidden64, weight64, bias64), targets, spec)`` on the kernel's
inputs upcast to float64, with autograd for the gradients of hidden, weight and bias. Chunking is set
through ``chunk_bytes`` (rows per chunk = chunk_bytes // (V * element size)); every case is a handful of
rows, since the interpreter runs each chunk's kernel launch in Python.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ALL_OUTPUTS,
    DIFFERENTIABLE_EVERYTHING,
    FLOAT_OUTPUTS,
    GRAD_ATOL,
    GRAD_RTOL,
    assert_close_norm,
    default_objective,
    generator,
    make_targets,
    needs_kernel,
    seed_of,
    tiered,
    token_weights,
    with_,
)

import headloss.chunks
import headloss.head
import headloss.linear
from headloss import CrossEntropy, Entropy, HeadLossOutput, LogitTransform, LossSpec, ZLoss, scored_rows
from headloss.api import LinearHeadLoss, linear_head_loss
from headloss.chunks import chunk_rows_for
from headloss.reference import reference_head_loss, transformed_logits

pytestmark = needs_kernel

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
GRAD_NAMES = ("hidden", "weight", "bias")


@dataclass(frozen=True)
class Tol:
    """Agreement with the fp64 reference on the same (upcast) inputs."""

    value_rtol: float  # loss, metrics, per-token outputs: norm-wise relative
    value_atol: float  # per element, times (1 + max |transformed logit|)
    grad_rtol: float  # d hidden, d weight, d bias: norm-wise relative
    argmax_slack: float  # a logit within this (relative) of the row max may be the predicted token


# fp32: the chunk logits are an fp32 GEMM; everything agrees to fp32 accuracy (measured: values 8e-7,
# gradients 3e-6). bf16/fp16: the chunk logits are rounded to the input dtype after the GEMM (as Liger
# does), d loss / d logits is stored in it and the gradient GEMMs run in it (measured: bf16 loss 1.4e-3,
# per-token entropy 4.5e-3, gradients 1.5e-2; fp16 about 8x smaller).
TOLS = {
    F32: Tol(value_rtol=1e-5, value_atol=2e-6, grad_rtol=2e-5, argmax_slack=1e-5),
    BF16: Tol(value_rtol=5e-3, value_atol=1e-3, grad_rtol=3e-2, argmax_slack=2e-2),
    F16: Tol(value_rtol=1e-3, value_atol=1.5e-4, grad_rtol=5e-3, argmax_slack=3e-3),
}

# specs by name: every term, metric and output; the transforms; each reduction; both modes
SPECS = {
    "ce_only": LossSpec(),
    "ce_z_entropy_metric_accuracy_all_outputs": LossSpec(
        z_loss=ZLoss(weight=1e-2), entropy=Entropy(weight=0.0), token_accuracy=True, outputs=ALL_OUTPUTS
    ),
    "ce_z_weighted_entropy_accuracy_all_outputs": LossSpec(
        z_loss=ZLoss(weight=1e-2), entropy=Entropy(weight=0.1), token_accuracy=True, outputs=ALL_OUTPUTS
    ),
    "label_smoothing_softcap_temperature_scale": LossSpec(
        cross_entropy=CrossEntropy(label_smoothing=0.1, weight=0.9),
        transform=LogitTransform(logit_scale=1.3, softcap=5.0, temperature=0.7),
        outputs=("logprobs", "lse", "predicted_tokens"),
    ),
    "sum_reduction": LossSpec(z_loss=ZLoss(weight=1e-3), reduction="sum", outputs=("token_loss",)),
    "none_reduction_deferred": LossSpec(
        entropy=Entropy(weight=0.1), reduction="none", outputs=("token_loss", "entropy")
    ),
    "differentiable_outputs_deferred": DIFFERENTIABLE_EVERYTHING,
}
FUSED = SPECS["ce_z_weighted_entropy_accuracy_all_outputs"]
DEFERRED = with_(FUSED, differentiable_outputs=True)
MODES = {"fused": FUSED, "deferred": DEFERRED}


# --- inputs, the oracle, the comparison ---------------------------------------------------------


def chunk_bytes_for(rows: int, vocab: int, dtype: torch.dtype) -> int:
    """The ``chunk_bytes`` that gives ``rows`` rows per chunk."""
    return rows * vocab * torch.empty((), dtype=dtype).element_size()


def make_head(token_shape, hidden_size: int, vocab: int, dtype: torch.dtype, seed: int, *, with_bias: bool = True):
    """(hidden, weight, bias | None) in ``dtype``; logits = hidden @ weight.T + bias have std ~3."""
    gen = generator(seed)
    hidden = torch.randn(*token_shape, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64) * (3.0 / math.sqrt(hidden_size))
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64) * 0.5 if with_bias else None
    return hidden.to(dtype), weight.to(dtype), (bias.to(dtype) if bias is not None else None)


def hf_shift(targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF causal-LM labels: position t is scored against targets[:, t + 1], the last position ignored."""
    return F.pad(targets[:, 1:], (0, 1), value=ignore_index)


@dataclass
class LinearRun:
    """One ``linear_head_loss`` call (backend triton) and the fp64 reference, both backpropagated."""

    spec: LossSpec
    out: HeadLossOutput
    ref: HeadLossOutput
    leaves: dict[str, torch.Tensor | None]  # the kernel's hidden, weight, bias (gradients in .grad)
    ref_leaves: dict[str, torch.Tensor | None]  # their fp64 copies
    x64: torch.Tensor  # fp64 transformed reference logits, [rows, V]
    dtype: torch.dtype

    def grad(self, name: str) -> torch.Tensor | None:
        leaf = self.leaves[name]
        return None if leaf is None else leaf.grad


def run_linear(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor | None,
    spec: LossSpec | None = None,
    *,
    ref_targets: torch.Tensor | None = None,
    requires: tuple[str, ...] = GRAD_NAMES,
    objective: Callable[[HeadLossOutput], torch.Tensor] | None = None,
    upstream: float = 1.0,
    num_items_in_batch=None,
    **options,
) -> LinearRun:
    """Kernel on copies of the inputs (those named in ``requires`` require grad), reference on fp64
    copies with ``ref_targets`` (default: the same targets); ``upstream * objective`` backpropagated."""
    spec = LossSpec() if spec is None else spec
    inputs = {"hidden": hidden, "weight": weight, "bias": bias}
    leaves = {k: None if t is None else t.detach().clone().requires_grad_(k in requires) for k, t in inputs.items()}
    ref_leaves = {
        k: None if t is None else t.detach().double().requires_grad_(k in requires) for k, t in inputs.items()
    }
    out = linear_head_loss(
        leaves["hidden"], leaves["weight"], targets, spec,
        bias=leaves["bias"], num_items_in_batch=num_items_in_batch, backend="triton", **options,
    )
    logits64 = F.linear(ref_leaves["hidden"], ref_leaves["weight"], ref_leaves["bias"])
    ref = reference_head_loss(
        logits64, targets if ref_targets is None else ref_targets, spec, num_items_in_batch=num_items_in_batch
    )
    if requires:
        objective = objective or default_objective(spec, hidden.shape[:-1])
        (upstream * objective(out)).backward()
        ref_objective = upstream * objective(ref)
        if ref_objective.requires_grad:
            ref_objective.backward()
    x64 = transformed_logits(logits64.detach(), spec, torch.float64).reshape(-1, weight.shape[0])
    return LinearRun(spec, out, ref, leaves, ref_leaves, x64, hidden.dtype)


def near_ties(x64: torch.Tensor, slack: float) -> torch.Tensor:
    """Rows whose two largest logits are within ``slack`` (relative): their argmax may flip on rounding."""
    if x64.shape[-1] < 2:
        return torch.zeros(x64.shape[0], dtype=torch.bool)
    top = x64.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) <= slack * (1 + top[:, 0].abs())


def assert_values_match(run: LinearRun, tol: Tol | None = None) -> None:
    """Loss, every metric and every per-token output agree with the reference."""
    tol = tol or TOLS[run.dtype]
    spec, out, ref = run.spec, run.out, run.ref
    finite = run.x64[torch.isfinite(run.x64)]
    atol = tol.value_atol * (1.0 + (float(finite.abs().max()) if finite.numel() else 0.0))
    ties = near_ties(run.x64, tol.argmax_slack)
    requires_grad = any(t is not None and t.requires_grad for t in run.leaves.values())

    assert out.loss.dtype == torch.float32
    assert out.loss.shape == ref.loss.shape
    assert_close_norm(out.loss, ref.loss, rtol=tol.value_rtol, atol=atol, name="loss")

    assert set(out.metrics) == set(ref.metrics), f"metric names {sorted(out.metrics)} != {sorted(ref.metrics)}"
    for name, want in ref.metrics.items():
        got = out.metrics[name]
        assert not got.requires_grad, f"metric {name} carries gradient"
        if name == "n_tokens":
            assert int(got) == int(want)
        elif name == "token_accuracy":
            # a row whose top two logits tie within the rounding may count either way
            slack = float(ties.sum()) / max(int(ref.metrics["n_tokens"]), 1)
            assert abs(float(got) - float(want)) <= slack + 1e-6, f"token_accuracy {float(got)} != {float(want)}"
        else:
            assert_close_norm(got, want, rtol=tol.value_rtol, atol=atol, name=f"metrics[{name}]")

    for name in ALL_OUTPUTS:
        got, want = getattr(out, name), getattr(ref, name)
        assert (got is None) == (name not in spec.outputs), f"{name}: present={got is not None}"
        if got is None:
            continue
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        if name == "predicted_tokens":
            assert got.dtype == torch.int64
            got, want = got.reshape(-1), want.reshape(-1)
            assert torch.equal(got == -1, want == -1), "predicted_tokens: ignored positions differ"
            rows = torch.nonzero(want != -1).reshape(-1)
            picked = run.x64[rows, got[rows]]
            best = run.x64[rows].max(dim=-1).values
            assert torch.all(picked >= best - tol.argmax_slack * (1 + best.abs())), "predicted_tokens: not an argmax"
            assert torch.all((got[rows] == want[rows]) | ties[rows]), "predicted_tokens: differ off near-ties"
        else:
            assert got.dtype == torch.float32
            assert got.requires_grad == (spec.differentiable_outputs and requires_grad), f"{name}: requires_grad"
            assert_close_norm(got, want, rtol=tol.value_rtol, atol=atol, name=name)


def assert_grads_match(run: LinearRun, tol: Tol | None = None) -> None:
    """d hidden, d weight, d bias agree with the reference; inputs not requiring grad get none."""
    tol = tol or TOLS[run.dtype]
    for name in GRAD_NAMES:
        leaf, ref_leaf = run.leaves[name], run.ref_leaves[name]
        if leaf is None:
            continue
        if not leaf.requires_grad:
            assert leaf.grad is None, f"{name}: got a gradient without requiring one"
            continue
        assert leaf.grad is not None, f"{name}: no gradient"
        assert leaf.grad.dtype == leaf.dtype, f"{name}: gradient dtype {leaf.grad.dtype} != {leaf.dtype}"
        want = ref_leaf.grad if ref_leaf.grad is not None else torch.zeros_like(ref_leaf)
        assert_close_norm(leaf.grad, want, rtol=tol.grad_rtol, atol=GRAD_ATOL, name=f"d {name}")


def assert_matches_reference(run: LinearRun, tol: Tol | None = None) -> None:
    assert_values_match(run, tol)
    assert_grads_match(run, tol)


def assert_nontrivial(run: LinearRun) -> None:
    """The test could fail: a nonzero loss, and a nonzero reference gradient for each leaf with one."""
    assert float(run.ref.loss.detach().abs().sum()) > 0
    for name in GRAD_NAMES:
        leaf = run.ref_leaves[name]
        if leaf is not None and leaf.requires_grad:
            assert leaf.grad is not None and float(leaf.grad.norm()) > 0, f"{name}: zero reference gradient"


@pytest.fixture
def chunk_log(monkeypatch):
    """Logits shape of every forward / backward kernel launch of the fused lm_head, in order, and
    whether the forward launch writes the gradient over the chunk (fused mode)."""
    log = {"forward": [], "backward": [], "fused": []}
    real_forward, real_backward = headloss.head.launch_head, headloss.linear.launch_backward

    def forward(plan, **kwargs):
        log["forward"].append(tuple(kwargs["logits"].shape))
        log["fused"].append(kwargs["grad"] is kwargs["logits"])
        return real_forward(plan, **kwargs)

    def backward(plan, **kwargs):
        log["backward"].append(tuple(kwargs["logits"].shape))
        return real_backward(plan, **kwargs)

    monkeypatch.setattr(headloss.head, "launch_head", forward)
    monkeypatch.setattr(headloss.linear, "launch_backward", backward)
    return log


# --- values and gradients against the fp64 reference ----------------------------------------------

# name -> rows per chunk, for N = 7 rows
CHUNKINGS = {"one_row_per_chunk": 1, "three_rows_split_7_as_3_3_1": 3, "one_chunk_bigger_than_n": 64}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_values_and_all_three_gradients_match_fp64_reference_across_chunkings(dtype, chunking, mode, chunk_log):
    rows_per_chunk, n, vocab = CHUNKINGS[chunking], 7, 37
    spec = MODES[mode]
    seed = seed_of("chunking", dtype, chunking, mode)
    hidden, weight, bias = make_head((n,), 16, vocab, dtype, seed)
    targets = make_targets((n,), vocab, seed)
    run = run_linear(hidden, weight, bias, targets, spec, chunk_bytes=chunk_bytes_for(rows_per_chunk, vocab, dtype))
    assert_matches_reference(run)
    assert_nontrivial(run)
    # chunks of the asked size cover the rows once; no launch sees more than one chunk of logits
    expected = [min(rows_per_chunk, n - start) for start in range(0, n, rows_per_chunk)]
    assert [shape[0] for shape in chunk_log["forward"]] == expected
    assert all(shape == (rows, vocab) for shape, rows in zip(chunk_log["forward"], expected))
    assert chunk_log["fused"] == [mode == "fused"] * len(expected)
    assert [shape[0] for shape in chunk_log["backward"]] == (expected if mode == "deferred" else [])


# name -> (chunk budget in rows of logits, [launch rows per chunk]): with teacher hidden states the
# student's chunk takes 1 - TEACHER_SHARE of the budget, the teacher's parts of it the rest
TEACHER_PARTS = {"two_parts_of_one_chunk_4_3": (16, [[4, 3]]), "chunks_6_1_parts_2_2_2_and_1": (8, [[2, 2, 2], [1]])}


@pytest.mark.parametrize("mode", ["fused", "deferred"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
@pytest.mark.parametrize("parts", list(TEACHER_PARTS))
def test_teacher_hidden_in_parts_of_each_chunk_matches_fp64_reference(parts, divergence, mode, chunk_log):
    """A computed teacher's logits in parts of each student chunk (LinearRun.teacher_rows): every
    value and gradient as the fp64 reference on both heads' full logits; the teacher gets none."""
    budget, launches = TEACHER_PARTS[parts]
    n, vocab = 7, 37
    spec = LossSpec(cross_entropy={"weight": 0.5}, z_loss={"weight": 1e-2},
                    distillation={"divergence": divergence, "beta": 0.3, "temperature": 1.5},
                    outputs=("token_loss",), differentiable_outputs=mode == "deferred")
    seed = seed_of("teacher-parts", parts, divergence, mode)
    hidden, weight, bias = make_head((n,), 16, vocab, F32, seed)
    t_hidden, t_weight, t_bias = make_head((n,), 12, vocab, F32, seed + 1)
    targets = make_targets((n,), vocab, seed, ignore_frac=0.2)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    out = linear_head_loss(*leaves[:2], targets, spec, bias=leaves[2], teacher_hidden=t_hidden,
                           teacher_weight=t_weight.requires_grad_(), teacher_bias=t_bias,
                           chunk_bytes=chunk_bytes_for(budget, vocab, F32), compact=False, backend="triton")
    ref_leaves = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    ref = reference_head_loss(F.linear(*ref_leaves), targets, spec,
                              teacher_logits=F.linear(t_hidden.double(), t_weight.detach().double(), t_bias.double()))
    objective = default_objective(spec, (n,))
    objective(out).backward()
    objective(ref).backward()
    tol = TOLS[F32]
    assert_close_norm(out.loss, ref.loss, rtol=tol.value_rtol, atol=1e-5, name="loss")
    assert_close_norm(out.token_loss, ref.token_loss, rtol=tol.value_rtol, atol=1e-5, name="token_loss")
    for name in ref.metrics:
        assert_close_norm(out.metrics[name], ref.metrics[name], rtol=tol.value_rtol, atol=1e-5, name=name)
    for name, leaf, ref_leaf in zip(GRAD_NAMES, leaves, ref_leaves):
        assert float(ref_leaf.grad.norm()) > 0
        assert_close_norm(leaf.grad, ref_leaf.grad, rtol=tol.grad_rtol, atol=GRAD_ATOL, name=f"d {name}")
    assert t_weight.grad is None
    flat = [rows for chunk in launches for rows in chunk]
    assert [shape[0] for shape in chunk_log["forward"]] == flat
    assert [shape[0] for shape in chunk_log["backward"]] == (flat if mode == "deferred" else [])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(SPECS))
def test_spec_matches_fp64_reference_on_3d_hidden_with_ignored_rows(case, dtype):
    spec, vocab = SPECS[case], 100
    seed = seed_of("spec", case, dtype)
    hidden, weight, bias = make_head((2, 4), 16, vocab, dtype, seed)
    targets = make_targets((2, 4), vocab, seed, ignore_frac=0.25)
    run = run_linear(hidden, weight, bias, targets, spec, chunk_bytes=chunk_bytes_for(3, vocab, dtype))
    assert_matches_reference(run)
    assert_nontrivial(run)
    if spec.reduction == "none":
        assert run.out.loss.shape == (2, 4)


@pytest.mark.parametrize("layout", ["n_h", "b_t_h"])
@pytest.mark.parametrize("vocab", [37, 100, 129])
def test_vocab_not_a_power_of_two_in_both_layouts(vocab, layout):
    token_shape = (6,) if layout == "n_h" else (2, 3)
    seed = seed_of("vocab", vocab, layout)
    hidden, weight, bias = make_head(token_shape, 24, vocab, F32, seed)
    targets = make_targets(token_shape, vocab, seed, ignore_frac=0.2)
    run = run_linear(hidden, weight, bias, targets, FUSED, chunk_bytes=chunk_bytes_for(4, vocab, F32))
    assert_matches_reference(run)
    assert_nontrivial(run)
    assert run.out.predicted_tokens.shape == token_shape
    assert run.grad("hidden").shape == hidden.shape


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_without_bias_matches_reference(dtype, mode):
    seed = seed_of("no_bias", dtype, mode)
    hidden, weight, _ = make_head((2, 3), 8, 61, dtype, seed, with_bias=False)
    targets = make_targets((2, 3), 61, seed, ignore_frac=0.2)
    run = run_linear(hidden, weight, None, targets, MODES[mode], chunk_bytes=chunk_bytes_for(4, 61, dtype))
    assert run.leaves["bias"] is None
    assert_matches_reference(run)
    assert_nontrivial(run)


def test_fp16_matches_reference():
    seed = seed_of("fp16")
    hidden, weight, bias = make_head((2, 4), 16, 100, F16, seed)
    targets = make_targets((2, 4), 100, seed, ignore_frac=0.25)
    run = run_linear(hidden, weight, bias, targets, FUSED, chunk_bytes=chunk_bytes_for(3, 100, F16))
    assert_matches_reference(run)
    assert_nontrivial(run)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_low_precision_chunk_logits_are_rounded_once_after_the_gemm(dtype, mode):
    """Against the reference on logits rounded to the input dtype (gradient passed straight through the
    rounding), the values agree to fp32 accuracy and the gradients to the dtype's rounding."""
    seed = seed_of("rounded", dtype, mode)
    hidden, weight, bias = make_head((2, 4), 16, 100, dtype, seed)
    targets = make_targets((2, 4), 100, seed, ignore_frac=0.25)
    spec = MODES[mode]
    run = run_linear(hidden, weight, bias, targets, spec, chunk_bytes=chunk_bytes_for(3, 100, dtype))
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    exact = F.linear(h64, w64, b64)
    rounded = exact + (exact.detach().to(dtype).double() - exact.detach())  # straight-through rounding
    ref = reference_head_loss(rounded, targets, spec)
    default_objective(spec, (2, 4))(ref).backward()
    ref_run = LinearRun(spec, run.out, ref, run.leaves, {"hidden": h64, "weight": w64, "bias": b64},
                        transformed_logits(rounded.detach(), spec, torch.float64).reshape(-1, 100), dtype)
    assert_matches_reference(ref_run, Tol(1e-5, 2e-6, GRAD_RTOL[dtype], 1e-5))


# --- shift (HF causal LM) -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_shift_equals_manual_hf_shift_and_the_hf_definition(mode):
    spec, (b, t), vocab = MODES[mode], (2, 5), 41
    seed = seed_of("shift", mode)
    hidden, weight, bias = make_head((b, t), 16, vocab, F32, seed)
    targets = make_targets((b, t), vocab, seed, ignore_frac=0.2)
    targets[0, 3] = -100  # an ignored label inside a sequence, seen by position 2
    chunk = chunk_bytes_for(3, vocab, F32)
    shifted = run_linear(hidden, weight, bias, targets, spec, shift=True, chunk_bytes=chunk,
                         ref_targets=hf_shift(targets))
    manual = run_linear(hidden, weight, bias, hf_shift(targets), spec, chunk_bytes=chunk)
    assert_matches_reference(shifted)
    assert_nontrivial(shifted)
    # shift=True is the manual shift exactly: same kernel calls on the same rows
    assert torch.equal(shifted.out.loss, manual.out.loss)
    for name in GRAD_NAMES:
        assert torch.equal(shifted.grad(name), manual.grad(name)), name
    for name in ALL_OUTPUTS:
        got = getattr(shifted.out, name)
        assert got.shape == (b, t), name
        assert torch.equal(got, getattr(manual.out, name)), name
    # the last position of every sequence is ignored; position 2 of sequence 0 too
    assert torch.all(shifted.out.predicted_tokens[:, -1] == -1)
    assert torch.all(shifted.out.token_loss[:, -1] == 0)
    assert shifted.out.predicted_tokens[0, 2] == -1
    assert torch.all(shifted.grad("hidden")[:, -1] == 0)
    assert int(shifted.out.metrics["n_tokens"]) == int((targets[:, 1:] != -100).sum())

    # HF's own definition: logits[:, :-1] scored against labels[:, 1:]
    h64, w64, b64 = (x.detach().double() for x in (hidden, weight, bias))
    hf = reference_head_loss(F.linear(h64[:, :-1], w64, b64), targets[:, 1:], spec)
    assert_close_norm(shifted.out.loss, hf.loss, rtol=1e-5, atol=1e-6, name="loss vs HF")
    for name in ("logprobs", "lse", "entropy", "token_loss"):
        assert_close_norm(getattr(shifted.out, name)[:, :-1], getattr(hf, name), rtol=1e-5, atol=1e-5, name=name)


def test_shift_pads_with_a_custom_ignore_index():
    spec, vocab = LossSpec(ignore_index=-1, outputs=("predicted_tokens",)), 29
    seed = seed_of("shift_ignore")
    hidden, weight, bias = make_head((2, 4), 8, vocab, F32, seed)
    targets = make_targets((2, 4), vocab, seed)
    targets[1, 2] = -1
    run = run_linear(hidden, weight, bias, targets, spec, shift=True, ref_targets=hf_shift(targets, -1))
    assert_matches_reference(run)
    assert int(run.out.metrics["n_tokens"]) == 2 * 3 - 1
    assert torch.all(run.out.predicted_tokens[:, -1] == -1)
    assert run.out.predicted_tokens[1, 1] == -1


@pytest.mark.parametrize(
    "hidden_shape, targets_shape, match",
    [((6, 8), (6,), "^shift"), ((2, 3, 8), (6,), "^shift"), ((6, 8), (2, 3), "^shift")],
    ids=["2d_hidden", "1d_targets", "2d_hidden_2d_targets"],
)
def test_shift_without_sequence_dims_raises_naming_shift(hidden_shape, targets_shape, match):
    hidden = torch.randn(hidden_shape)
    weight = torch.randn(11, 8)
    targets = torch.zeros(targets_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        linear_head_loss(hidden, weight, targets, shift=True, backend="triton")


def test_shift_without_targets_raises_naming_targets():
    with pytest.raises(ValueError, match="^targets"):
        linear_head_loss(torch.randn(2, 3, 8), torch.randn(11, 8), None, shift=True, backend="triton")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8])
def test_shift_accepts_narrow_integer_targets(dtype):
    hidden, weight, bias = make_head((2, 4), 8, 29, F32, 5)
    targets = make_targets((2, 4), 29, 5)
    want = linear_head_loss(hidden, weight, targets, bias=bias, shift=True, backend="triton")
    got = linear_head_loss(hidden, weight, targets.to(dtype), bias=bias, shift=True, backend="triton")
    assert torch.equal(got.loss, want.loss)
    assert int(got.metrics["n_tokens"]) == 6


def test_shift_accepts_uint8_targets_like_head_loss_does():
    hidden, weight, bias = make_head((2, 4), 8, 29, F32, 5)
    targets = make_targets((2, 4), 29, 5)
    want = linear_head_loss(hidden, weight, targets, bias=bias, shift=True, backend="triton")
    got = linear_head_loss(hidden, weight, targets.to(torch.uint8), bias=bias, shift=True, backend="triton")
    assert torch.equal(got.loss, want.loss)


# --- weight tied to the input embedding -----------------------------------------------------------


def tiny_causal_lm(ids: torch.Tensor, embedding: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """hidden states from the token embedding: a residual tanh layer."""
    x = F.embedding(ids, embedding)
    return x + torch.tanh(x @ mix)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_weight_tied_to_embedding_gets_both_gradient_paths(dtype, mode):
    spec, vocab, width = MODES[mode], 53, 16
    seed = seed_of("tied", dtype, mode)
    gen = generator(seed)
    ids = torch.randint(0, vocab, (2, 5), generator=gen)
    mix = (torch.randn(width, width, generator=gen, dtype=torch.float64) / math.sqrt(width)).to(dtype)
    emb = torch.nn.Embedding(vocab, width, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(vocab, width, generator=gen, dtype=torch.float64) * 0.75)
    objective = default_objective(spec, (2, 5))

    hidden = emb(ids)
    hidden = hidden + torch.tanh(hidden @ mix)  # tiny_causal_lm, through the module
    out = linear_head_loss(hidden, emb.weight, ids, spec, shift=True,
                           chunk_bytes=chunk_bytes_for(4, vocab, dtype), backend="triton")
    objective(out).backward()

    w64 = emb.weight.detach().double().requires_grad_()
    ref = reference_head_loss(F.linear(tiny_causal_lm(ids, w64, mix.double()), w64), hf_shift(ids), spec)
    objective(ref).backward()
    # the head path alone, to show the embedding path contributes
    head_only = w64.detach().clone().requires_grad_()
    objective(reference_head_loss(
        F.linear(tiny_causal_lm(ids, w64.detach(), mix.double()), head_only), hf_shift(ids), spec
    )).backward()

    tol = TOLS[dtype]
    assert_close_norm(out.loss, ref.loss, rtol=tol.value_rtol, atol=1e-6, name="loss")
    assert emb.weight.grad.dtype == dtype
    assert_close_norm(emb.weight.grad, w64.grad, rtol=tol.grad_rtol, atol=GRAD_ATOL, name="d embedding")
    assert float((w64.grad - head_only.grad).norm()) > 0.1 * float(w64.grad.norm())


# --- ignored rows ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_compact_and_full_rows_give_the_same_values_and_gradients(dtype, mode, chunk_log):
    spec, vocab = MODES[mode], 37
    seed = seed_of("compact", dtype, mode)
    hidden, weight, bias = make_head((9,), 8, vocab, dtype, seed)
    targets = make_targets((9,), vocab, seed)
    targets[torch.tensor([1, 2, 5, 8])] = -100
    chunk = chunk_bytes_for(2, vocab, dtype)
    compact = run_linear(hidden, weight, bias, targets, spec, chunk_bytes=chunk, compact=True)
    compact_chunks = list(chunk_log["forward"])
    full = run_linear(hidden, weight, bias, targets, spec, chunk_bytes=chunk, compact=False)
    full_chunks = chunk_log["forward"][len(compact_chunks):]
    ahead = run_linear(hidden, weight, bias, targets, spec, chunk_bytes=chunk, compact=scored_rows(targets))
    ahead_chunks = chunk_log["forward"][len(compact_chunks) + len(full_chunks):]
    assert_matches_reference(compact)
    assert_matches_reference(full)
    # compact computes only the 5 non-ignored rows (so do the rows found ahead); full runs all 9
    assert [s[0] for s in compact_chunks] == [2, 2, 1] == [s[0] for s in ahead_chunks]
    assert [s[0] for s in full_chunks] == [2, 2, 2, 2, 1]
    for name in ("loss", *FLOAT_OUTPUTS):  # the same computation: the same bits
        assert torch.equal(getattr(compact.out, name), getattr(ahead.out, name)), name
    for name in GRAD_NAMES:
        assert torch.equal(compact.grad(name), ahead.grad(name)), f"d {name}"
    # both match the reference; against each other, up to GEMMs of other shapes (bf16: rounding of the logits)
    close = 1e-6 if dtype == F32 else 5e-3
    for name in ("loss", *FLOAT_OUTPUTS):
        a, b = getattr(compact.out, name), getattr(full.out, name)
        assert torch.allclose(a, b, rtol=close, atol=close), name
    if dtype == F32:
        assert torch.equal(compact.out.predicted_tokens, full.out.predicted_tokens)
    for name in GRAD_NAMES:
        rtol = 1e-5 if dtype == F32 else 2e-2
        assert_close_norm(compact.grad(name), full.grad(name), rtol=rtol, atol=0, name=f"d {name}")
    ignored = targets == -100
    for run in (compact, full):
        assert torch.all(run.grad("hidden")[ignored] == 0)
        assert torch.all(run.out.predicted_tokens[ignored] == -1)
        for name in FLOAT_OUTPUTS:
            assert torch.all(getattr(run.out, name)[ignored] == 0), name


@pytest.mark.parametrize("ahead", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["nonzero", "scored_rows"])
def test_a_few_ignored_rows_are_computed_rather_than_gathered_out(ahead, chunk_log):
    # COMPACT_MIN_SHARE: 1 ignored row of 70 (under 1/64) stays in; 2 (over it) are skipped
    assert 1 < 70 * headloss.linear.COMPACT_MIN_SHARE < 2
    hidden, weight, bias = make_head((70,), 8, 37, F32, 21)
    for ignored, chunks in ((1, [32, 32, 6]), (2, [32, 32, 4])):
        chunk_log["forward"].clear()
        targets = make_targets((70,), 37, seed=ignored)
        targets[torch.arange(ignored) * 31 + 5] = -100
        run = run_linear(hidden, weight, bias, targets, LossSpec(), chunk_bytes=chunk_bytes_for(32, 37, F32),
                         compact=scored_rows(targets) if ahead else True)
        assert [s[0] for s in chunk_log["forward"]] == chunks
        assert_matches_reference(run)
        assert torch.all(run.grad("hidden")[targets == -100] == 0)


@pytest.mark.parametrize("compact", [True, False, "ahead"], ids=["compact", "full_rows", "scored_rows"])
@pytest.mark.parametrize("mode", list(MODES))
def test_all_ignored_batch_gives_zero_loss_and_zero_gradients(mode, compact):
    spec = MODES[mode]
    hidden, weight, bias = make_head((2, 3), 8, 37, F32, 3)
    targets = torch.full((2, 3), -100)
    compact = scored_rows(targets) if compact == "ahead" else compact
    run = run_linear(hidden, weight, bias, targets, spec, compact=compact, chunk_bytes=chunk_bytes_for(2, 37, F32))
    assert float(run.out.loss.detach()) == 0.0
    assert int(run.out.metrics["n_tokens"]) == 0
    assert torch.all(run.out.predicted_tokens == -1)
    for name in FLOAT_OUTPUTS:
        assert torch.all(getattr(run.out, name) == 0), name
    for name in GRAD_NAMES:
        assert run.grad(name) is not None and torch.all(run.grad(name) == 0), name
    assert_values_match(run)


@pytest.fixture
def nan_filled_empty(monkeypatch):
    """torch.empty / empty_like inside headloss.linear and headloss.chunks return NaN-filled tensors, so a buffer read
    before it is written (the first chunk's dW and db, dh rows) shows up as NaN."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    class PoisonedTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return fill(real_empty(*args, **kwargs))

        @staticmethod
        def empty_like(*args, **kwargs):
            return fill(real_empty_like(*args, **kwargs))

    for module in (headloss.linear, headloss.chunks):  # the chunk loop and its gradient buffers
        monkeypatch.setattr(module, "torch", PoisonedTorch())


# the fast tier: every pair of dtype, mode and layout (each mode's buffers compact and full-rows)
@pytest.mark.parametrize("dtype, mode, compact", tiered([F32, BF16], list(MODES), [True, False],
                                                        ids=[["fp32", "bf16"], list(MODES), ["compact", "full_rows"]]))
def test_uninitialised_gradient_buffers_are_overwritten_before_use(nan_filled_empty, dtype, mode, compact):
    hidden, weight, bias = make_head((7,), 16, 37, dtype, 11)
    targets = make_targets((7,), 37, 12)
    targets[[0, 4]] = -100  # the first row too: a skipped row must not start the accumulation
    for rows in (1, 3, 64):  # first chunk = everything, or followed by accumulating chunks
        run = run_linear(hidden, weight, bias, targets, MODES[mode], compact=compact,
                         chunk_bytes=chunk_bytes_for(rows, 37, dtype))
        assert_nontrivial(run)
        assert_matches_reference(run)
    empty = run_linear(hidden, weight, bias, torch.full((7,), -100), MODES[mode], compact=compact)
    for name in GRAD_NAMES:
        assert torch.all(empty.grad(name) == 0), name


def test_empty_batch_gives_zero_loss_and_empty_gradients():
    hidden, weight, bias = make_head((0,), 8, 37, F32, 4)
    run = run_linear(hidden, weight, bias, torch.zeros(0, dtype=torch.long), FUSED)
    assert float(run.out.loss.detach()) == 0.0
    assert run.grad("hidden").shape == (0, 8)
    assert torch.all(run.grad("weight") == 0) and torch.all(run.grad("bias") == 0)


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full_rows"])
@pytest.mark.parametrize("ignore_index", [-1, 3], ids=["minus_one", "in_vocab_id_3"])
def test_custom_ignore_index_skips_its_rows(ignore_index, compact):
    spec = with_(FUSED, ignore_index=ignore_index)
    seed = seed_of("custom_ignore", ignore_index, compact)
    hidden, weight, bias = make_head((8,), 8, 37, F32, seed)
    targets = make_targets((8,), 37, seed, ignore_frac=0.4, ignore_index=ignore_index)
    targets[0] = 4
    targets[6] = -100  # with a custom ignore_index, -100 is an out-of-range id, not ignored
    with pytest.raises(ValueError, match="^targets"):
        linear_head_loss(hidden, weight, targets, spec, bias=bias, compact=compact, backend="triton")
    targets[6] = ignore_index
    run = run_linear(hidden, weight, bias, targets, spec, compact=compact, chunk_bytes=chunk_bytes_for(3, 37, F32))
    assert_matches_reference(run)
    assert_nontrivial(run)
    ignored = targets == ignore_index
    assert int(run.out.metrics["n_tokens"]) == int((~ignored).sum())
    assert torch.all(run.grad("hidden")[ignored] == 0)


# --- reductions, denominators, upstream gradients -----------------------------------------------


@pytest.mark.parametrize("kind", ["int", "tensor"])
@pytest.mark.parametrize("mode", list(MODES))
def test_num_items_in_batch_divides_the_summed_loss(mode, kind):
    seed = seed_of("num_items", mode, kind)
    hidden, weight, bias = make_head((2, 4), 8, 37, F32, seed)
    targets = make_targets((2, 4), 37, seed, ignore_frac=0.25)
    num_items = 13 if kind == "int" else torch.tensor(13.0)
    run = run_linear(hidden, weight, bias, targets, MODES[mode], num_items_in_batch=num_items,
                     chunk_bytes=chunk_bytes_for(3, 37, F32))
    assert_matches_reference(run)
    assert_nontrivial(run)
    assert torch.allclose(run.out.loss, run.out.token_loss.sum() / 13, rtol=1e-6)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_differentiable_logprobs_and_entropy_objective_gives_all_three_gradients(dtype, chunk_log):
    """Deferred mode: an RL-style objective on per-token outputs; backward recomputes each chunk."""
    spec = LossSpec(outputs=("logprobs", "entropy"), differentiable_outputs=True)
    seed = seed_of("rl", dtype)
    hidden, weight, bias = make_head((2, 4), 16, 67, dtype, seed)
    targets = make_targets((2, 4), 67, seed, ignore_frac=0.25)
    advantages = token_weights((2, 4), seed) - 1.0

    def objective(out):
        return -(out.logprobs * advantages.to(out.logprobs.dtype)).sum() - 0.01 * out.entropy.sum()

    run = run_linear(hidden, weight, bias, targets, spec, objective=objective,
                     chunk_bytes=chunk_bytes_for(3, 67, dtype))
    assert_matches_reference(run)
    assert_nontrivial(run)
    assert run.out.logprobs.requires_grad and run.out.entropy.requires_grad
    computed = int((targets != -100).sum())
    expected = [min(3, computed - s) for s in range(0, computed, 3)]
    assert [s[0] for s in chunk_log["forward"]] == expected
    assert [s[0] for s in chunk_log["backward"]] == expected
    assert not any(chunk_log["fused"])


def test_fp32_weight_grad_is_at_least_as_accurate_as_bf16_accumulation():
    """bf16 weights, one row per chunk: dW accumulated over 16 chunks in fp32 (rounded once) is at least as
    close to fp64 as accumulated in bf16, and equals the one-chunk dW up to that final rounding."""
    vocab, n = 37, 16
    hidden, weight, bias = make_head((n,), 16, vocab, BF16, 21)
    targets = make_targets((n,), vocab, 21)
    runs = {
        fp32: run_linear(hidden, weight, bias, targets, FUSED, fp32_weight_grad=fp32,
                         chunk_bytes=chunk_bytes_for(1, vocab, BF16))
        for fp32 in (False, True)
    }
    one_chunk = run_linear(hidden, weight, bias, targets, FUSED, requires=("weight",),
                           chunk_bytes=chunk_bytes_for(n, vocab, BF16)).grad("weight")
    want = runs[True].ref_leaves["weight"].grad
    for run in runs.values():
        assert run.grad("weight").dtype == BF16
        assert_matches_reference(run)

    def error(dw, wanted):
        return float((dw.double() - wanted.double()).norm() / wanted.double().norm())

    assert error(runs[True].grad("weight"), want) <= error(runs[False].grad("weight"), want)
    assert error(runs[True].grad("weight"), one_chunk) <= 1e-3  # measured: 0
    assert error(runs[False].grad("weight"), one_chunk) >= 2e-3  # measured: 4e-3, 16 bf16 roundings
    # only the dW accumulation differs
    assert torch.equal(runs[True].out.loss, runs[False].out.loss)
    assert torch.equal(runs[True].grad("hidden"), runs[False].grad("hidden"))
    assert torch.equal(runs[True].grad("bias"), runs[False].grad("bias"))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_upstream_gradient_other_than_one_scales_all_gradients(dtype, mode):
    seed = seed_of("upstream", dtype, mode)
    hidden, weight, bias = make_head((7,), 8, 37, dtype, seed)
    targets = make_targets((7,), 37, seed, ignore_frac=0.2)
    run = run_linear(hidden, weight, bias, targets, MODES[mode], upstream=2.5,
                     chunk_bytes=chunk_bytes_for(3, 37, dtype))
    assert_matches_reference(run)
    assert_nontrivial(run)


@pytest.mark.parametrize("mode", list(MODES))
def test_no_grad_forward_gives_the_same_values(mode):
    spec = MODES[mode]
    seed = seed_of("no_grad", mode)
    hidden, weight, bias = make_head((2, 4), 8, 37, F32, seed)
    targets = make_targets((2, 4), 37, seed, ignore_frac=0.25)
    kwargs = dict(bias=bias, chunk_bytes=chunk_bytes_for(3, 37, F32), backend="triton")
    with torch.no_grad():
        frozen = linear_head_loss(hidden.requires_grad_(), weight.requires_grad_(), targets, spec, **kwargs)
    live = linear_head_loss(hidden, weight, targets, spec, **kwargs)
    assert not frozen.loss.requires_grad and live.loss.requires_grad
    for name in ("loss", *ALL_OUTPUTS):
        a, b = getattr(frozen, name), getattr(live, name)
        assert not a.requires_grad
        assert torch.equal(a, b) if name == "predicted_tokens" else torch.allclose(a, b, rtol=1e-6, atol=1e-6), name
    for name, value in live.metrics.items():
        assert torch.allclose(frozen.metrics[name].double(), value.double(), rtol=1e-6, atol=1e-6), name


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("requires", [("weight",), ("hidden",), ("bias",), ("hidden", "bias")],
                         ids=["only_weight", "only_hidden", "only_bias", "hidden_and_bias"])
def test_gradient_only_for_inputs_that_require_it(requires, mode):
    seed = seed_of("requires", requires, mode)
    hidden, weight, bias = make_head((2, 3), 8, 37, F32, seed)
    targets = make_targets((2, 3), 37, seed, ignore_frac=0.2)
    run = run_linear(hidden, weight, bias, targets, MODES[mode], requires=requires,
                     chunk_bytes=chunk_bytes_for(4, 37, F32))
    assert_matches_reference(run)
    assert_nontrivial(run)


def test_strided_hidden_and_transposed_weight_match_reference():
    seed = seed_of("strided")
    hidden, _, bias = make_head((2, 6), 16, 37, F32, seed)
    weight_t = make_head((1,), 37, 16, F32, seed + 1, with_bias=False)[1]  # [H, V], used as .t()
    targets = make_targets((2, 5), 37, seed, ignore_frac=0.2)
    view = hidden[:, :-1]  # HF's logits[:, :-1] on the hidden side
    run = run_linear(view, weight_t.t(), bias, targets, FUSED, chunk_bytes=chunk_bytes_for(3, 37, F32))
    assert not run.leaves["weight"].is_contiguous()
    assert_matches_reference(run)
    assert_nontrivial(run)


def test_second_backward_through_fused_loss_raises_and_deferred_allows_it():
    hidden, weight, bias = make_head((5,), 8, 37, F32, 9)
    targets = make_targets((5,), 37, 9)
    h = hidden.requires_grad_()
    fused = linear_head_loss(h, weight, targets, FUSED, bias=bias, backend="triton")
    fused.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        fused.loss.backward()
    h.grad = None
    deferred = linear_head_loss(h, weight, targets, DEFERRED, bias=bias, backend="triton")
    deferred.loss.backward(retain_graph=True)
    once = h.grad.clone()
    deferred.loss.backward()
    assert torch.allclose(h.grad, 2 * once, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", list(MODES))
def test_reference_backend_matches_triton_backend(mode):
    spec = MODES[mode]
    seed = seed_of("backend", mode)
    hidden, weight, bias = make_head((2, 4), 8, 37, F32, seed)
    targets = make_targets((2, 4), 37, seed, ignore_frac=0.25)
    outs, grads = {}, {}
    for backend in ("triton", "torch"):
        w = weight.clone().requires_grad_()
        outs[backend] = linear_head_loss(hidden, w, targets, spec, bias=bias, shift=True, backend=backend)
        default_objective(spec, (2, 4))(outs[backend]).backward()
        grads[backend] = w.grad
    for name in ("loss", "logprobs", "lse", "token_loss", "entropy"):
        assert torch.allclose(getattr(outs["triton"], name), getattr(outs["torch"], name), rtol=1e-5, atol=1e-5)
    assert torch.equal(outs["triton"].predicted_tokens, outs["torch"].predicted_tokens)
    assert_close_norm(grads["triton"], grads["torch"], rtol=1e-5, atol=GRAD_ATOL, name="d weight")


# --- the module form ----------------------------------------------------------------------------


def test_module_form_equals_the_function():
    seed = seed_of("module")
    hidden, weight, bias = make_head((2, 4), 8, 37, F32, seed)
    targets = make_targets((2, 4), 37, seed, ignore_frac=0.25)
    options = dict(chunk_bytes=chunk_bytes_for(3, 37, F32), backend="triton")
    module = LinearHeadLoss({"z_loss": {"weight": 1e-2}, "outputs": ["token_loss"]}, **options)
    assert module.spec == LossSpec(z_loss=ZLoss(weight=1e-2), outputs=("token_loss",))
    w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    got = module(hidden, w1, targets, bias=bias, num_items_in_batch=5, shift=True)
    want = linear_head_loss(hidden, w2, targets, module.spec, bias=bias, num_items_in_batch=5, shift=True, **options)
    got.loss.backward()
    want.loss.backward()
    assert torch.equal(got.loss, want.loss)
    assert torch.equal(got.token_loss, want.token_loss)
    assert torch.equal(w1.grad, w2.grad)


def test_module_with_default_spec_is_mean_cross_entropy():
    hidden, weight, _ = make_head((6,), 8, 37, F32, 2, with_bias=False)
    targets = make_targets((6,), 37, 2)
    got = LinearHeadLoss(backend="triton")(hidden, weight, targets)
    want = F.cross_entropy(F.linear(hidden.double(), weight.double()), targets)
    assert abs(float(got.loss) - float(want)) <= 1e-5 * float(want)


def test_chunk_rows_fit_the_budget_with_at_least_one_row():
    assert chunk_rows_for(3 * 37 * 4, 37, 4) == 3
    assert chunk_rows_for(3 * 37 * 4 - 1, 37, 4) == 2
    assert chunk_rows_for(1, 128256, 2) == 1
    assert chunk_rows_for(256 << 20, 128256, 2) * 128256 * 2 <= 256 << 20
    # from 256 rows up, a multiple of the 128-row GEMM tile: 1046 -> 1024, 523 -> 512, 261 -> 256
    assert [chunk_rows_for(mib << 20, 128256, 2) for mib in (256, 128, 64, 40)] == [1024, 512, 256, 163]
    # from 1024 rows an even number of 128-row tiles (151936 words: 512 MiB holds 1766 rows, 1 GiB 3533)
    assert [chunk_rows_for(mib << 20, 151936, 2) for mib in (256, 384, 512, 1024)] == [768, 1280, 1536, 3328]
    assert chunk_rows_for(255 * 37 * 4, 37, 4) == 255


# --- errors ---------------------------------------------------------------------------------------

H, V = 8, 37


def _ok():
    return torch.randn(2, 3, H), torch.randn(V, H), torch.zeros(2, 3, dtype=torch.long)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(weight=torch.randn(V, H + 1)), ValueError, "^weight"),
        (dict(weight=torch.randn(V * H)), ValueError, "^weight"),
        (dict(weight=torch.randn(0, H)), ValueError, "^weight"),
        (dict(weight=torch.randn(V, H, dtype=BF16)), TypeError, "^weight"),
        (dict(weight=torch.randint(0, 3, (V, H))), TypeError, "^weight"),
        (dict(bias=torch.randn(V + 1)), ValueError, "^bias"),
        (dict(bias=torch.randn(1, V)), ValueError, "^bias"),
        (dict(bias=torch.randn(V, dtype=BF16)), TypeError, "^bias"),
        (dict(targets=torch.zeros(6, dtype=torch.long)), ValueError, "^targets"),
        (dict(targets=torch.zeros(2, 4, dtype=torch.long)), ValueError, "^targets"),
        (dict(targets=torch.zeros(2, 3)), TypeError, "^targets"),
        (dict(targets=torch.zeros(2, 3, dtype=torch.long, device="meta")), ValueError, "^targets"),
        (dict(targets=None), ValueError, "^targets"),
        (dict(hidden=torch.randint(0, 3, (2, 3, H))), TypeError, "^hidden"),
        (dict(hidden=torch.randn(2, 3, 1, H)), ValueError, "^hidden"),
        (dict(hidden=torch.randn(H)), ValueError, "^hidden"),
        (dict(hidden=[[0.0] * H]), TypeError, "^hidden"),
        (dict(num_items_in_batch=0), ValueError, "^num_items_in_batch"),
        (dict(backend="cuda"), ValueError, "^backend"),
    ],
    ids=[
        "weight_wrong_hidden_size", "weight_1d", "weight_empty_vocab", "weight_dtype_differs", "weight_integer",
        "bias_wrong_length", "bias_2d", "bias_dtype_differs",
        "targets_flat_for_3d_hidden", "targets_wrong_shape", "targets_float", "targets_other_device",
        "targets_missing_for_ce",
        "hidden_integer", "hidden_4d", "hidden_1d", "hidden_not_a_tensor",
        "num_items_zero", "backend_unknown",
    ],
)
def test_bad_inputs_raise_naming_the_argument(change, error, match):
    hidden, weight, targets = _ok()
    kwargs = dict(hidden=hidden, weight=weight, targets=targets, bias=None, backend="triton")
    kwargs.update(change)
    with pytest.raises(error, match=match):
        linear_head_loss(kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets"), **kwargs)


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full_rows"])
@pytest.mark.parametrize("bad", [V, -5], ids=["equal_to_vocab", "negative_not_ignore_index"])
def test_out_of_range_targets_raise_naming_targets_when_validated(bad, compact):
    hidden, weight, targets = _ok()
    targets[1, 2] = bad
    with pytest.raises(ValueError, match=rf"^targets: value {bad} at position \(1, 2\)"):
        linear_head_loss(hidden, weight, targets, compact=compact, backend="triton")


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full_rows"])
@pytest.mark.parametrize("mode", list(MODES))
def test_unvalidated_out_of_range_targets_give_nan_loss_not_a_crash(mode, compact):
    hidden, weight, targets = _ok()
    targets[0, 1] = V + 7
    h = hidden.requires_grad_()
    out = linear_head_loss(h, weight, targets, MODES[mode], validate=False, compact=compact, backend="triton")
    assert torch.isnan(out.loss)
    assert torch.isnan(out.token_loss[0, 1])
    assert torch.isfinite(out.token_loss[1]).all()
    out.loss.backward()
    assert torch.isfinite(h.grad[1]).all()


def test_float64_hidden_with_triton_backend_raises_naming_hidden():
    with pytest.raises(TypeError, match="^hidden"):
        linear_head_loss(torch.randn(4, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64),
                         torch.zeros(4, dtype=torch.long), backend="triton")


@needs_kernel
def test_autocast_runs_the_gemms_in_its_dtype_with_a_float64_teacher_read_as_float32():
    """Under torch.autocast the student's GEMMs run in bf16, so float64 teacher logits are read as their
    float32 copy (the precision the kernel computes the divergence in), as with a bf16 student."""
    gen = torch.Generator().manual_seed(31)
    hidden = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(37, 8, generator=gen, dtype=torch.float64)
    teacher = torch.randn(5, 37, generator=gen, dtype=torch.float64)
    targets = make_targets((5,), 37, 31)
    spec = LossSpec(distillation={"divergence": "forward_kl"})
    with torch.autocast("cpu", torch.bfloat16):
        got = linear_head_loss(hidden, weight, targets, spec, teacher_logits=teacher, backend="triton")
    want = linear_head_loss(hidden.bfloat16(), weight.bfloat16(), targets, spec, teacher_logits=teacher.float(),
                            backend="triton")
    assert got.route == want.route == "lm_head:fused"
    assert torch.equal(got.loss, want.loss)
    assert torch.equal(got.metrics["distill/divergence"], want.metrics["distill/divergence"])


def test_the_weight_gradient_gemm_setting_is_checked_and_names_quack_when_it_is_missing(monkeypatch):
    """HEADLOSS_DW_GEMM takes auto, cublas or quack (an error naming it otherwise, at import); with quack asked
    for and quack-kernels not importable, the first accumulation raises naming the setting; CPU chunks keep
    torch's addmm whatever the setting."""
    import subprocess
    import sys

    from headloss import dw_gemm

    done = subprocess.run([sys.executable, "-c", "import headloss"], capture_output=True, text=True,
                          env={**__import__("os").environ, "HEADLOSS_DW_GEMM": "cutlass"}, timeout=120)
    assert done.returncode != 0
    assert "HEADLOSS_DW_GEMM: expected 'auto', 'cublas' or 'quack', got 'cutlass'" in done.stderr
    gen = torch.Generator().manual_seed(3)
    g, h = torch.randn(5, 7, generator=gen), torch.randn(5, 3, generator=gen)
    dw = torch.randn(7, 3, generator=gen)
    for impl in dw_gemm.DW_GEMM_IMPLS:
        monkeypatch.setitem(dw_gemm.DW_GEMM, "impl", impl)
        want = dw + g.t() @ h
        dw_gemm.add_dw(dw, g, h)  # (a CPU chunk: torch's addmm)
        torch.testing.assert_close(dw, want)
    monkeypatch.setitem(dw_gemm.DW_GEMM, "impl", "cutlass")
    with pytest.raises(ValueError, match=r"dw_gemm.DW_GEMM\['impl'\]: expected one of auto, cublas, quack, got 'cutl"):
        dw_gemm.add_dw(dw, g, h)
    dw_gemm.quack_gemm_add.cache_clear()
    try:
        import quack.gemm_interface  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="HEADLOSS_DW_GEMM=quack .dw_gemm.DW_GEMM.: quack-kernels is not"):
            dw_gemm.quack_gemm_add(9)


def test_the_weight_gradient_gemm_is_auto_unless_the_environment_says_otherwise():
    import os

    from headloss import dw_gemm, env

    assert env.DW_GEMM == (os.environ.get("HEADLOSS_DW_GEMM", "").strip().lower() or "auto")
    assert dw_gemm.DW_GEMM["impl"] == env.DW_GEMM


def _on_a_pretend_hopper(monkeypatch, dw_gemm, kernel):
    """CPU chunks taken through quack's path: ``kernel`` stands in for quack's add, the device is a Hopper, quack
    runs where no earlier call failed (quack_runs' CUDA-only checks skipped)."""
    import contextlib

    monkeypatch.setattr(dw_gemm, "quack_gemm_add", lambda major: kernel)
    monkeypatch.setattr(dw_gemm, "QUACK_FAILED", {})
    monkeypatch.setattr(dw_gemm, "quack_runs", lambda impl, dw, g, h: g.device.index not in dw_gemm.QUACK_FAILED)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


def test_a_quack_call_that_raises_hands_auto_to_cublas_with_a_warning_and_raises_when_asked_for(monkeypatch):
    """Under auto a quack kernel that fails (here: raises before touching dW) is warned about once, its device
    recorded so that later accumulations skip quack, and add_dw's cuBLAS path takes each chunk (dW as addmm
    gives it); with quack asked for explicitly the error propagates, and running out of memory always does."""
    import warnings

    from headloss import dw_gemm

    failure = [RuntimeError("no kernel image for this device")]

    def broken(a, b, out):
        raise failure[0]

    _on_a_pretend_hopper(monkeypatch, dw_gemm, broken)
    monkeypatch.setitem(dw_gemm.DW_GEMM, "impl", "auto")
    gen = torch.Generator().manual_seed(5)
    g, h, dw = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen), torch.randn(6, 3, generator=gen)
    want = dw + 2 * (g.t() @ h)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dw_gemm.add_dw(dw, g, h)
        dw_gemm.add_dw(dw, g, h)
    assert [str(w.message) for w in seen] == [
        "headloss: quack-kernels' weight-gradient GEMM failed on cpu (RuntimeError: no kernel image for this "
        "device); its accumulations run on cuBLAS from now on (HEADLOSS_DW_GEMM=cublas says so without trying "
        "quack)"]
    torch.testing.assert_close(dw, want)
    assert dw_gemm.QUACK_FAILED == {None: "RuntimeError: no kernel image for this device"}
    monkeypatch.setattr(dw_gemm, "QUACK_FAILED", {})
    with pytest.raises(RuntimeError, match="no kernel image"):
        dw_gemm.quack_add("quack", dw, g, h)
    failure[0] = torch.cuda.OutOfMemoryError("out of memory")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        dw_gemm.quack_add("auto", dw, g, h)
    assert dw_gemm.QUACK_FAILED == {}


def test_quack_runs_at_the_pinned_config_on_hopper_and_at_its_own_default_elsewhere(monkeypatch):
    """quack_gemm_add against a stand-in quack-kernels: on Hopper the autotuner's wrapped GEMM is called with
    QUACK_CONFIG (keywords, C None, beta 1, added to out); on another arch, or where that function lacks the
    config argument, the public gemm_add_inplace untuned; a config the package refuses is an ImportError naming
    the setting."""
    import sys
    import types

    from headloss import dw_gemm

    calls = []

    class GemmConfig:
        def __init__(self, **fields):
            if "tile_m" not in fields:
                raise TypeError("missing tile_m")
            self.fields = fields

    def fn(A, B, out, C=None, alpha=1.0, beta=1.0, add_to_output=False, config=None):
        calls.append(("pinned", A, B, out, C, alpha, beta, add_to_output, config.fields))

    def gemm_add_inplace(A, B, out, tuned=True):
        calls.append(("public", A, B, out, tuned))

    tuned = types.SimpleNamespace(fn=fn)
    package = types.ModuleType("quack")
    config_module = types.ModuleType("quack.gemm_config")
    config_module.GemmConfig = GemmConfig
    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm_add_inplace, interface.gemm_tuned = gemm_add_inplace, tuned
    monkeypatch.setitem(sys.modules, "quack", package)
    monkeypatch.setitem(sys.modules, "quack.gemm_config", config_module)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", interface)
    dw_gemm.quack_gemm_add.cache_clear()
    try:
        a, b, out = object(), object(), object()
        dw_gemm.quack_gemm_add(9)(a, b, out)
        dw_gemm.quack_gemm_add(10)(a, b, out)
        tuned.fn = lambda A, B, out: None  # (no config argument)
        dw_gemm.quack_gemm_add.cache_clear()
        dw_gemm.quack_gemm_add(9)(a, b, out)
        assert calls == [("pinned", a, b, out, None, 1.0, 1.0, True, dw_gemm.QUACK_CONFIG),
                         ("public", a, b, out, False), ("public", a, b, out, False)]
        tuned.fn = fn
        monkeypatch.setattr(dw_gemm, "QUACK_CONFIG", {"tile_rows": 128})
        dw_gemm.quack_gemm_add.cache_clear()
        with pytest.raises(ImportError, match="HEADLOSS_DW_GEMM=quack .dw_gemm.DW_GEMM.: quack-kernels is not "
                                              "importable .missing tile_m."):
            dw_gemm.quack_gemm_add(9)
    finally:
        dw_gemm.quack_gemm_add.cache_clear()


@pytest.mark.parametrize("case", ["fits", "fp32 dW", "fp32 g", "fp16 h beside bf16 g", "odd vocabulary",
                                  "odd hidden", "h off 16 bytes", "g off 16 bytes", "dW off 16 bytes",
                                  "h columns strided", "g columns strided", "h rows expanded", "no rows",
                                  "dW transposed"])
def test_quack_takes_only_operands_its_tma_loads_can_read(case):
    """dw_gemm.quack_fits, which auto and quack ask before sending an accumulation to quack (its TMA loads need
    16-bit operands with unit-stride rows, 16-byte row strides and addresses; dW contiguous, 16-bit or fp32)."""
    from headloss.dw_gemm import quack_fits

    bf = torch.bfloat16
    g = torch.randn(40, 64).to(bf)  # [K rows, V]
    big_h = torch.randn(41, 48).to(bf)
    h = big_h[:40]  # [K, H]
    dw = torch.randn(64, 48).to(bf)
    want = case in ("fits", "fp32 dW")
    if case == "fp32 dW":
        dw = dw.float()
    elif case == "fp32 g":
        g = g.float()
    elif case == "fp16 h beside bf16 g":
        h = h.half()
    elif case == "odd vocabulary":
        g, dw = torch.randn(40, 63).to(bf), dw[:63]  # (rows of 63 words: a 126-byte row stride)
    elif case == "odd hidden":
        h, dw = torch.randn(40, 44).to(bf)[:, :43], dw[:, :43].contiguous()
    elif case == "h off 16 bytes":
        h = big_h.view(-1)[1:1 + 40 * 48].view(40, 48)
    elif case == "g off 16 bytes":
        g = torch.randn(40 * 64 + 1).to(bf)[1:].view(40, 64)
    elif case == "dW off 16 bytes":
        dw = torch.randn(64 * 48 + 1).to(bf)[1:].view(64, 48)
    elif case == "h columns strided":
        h = torch.randn(40, 96).to(bf)[:, ::2]
    elif case == "g columns strided":
        g = torch.randn(40, 128).to(bf)[:, ::2]
    elif case == "h rows expanded":
        h = torch.randn(1, 48).to(bf).expand(40, 48)
    elif case == "no rows":
        g, h = g[:0], h[:0]
    elif case == "dW transposed":
        dw = torch.randn(48, 64).to(bf).t()
    assert quack_fits(dw, g, h) is want
