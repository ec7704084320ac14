"""The top-k teacher at its edges, against TRL 1.16's own top-k distillation (tests/trl_oracle.py, fp64).

* ``rest``'s tail where the student's or the teacher's top-k mass is (or rounds to) 1: TRL clamps the log
  of each mass at -1e-7, so the value is finite; where the clamp does not bite the value is the exact one,
  however small the student's tail (it is not 1 - sum p_k in fp32).
* An entry whose teacher log-prob is -inf is no entry (TRL's ``valid`` mask), so TRL's padding (id 0,
  log-prob -inf) is scored as TRL scores it, on both paths; an id given twice among a row's entries is
  refused on both paths, with the default validation and with ``validate="sync"``.
* A row whose entries are all absent counts in the mean with divergence 0 (TRL's ``batchmean``).

Both paths (the kernels under the interpreter, plain torch), both entry points (``linear_head_loss`` on
hidden states that are the logits, with an identity weight), packed rows, and 2 gloo ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
import trl_oracle
from conftest import assert_close_norm, generator, init_process, needs_kernel, spawn_ranks

import headloss
from headloss import LossSpec

BACKENDS = ["torch", pytest.param("triton", marks=needs_kernel)]
ENTRIES = ["head_loss", "linear_head_loss"]


def _spec(topk: str, divergence: str = "forward_kl", beta: float = 0.5) -> LossSpec:
    return LossSpec(cross_entropy=None, distillation={"teacher": "topk", "topk": topk, "divergence": divergence,
                                                      "beta": beta})


def _edge(name: str):
    """(logits [N, V], ids [N, K], lq [N, K], topk, divergence, TRL's value where the issue quotes it)."""
    gen = generator(sum(map(ord, name)))
    if name == "confident_student":  # p_rest = 7 e^-24 rounds 1 - p_0 to 0 in fp32; TRL's clamp: 1.2867
        return (torch.tensor([[24.0, 0, 0, 0, 0, 0, 0, 0]]), torch.tensor([[0]]),
                torch.tensor([[math.log(0.9)]]), "rest", "forward_kl", 1.2867)
    if name == "every_id_given":  # K = V: the student's tail is 0, the teacher's 1e-5
        q = torch.softmax(torch.randn(1, 8, generator=gen, dtype=torch.float64), -1) * (1 - 1e-5)
        return torch.randn(1, 8, generator=gen), torch.arange(8)[None], q.log().float(), "rest", "forward_kl", None
    if name == "certain_teacher_reverse":  # the teacher's tail is 0: reverse KL's p_r log(p_r / q_r)
        return torch.randn(1, 8, generator=gen), torch.tensor([[3]]), torch.tensor([[0.0]]), "rest", "reverse_kl", None
    if name == "small_free_tail":  # p_rest = 7 e^-14 ~ 5.8e-6: above the clamp, below fp32's 1 - sum p_k
        return (torch.tensor([[14.0, 0, 0, 0, 0, 0, 0, 0]]), torch.tensor([[0]]),
                torch.tensor([[math.log(0.9)]]), "rest", "forward_kl", None)
    if name == "small_free_tail_jsd":
        x = torch.tensor([[13.0, 12.0, 0, 0, 0, 0, 0, 0, 1.0, 0]])
        return x, torch.tensor([[1, 0]]), torch.tensor([[math.log(0.3), math.log(0.69)]]), "rest", "jsd", None
    raise AssertionError(name)


EDGES = ["confident_student", "every_id_given", "certain_teacher_reverse", "small_free_tail", "small_free_tail_jsd"]


def _call(entry: str, backend: str, logits: torch.Tensor, targets, spec: LossSpec, **kwargs):
    """(out, d loss / d logits) of head_loss on the logits, or of linear_head_loss on hidden states equal to
    the logits with an identity weight (its d loss / d hidden is d loss / d logits)."""
    leaf = logits.detach().clone().requires_grad_()
    if entry == "head_loss":
        out = headloss.head_loss(leaf, targets, spec, backend=backend, **kwargs)
    else:
        eye = torch.eye(logits.shape[-1], dtype=logits.dtype)
        out = headloss.linear_head_loss(leaf, eye, targets, spec, backend=backend, **kwargs)
    out.loss.backward()
    return out, leaf.grad


def _oracle(logits, ids, lq, topk, divergence, beta=0.5, labels=None):
    """TRL's batchmean loss and d loss / d logits (fp64)."""
    x = logits.detach().double().requires_grad_()
    loss = trl_oracle.batchmean(trl_oracle.token_divergence(x, ids, lq, topk, trl_oracle.beta_of(divergence, beta)),
                                labels)
    loss.backward()
    return loss.detach(), x.grad


def test_the_oracle_is_trls_own_tail_bucket_and_divergence():
    """tests/trl_oracle.py against TRL 1.16's own functions, as its forward-KL loss calls them (rows with
    TRL's padding, at each edge, and random): values and gradients."""
    pytest.importorskip("trl")
    server = pytest.importorskip("trl.experimental.server_distillation.server_distillation_trainer")
    gen = generator(7)
    cases = [_edge(name)[:3] for name in EDGES if _edge(name)[0].shape[-1] == 8]
    logits = torch.randn(5, 8, generator=gen, dtype=torch.float64) * 3
    top = torch.log_softmax(torch.randn(5, 8, generator=gen, dtype=torch.float64), -1).topk(3, dim=-1)
    ids, lq = top.indices.clone(), top.values.clone()
    ids[1, 2], lq[1, 2] = 0, -math.inf  # TRL's padding
    cases.append((logits, ids, lq))
    for topk in ("rest", "renormalized"):
        for beta in (0.0, 1.0, 0.3):
            for x, k_ids, k_lq in cases:
                a, b = x.double().clone().requires_grad_(), x.double().clone().requires_grad_()
                k_lq = k_lq.double()
                valid = k_lq > float("-inf")
                neg_inf = torch.full((), float("-inf"), dtype=torch.float64)
                student = torch.where(valid, torch.log_softmax(a, -1).gather(-1, k_ids), neg_inf)
                teacher = torch.where(valid, k_lq, neg_inf)
                if topk == "rest":
                    student, support = server._add_tail_bucket(student, valid)
                    teacher, _ = server._add_tail_bucket(teacher, valid)
                else:
                    support = valid
                    student = student - torch.logsumexp(student, dim=-1, keepdim=True)
                    teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
                want = server._jsd_divergence(student, teacher, beta=beta, support_mask=support).sum(-1)
                got = trl_oracle.token_divergence(b, k_ids, k_lq, topk, beta)
                want.sum().backward()
                got.sum().backward()
                torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12)
    confident = trl_oracle.token_divergence(*[t.double() if t.is_floating_point() else t
                                              for t in _edge("confident_student")[:3]], "rest", 0.0)
    assert float(confident) == pytest.approx(1.2867, abs=1e-4)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edge", EDGES)
def test_rest_tail_at_the_edges_is_trls_finite_value(edge, backend, entry):
    logits, ids, lq, topk, divergence, quoted = _edge(edge)
    out, grad = _call(entry, backend, logits, None, _spec(topk, divergence), teacher_ids=ids, teacher_logprobs=lq)
    want, want_grad = _oracle(logits, ids, lq, topk, divergence)
    got = float(out.loss.detach())
    assert math.isfinite(got)
    assert got == pytest.approx(float(want), rel=2e-5, abs=1e-6)
    if quoted is not None:
        assert got == pytest.approx(quoted, abs=1e-4)
    assert bool(torch.isfinite(grad).all())
    assert_close_norm(grad, want_grad, rtol=1e-4, atol=1e-7, name="d loss / d logits")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_small_tails_keep_their_digits(backend, reduction):
    """Rows whose student tail runs from 1e-3 down to the clamp (logits [z, 0 x 7], one teacher id): value and
    gradient are TRL's fp64 ones to 2e-5, where 1 - sum p_k in fp32 (the tail's digits lost against lse ~ z)
    is off by up to ~100% of the tail. ``none``: per-token losses, the gradient in backward (deferred)."""
    z = torch.tensor([7.0, 10.0, 12.0, 14.0, 15.5, 16.5, 17.5, 30.0])
    logits = torch.zeros(len(z), 8)
    logits[:, 0] = z
    ids, lq = torch.zeros(len(z), 1, dtype=torch.long), torch.full((len(z), 1), math.log(0.9))
    spec = LossSpec(cross_entropy=None, reduction=reduction, distillation={"teacher": "topk", "topk": "rest"})
    leaf = logits.clone().requires_grad_()
    out = headloss.head_loss(leaf, None, spec, backend=backend, teacher_ids=ids, teacher_logprobs=lq)
    weights = torch.linspace(0.5, 1.5, len(z))
    x = logits.double().requires_grad_()
    want = trl_oracle.token_divergence(x, ids, lq, "rest", 0.0)
    if reduction == "none":
        torch.testing.assert_close(out.loss.detach().double(), want.detach(), rtol=2e-5, atol=1e-6)
        (out.loss * weights).sum().backward()
        (want * weights.double()).sum().backward()
        assert out.route in ("torch", "deferred"), out.route
    else:
        assert float(out.loss.detach()) == pytest.approx(float(want.mean()), rel=2e-5)
        out.loss.backward()
        want.mean().backward()
    assert_close_norm(leaf.grad, x.grad, rtol=1e-4, atol=1e-8, name="d loss / d logits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_tails_over_several_blocks_of_the_row(backend):
    """V = 5000 (several blocks of the stats pass): the row's max in the first, a middle or the last block,
    twice in two blocks (a tie), or behind a run of -inf columns, with the tail far below fp32's resolution
    of the top-k mass: TRL's fp64 value and gradient, also when the max is not a teacher id."""
    vocab = 5000
    logits = torch.full((6, vocab), -3.0)
    logits[0, 7] = 16.0  # first block
    logits[1, 2500] = 16.0  # a middle block
    logits[2, 4999] = 16.0  # the last block
    logits[3, 11], logits[3, 4400] = 15.0, 15.0  # a tie across blocks
    logits[4, :3000] = float("-inf")
    logits[4, 4100] = 17.0  # behind -inf columns
    logits[5, 300] = 9.0  # the max is not an id: the tail holds most of the student
    logits[:, 4000] = logits[:, 4000] + 1.0
    ids = torch.tensor([[7, 4000], [2500, 4000], [4999, 4000], [11, 4400], [4100, 4000], [12, 4000]])
    lq = torch.log(torch.tensor([[0.85, 0.1]] * 6))
    spec = LossSpec(cross_entropy=None, reduction="none", distillation={"teacher": "topk", "topk": "rest"})
    leaf = logits.clone().requires_grad_()
    out = headloss.head_loss(leaf, None, spec, backend=backend, teacher_ids=ids, teacher_logprobs=lq)
    x = logits.double().requires_grad_()
    want = trl_oracle.token_divergence(x, ids, lq, "rest", 0.0)
    torch.testing.assert_close(out.loss.detach().double(), want.detach(), rtol=2e-5, atol=1e-6)
    weights = torch.linspace(0.5, 1.5, 6)
    (out.loss * weights).sum().backward()
    (want * weights.double()).sum().backward()
    assert_close_norm(leaf.grad, x.grad, rtol=1e-4, atol=1e-8, name="d loss / d logits")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk, divergence", [("verl", "forward_kl"), ("renormalized", "jsd"), ("rest", "reverse_kl"),
                                              ("rest", "forward_kl")])
def test_a_minus_inf_log_prob_is_no_entry(topk, divergence, backend):
    """An entry of a real id with log-prob -inf takes no part (TRL's valid mask): the call equals the one
    with that entry's id -1, value, metrics and gradient, and for TRL's conventions TRL's value."""
    gen = generator(17)
    logits = torch.randn(4, 23, generator=gen) * 2
    top = torch.log_softmax(torch.randn(4, 23, generator=gen), -1).topk(5, dim=-1)
    ids, lq = top.indices.clone(), top.values.clone()
    lq[0, 1] = lq[2, 4] = lq[3, 0] = -math.inf
    absent = ids.clone()
    absent[0, 1] = absent[2, 4] = absent[3, 0] = -1
    spec = _spec(topk, divergence)
    a, grad_a = _call("head_loss", backend, logits, None, spec, teacher_ids=ids, teacher_logprobs=lq)
    b, grad_b = _call("head_loss", backend, logits, None, spec, teacher_ids=absent, teacher_logprobs=lq)
    assert float(a.loss) == float(b.loss)
    assert {k: float(v) for k, v in a.metrics.items()} == {k: float(v) for k, v in b.metrics.items()}
    assert torch.equal(grad_a, grad_b)
    if topk != "verl":
        want, want_grad = _oracle(logits, ids, lq, topk, divergence)
        assert float(a.loss) == pytest.approx(float(want), rel=2e-5)
        assert_close_norm(grad_a, want_grad, rtol=1e-4, atol=1e-7, name="d loss / d logits")
    assert math.isfinite(float(a.loss))


@pytest.mark.parametrize("validate", ["default", "sync"])
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_trls_padding_is_scored_as_trl_scores_it(backend, entry, validate):
    """TRL pads a row's top-k with id 0 and log-prob -inf: accepted on both paths (those entries are no
    entries, so id 0 given twice there is no repeat) and scored as TRL scores it."""
    gen = generator(19)
    logits = torch.randn(3, 16, generator=gen) * 2
    top = torch.log_softmax(torch.randn(3, 16, generator=gen), -1).topk(4, dim=-1)
    ids, lq = top.indices.clone(), top.values.clone()
    ids[0, 2:], lq[0, 2:] = 0, -math.inf
    ids[2, 3], lq[2, 3] = 0, -math.inf
    kwargs = {} if validate == "default" else {"validate": "sync"}
    for topk in ("rest", "renormalized"):
        out, grad = _call(entry, backend, logits, None, _spec(topk), teacher_ids=ids, teacher_logprobs=lq, **kwargs)
        want, want_grad = _oracle(logits, ids, lq, topk, "forward_kl")
        assert float(out.loss) == pytest.approx(float(want), rel=2e-5)
        assert_close_norm(grad, want_grad, rtol=1e-4, atol=1e-7, name="d loss / d logits")


@pytest.mark.parametrize("validate", ["default", "sync"])
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_id_is_refused_on_both_paths(backend, entry, validate):
    """Two entries with the same id in a row: refused on both paths, naming teacher_ids, the row and the
    later entry (the kernels' path finds it on the device, here in the call: CPU tensors); every
    convention, as verl's would count the id twice and TRL's too."""
    gen = generator(23)
    logits = torch.randn(3, 16, generator=gen)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, -1, 7], [8, 9, 10, 9]])
    lq = -torch.rand(3, 4, generator=gen) - 0.1
    kwargs = {} if validate == "default" else {"validate": "sync"}
    for topk in ("verl", "renormalized", "rest"):
        with pytest.raises(ValueError, match=r"teacher_ids: the id( 9)? at row 2, entry 3 repeats an earlier entry"):
            _call(entry, backend, logits, None, _spec(topk), teacher_ids=ids, teacher_logprobs=lq, **kwargs)
    lq[2, 1] = -math.inf  # the first 9 is no entry now: the row is good
    _call(entry, backend, logits, None, _spec("rest"), teacher_ids=ids, teacher_logprobs=lq, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_without_entries_counts_with_divergence_zero(backend):
    """A counted row whose entries are all absent adds 0 to the sum and 1 to the count (TRL's batchmean)."""
    gen = generator(29)
    logits = torch.randn(4, 16, generator=gen)
    top = torch.log_softmax(torch.randn(4, 16, generator=gen), -1).topk(3, dim=-1)
    ids, lq = top.indices.clone(), top.values.clone()
    ids[1] = -1
    lq[3] = -math.inf
    labels = torch.tensor([2, 5, -100, 7])
    for topk in ("rest", "verl"):
        out, grad = _call("head_loss", backend, logits, labels, _spec(topk), teacher_ids=ids, teacher_logprobs=lq)
        keep = torch.tensor([0])
        alone, _ = _call("head_loss", backend, logits[keep], labels[keep], _spec(topk), teacher_ids=ids[keep],
                         teacher_logprobs=lq[keep])
        assert float(out.loss) == pytest.approx(float(alone.loss) / 3, rel=1e-6)
        assert float(grad[1].abs().max()) == 0.0 and float(grad[3].abs().max()) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_at_the_edges_are_trls_values(backend):
    """Packed sequences (cu_seqlens, shift=True) whose rows hold the edge cases: each scored row is TRL's
    value (the mean over scored rows), the gradient TRL's."""
    rows = [(_edge(name)[0][0], _edge(name)[1][0], _edge(name)[2][0]) for name in
            ("confident_student", "small_free_tail", "every_id_given")]
    gen = generator(31)
    logits = torch.stack([r[0] for r in rows] + [torch.randn(8, generator=gen) for _ in range(3)])
    k = 8
    ids = torch.full((6, k), -1, dtype=torch.long)
    lq = torch.zeros(6, k)
    for i, (_, row_ids, row_lq) in enumerate(rows):
        ids[i, :row_ids.numel()], lq[i, :row_lq.numel()] = row_ids, row_lq
    ids[3:, 0], lq[3:, 0] = 2, math.log(0.5)
    targets = torch.tensor([1, 4, 0, 6, 3, 2])
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)  # sequences of 2 and 4 rows: rows 1 and 5 are not scored
    scored = torch.tensor([0, 2, 3, 4])
    out, grad = _call("head_loss", backend, logits, targets, _spec("rest"), teacher_ids=ids, teacher_logprobs=lq,
                      shift=True, cu_seqlens=cu)
    want, want_grad = _oracle(logits[scored], ids[scored], lq[scored], "rest", "forward_kl")
    assert float(out.loss) == pytest.approx(float(want), rel=2e-5)
    full = torch.zeros(6, 8, dtype=torch.float64)
    full[scored] = want_grad
    assert_close_norm(grad, full, rtol=1e-4, atol=1e-7, name="d loss / d logits")


# --- two gloo ranks --------------------------------------------------------------------------------------


def _rank_edges(rank: int, world: int, port: int, results) -> None:
    init_process(rank, world, port)
    out = {}
    try:
        for edge in EDGES:
            logits, ids, lq, topk, divergence, _ = _edge(edge)
            vocab = logits.shape[-1]
            width = vocab // world
            start = rank * width
            stop = vocab if rank == world - 1 else start + width
            for backend in ("torch", "triton"):
                for entry in ENTRIES:
                    leaf = logits[:, start:stop].clone().requires_grad_()
                    if entry == "head_loss":
                        got = headloss.head_loss(leaf, None, _spec(topk, divergence), backend=backend,
                                                 teacher_ids=ids, teacher_logprobs=lq,
                                                 group=torch.distributed.group.WORLD)
                        grad_of = leaf
                    else:  # hidden = the logits (replicated), this rank's rows of an identity weight
                        hidden = logits.clone().requires_grad_()
                        weight = torch.eye(vocab)[start:stop].clone()
                        got = headloss.linear_head_loss(hidden, weight, None, _spec(topk, divergence),
                                                        backend=backend, teacher_ids=ids, teacher_logprobs=lq,
                                                        group=torch.distributed.group.WORLD)
                        grad_of = hidden
                    got.loss.backward()
                    out[(edge, backend, entry)] = (float(got.loss), grad_of.grad.clone(), start, stop)
        bad = torch.tensor([[1, 2, 1]])
        for backend in ("torch", "triton"):
            leaf = torch.randn(1, 8)[:, rank * 4:(rank + 1) * 4].clone()
            try:
                headloss.head_loss(leaf, None, _spec("rest"), backend=backend, teacher_ids=bad,
                                   teacher_logprobs=torch.tensor([[-1.0, -2.0, -3.0]]),
                                   group=torch.distributed.group.WORLD)
                out[("repeat", backend)] = "accepted"
            except ValueError as exc:
                out[("repeat", backend)] = str(exc)
    finally:
        results[rank] = out
        torch.distributed.destroy_process_group()


@needs_kernel
@pytest.mark.slow
def test_the_edges_over_two_gloo_ranks_are_trls_values():
    """Each rank holds half of the vocabulary (logits, or rows of the weight): loss on every rank and each
    rank's gradient are TRL's fp64 ones, on both paths and entry points; a repeated id is refused on every
    rank."""
    results = spawn_ranks(_rank_edges, 2)
    for edge in EDGES:
        logits, ids, lq, topk, divergence, _ = _edge(edge)
        want, want_grad = _oracle(logits, ids, lq, topk, divergence)
        for rank in (0, 1):
            for backend in ("torch", "triton"):
                for entry in ENTRIES:
                    loss, grad, start, stop = results[rank][(edge, backend, entry)]
                    assert loss == pytest.approx(float(want), rel=2e-5, abs=1e-6), (edge, backend, entry, rank)
                    if entry == "head_loss":
                        assert_close_norm(grad, want_grad[:, start:stop], rtol=1e-4, atol=1e-7,
                                          name=f"{edge} {backend} rank {rank}")
                    else:  # d loss / d hidden: summed over the ranks (docs/vocab-parallel.md)
                        assert_close_norm(grad, want_grad, rtol=1e-4, atol=1e-7, name=f"{edge} {backend} rank {rank}")
    for rank in (0, 1):
        for backend in ("torch", "triton"):
            assert "teacher_ids" in results[rank][("repeat", backend)], results[rank][("repeat", backend)]
