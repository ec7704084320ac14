"""Packed sequences (headloss.packed): rows [N, ...] with cu_seqlens or position_ids equal, value,
gradient and metrics, the padded [S, T] call on the same tokens -- on both paths, every route the
packed call can take, the logits and the fused lm_head. The padded call is built here by hand from
the boundaries (the definition), not by headloss."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close_norm, generator, needs_kernel, tiered
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headloss
from headloss import LossSpec, head_loss
from headloss.spec import CrossEntropy, Entropy, Policy, ZLoss

V, H = 37, 8
LENGTHS = [5, 1, 0, 7, 3]  # a sequence of one row (never scored under shift) and one of none


def packed_case(lengths, seed, vocab=V, per_sequence_adv=True, dtype=torch.float32):
    """Packed rows and the same tokens padded to [S, T]: (packed, padded, where) -- dicts of the calls'
    tensors, and the padded (sequence, position) of each packed row."""
    gen = generator(seed)
    lengths = list(lengths)
    n, s = sum(lengths), len(lengths)
    t = max(max(lengths, default=0), 1)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32) if s else \
        torch.zeros(1, dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(s), torch.tensor(lengths, dtype=torch.long))
    pos = torch.cat([torch.arange(length) for length in lengths]) if n else torch.zeros(0, dtype=torch.long)
    logits = (torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 3).to(dtype)
    ids = torch.randint(0, vocab, (n,), generator=gen)
    mask = (torch.rand(n, generator=gen) > 0.25).long()
    logp = torch.log_softmax(logits.double(), -1)
    lp = logp.gather(-1, torch.cat([ids[1:], ids[:1]])[:, None])[:, 0]  # near the model's own log-probs
    old = lp + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    adv = torch.randn(s if per_sequence_adv else n, generator=gen, dtype=torch.float64)
    hidden = torch.randn(n, H, generator=gen, dtype=torch.float64).to(dtype)

    def pad(x, fill=0):
        out = torch.full((s, t) + tuple(x.shape[1:]), fill, dtype=x.dtype)
        out[seq, pos] = x
        return out

    packed = dict(logits=logits, targets=ids, advantages=(adv[:, None] if per_sequence_adv else adv).float(),
                  old_logprobs=old.float(),
                  ref_logprobs=ref.float(), loss_mask=mask, hidden=hidden, cu_seqlens=cu,
                  position_ids=pos[None].clone())
    padded = dict(logits=pad(logits, 0.5), targets=pad(ids, -100), advantages=(adv if per_sequence_adv else pad(adv))
                  .float(), old_logprobs=pad(old).float(), ref_logprobs=pad(ref).float(), loss_mask=pad(mask),
                  hidden=pad(hidden, 0.25))
    return packed, padded, (seq, pos)


POLICY_INPUTS = ("advantages", "old_logprobs", "ref_logprobs", "loss_mask")


def run(inputs, spec, backend, packed_by=None, route=None, entry="logits"):
    """(out, d rows) of one call; ``packed_by``: 'cu_seqlens' or 'position_ids' (else the padded call)."""
    kwargs = {name: inputs[name] for name in POLICY_INPUTS if name != "ref_logprobs" or spec.policy.kl_beta} \
        if spec.policy is not None else {}
    if packed_by is not None:
        kwargs[packed_by] = inputs[packed_by]
    if entry == "logits":
        leaf = inputs["logits"].detach().clone().requires_grad_()
        out = head_loss(leaf, inputs["targets"], spec, shift=True, backend=backend, route=route, **kwargs)
    else:
        leaf = inputs["hidden"].detach().clone().requires_grad_()
        vocab = inputs["logits"].shape[-1]
        weight = (torch.randn(vocab, H, generator=generator(99), dtype=torch.float64) / 2).to(leaf)
        out = headloss.linear_head_loss(leaf, weight, inputs["targets"], spec, shift=True, backend=backend,
                                        route=route, chunk_bytes=5 * vocab * 4, **kwargs)
    if out.loss.requires_grad:
        out.loss.backward()
    return out, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def assert_equal_calls(packed_out, padded_out, where, rtol=1e-5):
    (p_out, p_grad), (q_out, q_grad) = packed_out, padded_out
    seq, pos = where
    assert_close_norm(p_out.loss, q_out.loss, rtol=rtol, atol=1e-6, name="loss")
    assert_close_norm(p_grad.double(), q_grad[seq, pos].double(), rtol=rtol * 10, atol=1e-7, name="grad")
    rest = q_grad.clone()
    rest[seq, pos] = 0
    assert float(rest.abs().max()) == 0.0 if rest.numel() else True  # padding rows: no gradient
    assert set(p_out.metrics) == set(q_out.metrics)
    for name, value in q_out.metrics.items():
        assert_close_norm(p_out.metrics[name], value, rtol=rtol, atol=1e-6, name=name)


SPECS = {
    "sft": LossSpec(cross_entropy=CrossEntropy(label_smoothing=0.1), z_loss=ZLoss(weight=1e-3), entropy=Entropy()),
    "grpo-dapo": LossSpec(cross_entropy=None, policy=Policy(loss_type="dapo", kl_beta=0.05)),
    "grpo-grpo": LossSpec(cross_entropy=None, policy=Policy(loss_type="grpo", entropy_coef=0.02)),
    "gspo": LossSpec(cross_entropy=None, policy=Policy(importance_sampling="sequence", loss_type="grpo",
                                                       eps_low=0.05, eps_high=0.05)),
    "verl-gspo": LossSpec(cross_entropy=None, policy=Policy(importance_sampling="sequence_token", convention="verl",
                                                            loss_type="seq-mean-token-mean")),
    "gmpo": LossSpec(cross_entropy=None, policy=Policy(objective="gmpo", loss_type="seq-mean-token-mean")),
    "vespo": LossSpec(cross_entropy=None, policy=Policy(objective="vespo", loss_type="grpo")),
    "off-policy": LossSpec(cross_entropy=None, policy=Policy(off_policy_mask=0.05, loss_type="dr_grpo",
                                                             max_completion_length=9)),
    "verl-sum-norm": LossSpec(cross_entropy=None, policy=Policy(convention="verl",
                                                                loss_type="seq-mean-token-sum-norm")),
    "seq-mean-token-sum": LossSpec(cross_entropy=CrossEntropy(weight=0.5),
                                   policy=Policy(objective="cispo", convention="verl", loss_type="seq-mean-token-sum")),
}


@needs_kernel
@pytest.mark.parametrize("name, packed_by, backend", tiered(
    list(SPECS), ["cu_seqlens", "position_ids"], ["triton", "torch"]))
def test_packed_rows_equal_the_padded_call(name, packed_by, backend):
    spec = SPECS[name]
    lengths = [length for length in LENGTHS if length] if packed_by == "position_ids" else LENGTHS
    packed, padded, where = packed_case(lengths, seed=len(name), per_sequence_adv=packed_by == "cu_seqlens")
    want = run(padded, spec, backend)
    got = run(packed, spec, backend, packed_by)
    assert_equal_calls(got, want, where)


@needs_kernel
@pytest.mark.parametrize("name", ["sft", "grpo-dapo", "gspo", "gmpo"])
def test_packed_lm_head_equals_the_padded_call(name):
    spec = SPECS[name]
    packed, padded, where = packed_case(LENGTHS, seed=5)
    want = run(padded, spec, "triton", entry="hidden")
    got = run(packed, spec, "triton", "cu_seqlens", entry="hidden")
    assert_equal_calls(got, want, where)


@needs_kernel
@pytest.mark.parametrize("lengths", [[4, 0, 6], [1, 1]], ids=["S<N", "S=N"])
def test_advantages_per_sequence_as_s_or_s_by_1(lengths):
    """[S, 1] is one advantage per sequence; so is [S] unless S = N, where [N] is one per row."""
    spec = SPECS["grpo-grpo"]
    packed, padded, where = packed_case(lengths, seed=11)
    want = run(padded, spec, "triton")
    flat = dict(packed, advantages=packed["advantages"][:, 0])
    if len(lengths) != sum(lengths):
        assert_equal_calls(run(flat, spec, "triton", "cu_seqlens"), want, where)
    else:  # read per row: the padded call with those values per token
        per_row = dict(padded, advantages=torch.zeros_like(padded["old_logprobs"]))
        per_row["advantages"][where] = flat["advantages"]
        assert_equal_calls(run(flat, spec, "triton", "cu_seqlens"), run(per_row, spec, "triton"), where)


@needs_kernel
def test_one_sequence_and_a_single_row():
    spec = SPECS["grpo-grpo"]
    for lengths in ([9], [1], [1, 1, 4]):
        packed, padded, where = packed_case(lengths, seed=sum(lengths))
        assert_equal_calls(run(packed, spec, "triton", "cu_seqlens"), run(padded, spec, "triton"), where)


@pytest.mark.slow
@needs_kernel
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=12), name=st.sampled_from(sorted(SPECS)),
       seed=st.integers(0, 10_000), per_sequence_adv=st.booleans())
def test_random_boundaries_equal_the_padded_call(lengths, name, seed, per_sequence_adv):
    if sum(lengths) == 0:
        lengths = lengths + [2]
    packed, padded, where = packed_case(lengths, seed, per_sequence_adv=per_sequence_adv)
    spec = SPECS[name]
    assert_equal_calls(run(packed, spec, "triton", "cu_seqlens"), run(padded, spec, "triton"), where)


def test_thousands_of_short_sequences():
    lengths = [1 + (i % 5) for i in range(2000)]
    packed, padded, where = packed_case(lengths, seed=3, vocab=11)
    spec = SPECS["grpo-grpo"]
    assert_equal_calls(run(packed, spec, "torch", "cu_seqlens"), run(padded, spec, "torch"), where)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("cu, message", [
    (torch.tensor([1, 5, 16], dtype=torch.int32), r"row count 16; cu_seqlens\[0\] = 1, not 0$"),
    (torch.tensor([0, 9, 5, 16]), r"row count 16; cu_seqlens\[2\] = 5 < cu_seqlens\[1\] = 9$"),
    (torch.tensor([0, 5, 15]), r"row count 16; cu_seqlens\[2\] = 15, the last, is not 16$"),
    (torch.tensor([0, 5, 16], dtype=torch.float32), "cu_seqlens"),  # not integer
    (torch.tensor([[0, 5, 16]]), "cu_seqlens"),  # not 1-D
    ([0, 5, 16], "cu_seqlens"),  # not a tensor
])
def test_bad_cu_seqlens_is_an_error_naming_it(backend, cu, message):
    packed, _, _ = packed_case(LENGTHS, seed=1)
    with pytest.raises(ValueError, match=message):
        head_loss(packed["logits"], packed["targets"], None, shift=True, cu_seqlens=cu, backend=backend,
                  validate="sync")


def test_packed_input_errors_name_the_argument():
    packed, _, _ = packed_case(LENGTHS, seed=1)
    logits, targets, cu = packed["logits"], packed["targets"], packed["cu_seqlens"]
    with pytest.raises(ValueError, match="targets"):
        head_loss(logits, targets[:-1], None, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        head_loss(logits[None].expand(2, -1, -1), targets, None, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        head_loss(logits, targets, None, cu_seqlens=cu, position_ids=packed["position_ids"])
    with pytest.raises(ValueError, match="position_ids"):
        head_loss(logits, targets, None, position_ids=packed["position_ids"][:, :-1])
    spec = SPECS["grpo-dapo"]
    inputs = {name: packed[name] for name in POLICY_INPUTS}
    with pytest.raises(ValueError, match="sequence_ids"):
        head_loss(logits, targets, spec, cu_seqlens=cu, sequence_ids=torch.zeros(len(targets), dtype=torch.long),
                  **inputs)
    with pytest.raises(ValueError, match="advantages"):
        head_loss(logits, targets, spec, position_ids=packed["position_ids"], **inputs)  # [S]: cu_seqlens only
    with pytest.raises(ValueError, match="advantages"):
        head_loss(logits, targets, spec, cu_seqlens=cu, **{**inputs, "advantages": inputs["advantages"][:-1]})


BAD_CU = torch.tensor([0, 8, 4, 12])
BAD_CU_MESSAGE = (r"^cu_seqlens: offsets must be non-decreasing from 0 to the row count 12; "
                  r"cu_seqlens\[2\] = 4 < cu_seqlens\[1\] = 8$")


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize("validate", [True, "sync"])
def test_bad_cu_seqlens_is_an_error_when_row_0_is_outside_loss_mask(entry, backend, validate):
    """The malformed layout is found whatever the masks say: loss_mask[0] = 0 turns row 0's target
    into ignore_index, which must not hide the mark that names cu_seqlens."""
    gen = generator(5)
    rows = int(BAD_CU[-1])
    logits = torch.randn(rows, V, generator=gen)
    hidden = torch.randn(rows, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    targets = torch.randint(0, V, (rows,), generator=gen)
    mask = torch.ones(rows, dtype=torch.long)
    mask[0] = 0
    inputs = dict(advantages=torch.randn(rows, generator=gen), old_logprobs=-torch.rand(rows, generator=gen),
                  loss_mask=mask, cu_seqlens=BAD_CU, backend=backend, validate=validate)
    spec = LossSpec(cross_entropy=None, policy=Policy())
    with pytest.raises(ValueError, match=BAD_CU_MESSAGE):
        if entry == "logits":
            head_loss(logits, targets, spec, **inputs)
        else:
            headloss.linear_head_loss(hidden, weight, targets, spec, **inputs)
    good = torch.tensor([0, 4, 8, 12])
    out = head_loss(logits, targets, spec, **{**inputs, "cu_seqlens": good}) if entry == "logits" else \
        headloss.linear_head_loss(hidden, weight, targets, spec, **{**inputs, "cu_seqlens": good})
    assert torch.isfinite(out.loss)


def test_a_bad_offset_too_large_for_the_mark_is_named_without_its_value():
    """The mark holds offsets within +-2**20; a larger one is named by its index alone."""
    rows = 12
    cu = torch.tensor([0, 2**30, rows])
    with pytest.raises(ValueError, match=r"row count 12; cu_seqlens\[2\] = 12 < cu_seqlens\[1\]$"):
        head_loss(torch.zeros(rows, V), torch.zeros(rows, dtype=torch.long), None, cu_seqlens=cu, backend="torch")
