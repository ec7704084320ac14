"""headloss.integrations.trl_distill against TRL 1.16's ServerDistillationTrainer's own loss methods:
the same student logits and teacher-server result, TRL's loss on the student's log-softmax against
headloss's one pass with the teacher's support as a sparse teacher."""

import pytest
import torch
from conftest import generator, needs_kernel

pytest.importorskip("trl")
server = pytest.importorskip("trl.experimental.server_distillation")

from headloss.integrations import trl_distill as td  # noqa: E402

B, T, V = 3, 7, 41


def trl_loss(beta, tail, temperature, logits, teacher_result, completion_tokens, labels):
    """TRL's own methods on an instance built without its __init__ (which connects to the server)."""
    trainer = object.__new__(server.ServerDistillationTrainer)
    trainer.beta, trainer.loss_add_tail, trainer.reverse_kl_top_1_mode = beta, tail, "sampled"
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    if beta > 0:
        return trainer._compute_server_sparse_top_1_divergence_loss(teacher_result=teacher_result,
                                                                    student_log_probs=log_probs,
                                                                    completion_tokens=completion_tokens,
                                                                    labels=labels)
    return trainer._compute_server_forward_kl_loss(teacher_result=teacher_result, student_log_probs=log_probs,
                                                   labels=labels)


def server_result(seed, k, logits):
    """What the teacher server returns (trl's _get_teacher_token_logprobs_from_server): top-k
    log-probs and ids (-inf where the server gave fewer), the sampled tokens' log-probs."""
    gen = generator(seed)
    teacher = torch.log_softmax(logits.detach().double() + torch.randn(B, T, V, generator=gen, dtype=torch.float64), -1)
    top = teacher.topk(k, dim=-1)
    lp, ids = top.values.float(), top.indices.clone()
    if k > 1:
        lp[0, 1, k - 2:] = float("-inf")
        ids[0, 1, k - 2:] = 0
    tokens = torch.randint(0, V, (B, T), generator=gen)
    tokens[1, 2] = ids[1, 2, 0]  # the sampled token is the teacher's top-1 there
    labels = tokens.clone()
    labels[2, 4:] = -100
    actual = teacher.gather(-1, tokens[..., None])[..., 0].float()
    actual[2, 5] = float("-inf")  # padding: masked by its label
    return {"topk_logprobs": lp, "topk_token_ids": ids, "actual_logprobs": actual}, tokens, labels


@needs_kernel
@pytest.mark.parametrize("backend_env", ["triton", pytest.param("torch", marks=pytest.mark.slow)])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.0, 0.7), (0.4, 1.0), (1.0, 0.8)])
def test_server_distillation_loss_equals_trls(beta, temperature, tail, backend_env, monkeypatch):
    """Loss and d loss / d logits of TRL's forward-KL (top-k) and top-1 JSD / reverse-KL paths, with and
    without the tail bucket, at two temperatures, on both headloss paths."""
    monkeypatch.setattr(td, "head_loss", lambda *a, **kw: __import__("headloss").head_loss(*a, backend=backend_env,
                                                                                             **kw))
    logits = torch.randn(B, T, V, generator=generator(1)) * 2
    result, tokens, labels = server_result(2, 5 if beta == 0 else 1, logits)
    x_trl, x_ours = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want = trl_loss(beta, tail, temperature, x_trl, result, tokens, labels)
    got = td.server_distillation_loss(x_ours, result, tokens, labels, beta=beta, loss_add_tail=tail,
                                      temperature=temperature)
    want.backward()
    got.backward()
    if beta < 1 or tail:  # (one entry renormalised is the whole distribution on both sides: 0, for TRL too)
        assert float(want) > 1e-3
    torch.testing.assert_close(got.detach(), want.detach(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(x_ours.grad, x_trl.grad, rtol=2e-4, atol=1e-6)


def test_server_support_refuses_missing_teacher_logprobs_as_trl_does():
    logits = torch.randn(B, T, V, generator=generator(3))
    result, tokens, labels = server_result(4, 1, logits)
    result["actual_logprobs"][0, 0] = float("-inf")
    with pytest.raises(ValueError, match="missing actual-token logprobs"):
        td.server_support(result, tokens, labels, 0.5)


def test_the_trainer_subclass_changes_only_compute_loss():
    own = set(vars(td.HeadLossServerDistillationTrainer)) - {"__module__", "__doc__", "__qualname__",
                                                            "__firstlineno__", "__static_attributes__"}
    assert own == {"compute_loss"}
    assert issubclass(td.HeadLossServerDistillationTrainer, server.ServerDistillationTrainer)


# --- TRL's DistillationTrainer (a dense teacher beside the student) ----------------------------------

trl_trainer = pytest.importorskip("trl.trainer.distillation_trainer")


def dense_inputs(seed, scale=1.0, softcap=None):
    gen = generator(seed)
    hs = torch.randn(2, 5, 16, generator=gen)
    ht = torch.randn(2, 5, 12, generator=gen)
    ws, bs = torch.randn(V, 16, generator=gen) / 2, torch.randn(V, generator=gen) * 0.1
    wt, bt = torch.randn(V, 12, generator=gen) / 2, torch.randn(V, generator=gen) * 0.1
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[1, 3:] = 0
    return hs, ht, ws, bs, wt, bt, mask


@needs_kernel
@pytest.mark.parametrize("backend_env", ["triton", pytest.param("torch", marks=pytest.mark.slow)])
@pytest.mark.parametrize("beta,temperature,items,scale,softcap", [
    (0.0, 1.0, None, 1.0, None), (0.5, 1.0, 7, 1.3, None), (1.0, 1.0, None, 1.0, 6.0), (0.3, 0.8, None, 1.0, None),
])
def test_dense_distillation_loss_equals_trls_chunked_divergence(beta, temperature, items, scale, softcap, backend_env,
                                                                monkeypatch):
    """The loss, d loss / d (student hidden, weight, bias), the valid count and (at temperature 1) the
    entropy sum of TRL's _chunked_divergence_loss (its CPU path), from the same hidden states and heads."""
    import headloss

    monkeypatch.setattr(td, "linear_head_loss",
                        lambda *a, **kw: headloss.linear_head_loss(*a, backend=backend_env, **kw))
    hs, ht, ws, bs, wt, bt, mask = dense_inputs(5)
    results = []
    for fn in (trl_trainer._chunked_divergence_loss, td.dense_distillation_loss):
        h, w, b = (t.clone().requires_grad_() for t in (hs, ws, bs))
        loss, entropy_sum, n_valid = fn(h, ht, w, wt, mask, beta, num_items_in_batch=items, student_lm_head_bias=b,
                                        teacher_lm_head_bias=bt, student_logit_scale=scale,
                                        student_final_logit_softcapping=softcap, temperature=temperature)
        loss.backward()
        results.append((loss.detach(), entropy_sum, int(n_valid), h.grad, w.grad, b.grad))
    (want, want_h, want_n, *want_g), (got, got_h, got_n, *got_g) = results
    assert float(want) > 1e-3 and got_n == want_n == 8
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if temperature == 1.0:
        torch.testing.assert_close(got_h.float(), want_h.float(), rtol=1e-5, atol=1e-5)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_dense_distillation_refuses_a_teacher_logit_transform():
    hs, ht, ws, bs, wt, bt, mask = dense_inputs(6)
    with pytest.raises(ValueError, match="teacher_logit_scale"):
        td.dense_distillation_loss(hs, ht, ws, wt, mask, 0.5, teacher_final_logit_softcapping=30.0)


def test_the_dense_trainer_swaps_only_the_divergence_step(monkeypatch):
    """HeadLossDistillationTrainer changes _compute_loss only, and there TRL's module-level
    _chunked_divergence_loss is headloss's for the call, TRL's again after."""
    own = set(vars(td.HeadLossDistillationTrainer)) - {"__module__", "__doc__", "__qualname__", "__firstlineno__",
                                                       "__static_attributes__"}
    assert own == {"_compute_loss"}
    seen = []
    monkeypatch.setattr(trl_trainer.DistillationTrainer, "_compute_loss",
                        lambda self, *args: seen.append(trl_trainer._chunked_divergence_loss) or "loss")
    trainer = object.__new__(td.HeadLossDistillationTrainer)
    assert trainer._compute_loss(None, {}, None) == "loss"
    assert seen == [td.dense_distillation_loss]
    assert trl_trainer._chunked_divergence_loss is not td.dense_distillation_loss


# --- TRL's GKDTrainer (both models' logits) ------------------------------------------------------------

gkd = pytest.importorskip("trl.experimental.gkd")


@needs_kernel
@pytest.mark.parametrize("backend_env", ["triton", pytest.param("torch", marks=pytest.mark.slow)])
@pytest.mark.parametrize("beta,temperature,reduction,items", [
    (0.5, 1.0, "batchmean", None), (0.0, 0.9, "batchmean", None), (1.0, 1.0, "sum", None), (0.3, 1.2, "mean", None),
    (0.5, 1.0, "batchmean", 11),
])
def test_generalized_jsd_loss_equals_trls(beta, temperature, reduction, items, backend_env, monkeypatch):
    """TRL GKDTrainer.generalized_jsd_loss and headloss's, on the same logits and labels (-100 masked):
    value and d loss / d student logits; the subclass takes headloss's."""
    import headloss

    monkeypatch.setattr(td, "head_loss", lambda *a, **kw: headloss.head_loss(*a, backend=backend_env, **kw))
    gen = generator(8)
    student = torch.randn(B, T, V, generator=gen) * 2
    teacher = student + torch.randn(B, T, V, generator=gen)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, :3] = -100
    results = []
    for fn in (gkd.GKDTrainer.generalized_jsd_loss, td.generalized_jsd_loss):
        x = student.clone().requires_grad_()
        loss = fn(x, teacher, labels=labels, beta=beta, temperature=temperature, reduction=reduction,
                  num_items_in_batch=items)
        loss.backward()
        results.append((loss.detach(), x.grad))
    (want, want_grad), (got, got_grad) = results
    assert float(want) > 1e-4
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-7)
    assert td.HeadLossGKDTrainer.generalized_jsd_loss is td.generalized_jsd_loss


def test_generalized_jsd_loss_refuses_trls_elementwise_reduction():
    with pytest.raises(ValueError, match="reduction"):
        td.generalized_jsd_loss(torch.randn(1, 2, V), torch.randn(1, 2, V), reduction="none")
