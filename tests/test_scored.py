"""headloss.scored: a call's scored rows found ahead of it (``linear_head_loss(compact=scored_rows(...))``).

The index against an independent mask of the rows the call scores (hypothesis over shapes, shift
conventions and ignore patterns); the call given it against ``compact=True`` bit for bit (the same rows
computed), on both backends; that the call then takes no ``nonzero`` (the host sync it replaces); the
refusals, each naming its argument; the Hugging Face patch handing its head the rows it queued."""

from __future__ import annotations

import pytest
import torch
from conftest import make_targets, needs_kernel
from hypothesis import given
from hypothesis import strategies as st
from strategies import CI

import headloss
from headloss import LinearHeadLoss, LossSpec, ScoredRows, linear_head_loss, scored_rows

VOCAB = 37  # not a power of two


def expected_rows(targets: torch.Tensor, shift: bool, ignore_index: int, seq_len: int | None) -> torch.Tensor:
    """The rows a call scores, written out: row (b, t) scores labels[b, t + 1] (labels [B, T]) or ids[b, t]
    (completion ids [B, T - 1]); the last row of a sequence nothing. Targets read as int64 values (a uint8
    255 is 255, never -100 wrapped around)."""
    targets = targets.long()
    if not shift:
        return targets.reshape(-1) != ignore_index
    b, width = targets.shape
    seq_len = width if seq_len is None else seq_len
    scored = torch.zeros(b, seq_len, dtype=torch.bool)
    for i in range(b):
        for t in range(seq_len - 1):
            label = targets[i, t + 1] if width == seq_len else targets[i, t]
            scored[i, t] = bool(label != ignore_index)
    return scored.reshape(-1)


@st.composite
def layouts(draw):
    shift = draw(st.booleans())
    ignore_index = draw(st.sampled_from([-100, -1, 5]))
    if shift:
        b, seq_len = draw(st.integers(1, 3)), draw(st.integers(2, 9))
        completion = draw(st.booleans())
        shape = (b, seq_len - 1 if completion else seq_len)
    else:
        shape, seq_len, completion = draw(st.sampled_from([(1,), (7,), (2, 5), (3, 1)])), None, False
    share = draw(st.sampled_from([0.0, 0.4, 0.9]))  # of the rows set to ignore_index
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.uint8]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    targets = torch.randint(0, VOCAB, shape, generator=gen)
    if targets.numel():
        targets[torch.rand(shape, generator=gen) < share] = ignore_index
    if dtype == torch.uint8:  # the ignored ones wrap to ids (156, 255) that the call scores; some rows hold 156
        targets = targets.remainder(256).to(dtype)
        targets.view(-1)[::3] = 156
    return targets.to(dtype), shift, ignore_index, seq_len if completion else None


@CI
@given(layouts())
def test_the_index_is_the_rows_the_call_scores(layout):
    targets, shift, ignore_index, seq_len = layout
    rows = scored_rows(targets, shift=shift, ignore_index=ignore_index, seq_len=seq_len)
    want = expected_rows(targets, shift, ignore_index, seq_len)
    index = rows.index()
    assert rows.rows == want.numel()
    if bool(want.all()):
        assert index is None
    else:
        assert index.dtype == torch.int64
        assert torch.equal(index, want.nonzero().squeeze(1))


def _head(shape, hidden_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(VOCAB, hidden_size, generator=gen, dtype=torch.float64) * hidden_size ** -0.5 * 3).to(dtype)
    return hidden, weight


def _run(hidden, weight, targets, spec, **kwargs):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_head_loss(h, w, targets, spec, chunk_bytes=2 * VOCAB * hidden.element_size(), **kwargs)
    objective = out.loss if out.loss.dim() == 0 else out.loss.sum()
    objective.backward()
    return out, h.grad, w.grad


CASES = {  # (hidden rows, targets shape, shift, seq_len)
    "labels": ((2, 6), (2, 6), True, None),
    "completion_ids": ((2, 6), (2, 5), True, 6),
    "rows": ((9,), (9,), False, None),
}


@needs_kernel
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_call_with_the_rows_found_ahead_equals_compact(case, reduction):
    rows_shape, targets_shape, shift, seq_len = CASES[case]
    hidden, weight = _head(rows_shape, 8, torch.float32, 11)
    targets = make_targets(targets_shape, VOCAB, seed=3, ignore_frac=0.4)
    spec = LossSpec(reduction=reduction, outputs=("logprobs",), token_accuracy=True)
    compact, dh, dw = _run(hidden, weight, targets, spec, shift=shift, backend="triton")
    ahead = scored_rows(targets, shift=shift, seq_len=seq_len)
    mine, dh_mine, dw_mine = _run(hidden, weight, targets, spec, shift=shift, backend="triton", compact=ahead)
    assert torch.equal(mine.loss, compact.loss)
    assert torch.equal(mine.logprobs, compact.logprobs)
    assert torch.equal(mine.metrics["token_accuracy"], compact.metrics["token_accuracy"])
    assert torch.equal(dh_mine, dh) and torch.equal(dw_mine, dw)
    assert float(dh.abs().sum()) > 0


def test_the_torch_path_takes_a_fitting_handle_and_keeps_its_values():
    hidden, weight = _head((2, 6), 8, torch.float32, 12)
    targets = make_targets((2, 5), VOCAB, seed=13, ignore_frac=0.4)  # completion ids
    want, dh, dw = _run(hidden, weight, targets, None, shift=True, backend="torch")
    ahead = scored_rows(targets, shift=True, seq_len=6)
    mine, dh_mine, dw_mine = _run(hidden, weight, targets, None, shift=True, backend="torch", compact=ahead)
    assert torch.equal(mine.loss, want.loss) and torch.equal(dh_mine, dh) and torch.equal(dw_mine, dw)


@needs_kernel
def test_the_call_takes_no_nonzero_with_the_rows_found_ahead(monkeypatch):
    hidden, weight = _head((2, 6), 8, torch.float32, 5)
    targets = make_targets((2, 6), VOCAB, seed=4, ignore_frac=0.3)
    ahead = scored_rows(targets, shift=True)

    def refused(*args, **kwargs):
        raise AssertionError("nonzero called")

    monkeypatch.setattr(torch.Tensor, "nonzero", refused)
    _run(hidden, weight, targets, None, shift=True, compact=ahead)  # no nonzero: the index came ahead
    with pytest.raises(AssertionError, match="nonzero called"):
        _run(hidden, weight, targets, None, shift=True)  # compact=True counts the rows with nonzero


def test_the_module_form_takes_a_calls_rows():
    hidden, weight = _head((9,), 8, torch.float32, 6)
    targets = make_targets((9,), VOCAB, seed=6, ignore_frac=0.4)
    module = LinearHeadLoss(LossSpec(), backend="torch")
    plain = module(hidden, weight, targets)
    ahead = module(hidden, weight, targets, compact=scored_rows(targets))
    assert torch.equal(plain.loss, ahead.loss)
    with pytest.raises(ValueError, match="compact: the ScoredRows were made from another targets tensor"):
        module(hidden, weight, targets.clone(), compact=scored_rows(targets))


def _refusal(kind: str):
    """(call kwargs, the expected error's type and text) of one misuse."""
    targets = make_targets((2, 6), VOCAB, seed=8, ignore_frac=0.3)
    ahead = scored_rows(targets, shift=True)
    if kind == "other_targets":
        return dict(targets=targets.clone(), shift=True, compact=ahead), ValueError, "another targets tensor"
    if kind == "written_after":
        targets[0, 1] = -100
        return dict(targets=targets, shift=True, compact=ahead), ValueError, "written in place after"
    if kind == "shift":
        return dict(targets=targets, shift=False, compact=ahead), ValueError, "shift=True.*the call has shift=False"
    if kind == "ignore_index":
        spec = LossSpec(ignore_index=-1)
        return dict(targets=targets, shift=True, compact=ahead, spec=spec), ValueError, "ignore_index=-100.*-1"
    if kind == "seq_len":
        completion = targets[:, 1:].contiguous()
        rows = scored_rows(completion, shift=True)  # as labels of sequences of 5
        return dict(targets=completion, shift=True, compact=rows), ValueError, "pass seq_len="
    if kind == "packed":
        flat = targets.reshape(-1)
        return (dict(targets=flat, compact=scored_rows(flat), cu_seqlens=torch.tensor([0, 5, 12]), hidden_rows=(12,)),
                ValueError, "compact: ScoredRows cover unpacked rows")
    if kind == "not_a_handle":
        return dict(targets=targets, shift=True, compact=targets), TypeError, "compact: expected True, False or"
    raise ValueError(kind)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("kind", ["other_targets", "written_after", "shift", "ignore_index", "seq_len", "packed",
                                  "not_a_handle"])
def test_a_handle_for_other_targets_or_another_layout_is_refused_naming_compact(kind, backend):
    kwargs, error, text = _refusal(kind)
    hidden, weight = _head(kwargs.pop("hidden_rows", (2, 6)), 8, torch.float32, 9)
    targets, spec = kwargs.pop("targets"), kwargs.pop("spec", None)
    with pytest.raises(error, match=text):
        linear_head_loss(hidden, weight, targets, spec, backend=backend, **kwargs)


@pytest.mark.parametrize("args, kwargs, error, text", [
    ((torch.rand(4),), {}, TypeError, "targets: expected an integer torch.Tensor, got torch.float32"),
    (([1, 2],), {}, TypeError, "targets: expected an integer torch.Tensor, got list"),
    ((torch.arange(4),), {"shift": True}, ValueError, "targets: shift=True takes"),
    ((torch.zeros(2, 4, dtype=torch.long),), {"shift": True, "seq_len": 7}, ValueError, "seq_len: the targets'"),
    ((torch.arange(4),), {"seq_len": 4}, ValueError, "seq_len: only with shift=True"),
    ((torch.arange(4),), {"ignore_index": True}, TypeError, "ignore_index: expected an int"),
])
def test_scored_rows_refuses_bad_arguments_by_name(args, kwargs, error, text):
    with pytest.raises(error, match=text):
        scored_rows(*args, **kwargs)


def test_scored_rows_takes_narrow_int_labels_as_int64():
    # a shift pads with ignore_index (-100), which uint8 cannot hold: the labels are read as int64 first
    assert scored_rows(torch.zeros(2, 3, dtype=torch.uint8), shift=True).index() is not None


def test_public_names():
    assert headloss.scored_rows is scored_rows and headloss.ScoredRows is ScoredRows
    assert "ScoredRows(rows=12, shift=True" in repr(scored_rows(torch.zeros(2, 6, dtype=torch.long), shift=True))


@needs_kernel
def test_the_hf_patch_hands_its_head_the_rows_it_queued(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import headloss.integrations.transformers as hf

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).train()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    stock = model(input_ids=ids, labels=labels).loss
    seen = []
    real = hf.linear_head_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["compact"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "linear_head_loss", spy)
    with hf.patch(model, verify=False):
        mine = model(input_ids=ids, labels=labels).loss
    assert len(seen) == 1 and isinstance(seen[0], ScoredRows) and seen[0].targets is labels
    assert torch.equal(seen[0].index(), expected_rows(labels, True, -100, None).nonzero().squeeze(1))
    assert float(mine.detach()) == pytest.approx(float(stock.detach()), rel=1e-5)
    with hf.patch(model, verify=False, compact=False):  # every row computed: no rows queued
        every = model(input_ids=ids, labels=labels).loss
    assert seen[1:] == [False]
    assert float(every.detach()) == pytest.approx(float(stock.detach()), rel=1e-5)
    with pytest.raises(TypeError, match="compact: expected True or False"):
        hf.patch(model, verify=False, compact=seen[0])


@needs_kernel
@pytest.mark.parametrize("seq_len", [65, 64], ids=["T65-every-row", "T64-compacts"])
def test_the_hf_patch_queues_nothing_where_the_labels_are_the_input_ids(seq_len, monkeypatch):
    """labels=input_ids (the same tensor) leave only the shift's last row of each sequence unscored, 1 / T of the
    rows: below linear.COMPACT_MIN_SHARE (T > 64) the call would compute every row, so the patch queues no
    ScoredRows (whose count the head's call would wait for) and passes compact=False; at T = 64 that row is 1/64
    and is skipped, as before. Other labels, and a non-negative ignore_index (which a token id can equal), keep
    the handle."""
    transformers = pytest.importorskip("transformers")
    import headloss.integrations.transformers as hf
    from headloss.linear import COMPACT_MIN_SHARE

    assert COMPACT_MIN_SHARE == 1 / 64
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128)).train()
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(2))
    stock = model(input_ids=ids, labels=ids).loss
    seen = []
    real = hf.linear_head_loss
    monkeypatch.setattr(hf, "linear_head_loss", lambda *a, **k: seen.append(k["compact"]) or real(*a, **k))
    with hf.patch(model, verify=False):
        mine = model(input_ids=ids, labels=ids).loss
        model(input_ids=ids, labels=ids.clone())
    with hf.patch(model, LossSpec(ignore_index=0), verify=False):
        model(input_ids=ids, labels=ids)
    assert seen[0] is False if seq_len > 64 else isinstance(seen[0], ScoredRows)
    assert isinstance(seen[1], ScoredRows) and isinstance(seen[2], ScoredRows)
    assert float(mine.detach()) == pytest.approx(float(stock.detach()), rel=1e-5)


def test_fits_says_what_check_refuses():
    targets = torch.randint(0, VOCAB, (2, 6))
    rows = scored_rows(targets, shift=True)
    assert rows.fits(targets, True, -100, (2, 6))
    assert not rows.fits(targets.clone(), True, -100, (2, 6))
    assert not rows.fits(targets, True, -100, (12,))  # (no sequences: not a shifted call's rows)
    assert not rows.fits(targets, False, -100, (2, 6))
    targets[0, 0] = 3  # written in place
    assert not rows.fits(targets, True, -100, (2, 6))
