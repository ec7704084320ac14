"""headloss.routes: which route a call takes, the ``route=`` argument that forces another, and where
the route is reported (``out.route``, ``python -m headloss explain``, HEADLOSS_LOG_ROUTES).

Every route of ROUTES is run here once against the fp64 reference (the fast tier's cover of every
path); the longer sweeps per route live in the modules' own tests."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import assert_close_norm, generator, make_logits, make_targets, needs_kernel

import headloss
from headloss import LossSpec, Policy, head_loss, linear_head_loss
from headloss.cli import explain
from headloss.plan import compile_plan
from headloss.routes import ROUTES, Facts, choose, routes_for

V = 23


def _facts(entry="logits", shape=(2, 5), **changes) -> Facts:
    base = dict(entry=entry, backend="triton", token_shape=shape, sequence_ids=False, sharded=False, traced=False,
                capturing=False, inputs_want_grad=False, sequence_fits=entry == "hidden")
    return Facts(**{**base, **changes})


def _names(spec: LossSpec, **facts) -> list[str]:
    return [route.name for route in routes_for(compile_plan(spec), _facts(**facts))]


GSPO = LossSpec(cross_entropy=None, policy=Policy(importance_sampling="sequence", kl_beta=0.04))
GRPO = LossSpec(cross_entropy=None, policy=Policy(loss_type="grpo"))


def test_the_routes_of_each_kind_of_call():
    assert _names(LossSpec()) == ["fused"]
    assert _names(LossSpec(reduction="none")) == ["deferred"]
    assert _names(GRPO) == ["fused"]
    assert _names(GSPO) == ["deferred+kernels", "deferred+torch"]
    assert _names(LossSpec(cross_entropy=None, policy=Policy(objective="gmpo", loss_type="grpo"))) == \
        ["deferred+torch"]
    assert _names(LossSpec(), entry="hidden") == ["lm_head:fused"]
    assert _names(LossSpec(reduction="none"), entry="hidden") == ["lm_head:deferred"]
    assert _names(GSPO, entry="hidden") == ["lm_head:sequences+kernels", "lm_head:sequences+torch",
                                            "lm_head:deferred+kernels", "lm_head:deferred+torch"]
    assert _names(LossSpec(cross_entropy=None, policy=Policy(objective="kl_cov")), entry="hidden") == \
        ["lm_head:covariance", "lm_head:deferred+torch"]
    assert _names(LossSpec(cross_entropy=None, policy=Policy(top_entropy_quantile=0.5)), entry="hidden") == \
        ["lm_head:entropy-guess", "lm_head:deferred+torch"]
    assert _names(LossSpec(), backend="torch") == ["torch"]


def test_the_facts_that_close_routes():
    # the sequence kernels need [B, T] rows and inputs that want no gradient (compiled: as ops)
    assert _names(GSPO, shape=(10,), sequence_ids=True) == ["deferred+torch"]
    assert _names(GSPO, traced=True) == ["deferred+kernels", "deferred+torch"]  # the kernels as ops
    assert _names(GSPO, inputs_want_grad=True) == ["deferred+torch"]
    assert _names(GSPO, shape=(0, 5)) == ["deferred+torch"]
    # the lm_head's gradient-in-forward routes: one device, a sequence that fits the budget (compiled too)
    assert _names(GSPO, entry="hidden", sharded=True) == ["lm_head:deferred+kernels", "lm_head:deferred+torch"]
    assert _names(GSPO, entry="hidden", traced=True) == _names(GSPO, entry="hidden")
    assert _names(GSPO, entry="hidden", sequence_fits=False) == ["lm_head:deferred+kernels",
                                                                 "lm_head:deferred+torch"]
    # the corrections read a count on the host: not under CUDA-graph capture or torch.compile
    cov = LossSpec(cross_entropy=None, policy=Policy(objective="clip_cov"))
    assert _names(cov, entry="hidden")[0] == "lm_head:covariance"
    assert _names(cov, entry="hidden", capturing=True) == ["lm_head:deferred+torch"]
    assert _names(cov, entry="hidden", traced=True) == ["lm_head:deferred+torch"]
    # TRL's token-mean bonus depends on the top-entropy mask: no guess
    bonus = LossSpec(cross_entropy=None, policy=Policy(top_entropy_quantile=0.5, entropy_coef=0.01,
                                                       entropy_aggregation="token-mean"))
    assert _names(bonus, entry="hidden") == ["lm_head:deferred+torch"]


def test_a_route_the_call_cannot_take_is_an_error_naming_route():
    plan, facts = compile_plan(GSPO), _facts()
    assert choose(plan, facts).name == "deferred+kernels"
    assert choose(plan, facts, "deferred+torch").name == "deferred+torch"
    with pytest.raises(ValueError, match=r"route: 'fused' cannot run this call; it can run deferred\+kernels, "
                                         r"deferred\+torch"):
        choose(plan, facts, "fused")
    with pytest.raises(ValueError, match="route: expected one of torch, fused"):
        choose(plan, facts, "fast")
    with pytest.raises(ValueError, match="route: expected one of"):
        head_loss(make_logits((3, V)), make_targets((3,), V), route=3)


def _policy_batch(seed: int, batch=3, length=6):
    gen = generator(seed)
    logits = make_logits((batch, length, V), seed=seed)
    ids = make_targets((batch, length), V, seed=seed)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    inputs = dict(advantages=torch.randn(batch, generator=gen),
                  old_logprobs=(logp + 0.2 * torch.randn(batch, length, generator=gen, dtype=torch.float64)).float(),
                  ref_logprobs=(logp + 0.2 * torch.randn(batch, length, generator=gen, dtype=torch.float64)).float(),
                  loss_mask=(torch.rand(batch, length, generator=gen) > 0.2).float())
    return logits, ids, inputs


def _read_by(spec: LossSpec, inputs: dict) -> dict:
    """The policy inputs ``spec`` reads (ref_logprobs only with a KL term)."""
    if spec.policy is None:
        return {}
    return {k: v for k, v in inputs.items() if k != "ref_logprobs" or spec.policy.kl_beta != 0.0}


def _check(out, grads, ref, ref_grads):
    assert_close_norm(out.loss, ref.loss, rtol=1e-5, atol=3e-6, name="loss")
    for got, want in zip(grads, ref_grads):
        assert_close_norm(got, want, rtol=1e-4, atol=1e-7, name="grad")
    assert set(out.metrics) == set(ref.metrics)
    for name, value in ref.metrics.items():
        assert_close_norm(out.metrics[name], value, rtol=1e-5, atol=1e-6, name=name)


LOGITS_ROUTES = {
    "fused": LossSpec(z_loss={"weight": 1e-3}, token_accuracy=True, cross_entropy={"label_smoothing": 0.1}),
    "deferred": LossSpec(reduction="none", entropy={"weight": 0.05}),
    "deferred+kernels": GSPO,
    "deferred+torch": GSPO,
}


@needs_kernel
@pytest.mark.parametrize("route", list(LOGITS_ROUTES))
def test_every_logits_route_matches_the_reference(route):
    spec = LOGITS_ROUTES[route]
    logits, ids, inputs = _policy_batch(3)
    inputs = _read_by(spec, inputs)
    x = logits.clone().requires_grad_()
    out = head_loss(x, ids, spec, route=route, **inputs)
    assert out.route == route
    (out.loss.sum() if spec.reduction == "none" else out.loss).backward()
    x64 = logits.double().requires_grad_()
    ref = head_loss(x64, ids, spec, backend="torch", **{k: v.double() for k, v in inputs.items()})
    assert ref.route == "torch"
    (ref.loss.sum() if spec.reduction == "none" else ref.loss).backward()
    _check(out, [x.grad], ref, [x64.grad])


LM_HEAD_ROUTES = {
    "lm_head:fused": GRPO,
    "lm_head:deferred": LossSpec(reduction="none"),
    "lm_head:deferred+kernels": GSPO,
    "lm_head:deferred+torch": GSPO,
    "lm_head:sequences+kernels": GSPO,
    "lm_head:sequences+torch": GSPO,
    "lm_head:covariance": LossSpec(cross_entropy=None, policy=Policy(objective="kl_cov", cov_ratio=0.2)),
    "lm_head:entropy-guess": LossSpec(cross_entropy=None, policy=Policy(top_entropy_quantile=0.5)),
}


@needs_kernel
@pytest.mark.parametrize("route", list(LM_HEAD_ROUTES))
def test_every_lm_head_route_matches_the_reference(route):
    spec = LM_HEAD_ROUTES[route]
    gen = generator(5)
    _, ids, inputs = _policy_batch(5)
    inputs = _read_by(spec, inputs)
    hidden = torch.randn(3, 6, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, 8, generator=gen, dtype=torch.float64) * 0.5
    leaves = [hidden.float().requires_grad_(), weight.float().requires_grad_()]
    out = linear_head_loss(*leaves, ids, spec, route=route, chunk_bytes=7 * V * 4, **inputs)
    assert out.route == route
    (out.loss.sum() if spec.reduction == "none" else out.loss).backward()
    ref_leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    ref = head_loss(ref_leaves[0] @ ref_leaves[1].T, ids, spec, backend="torch",
                    **{k: v.double() for k, v in inputs.items()})
    (ref.loss.sum() if spec.reduction == "none" else ref.loss).backward()
    _check(out, [leaf.grad for leaf in leaves], ref, [leaf.grad for leaf in ref_leaves])


def test_every_route_is_named_and_described_and_the_tests_run_each():
    assert set(ROUTES) == {"torch"} | set(LOGITS_ROUTES) | set(LM_HEAD_ROUTES)
    assert all(text and text[0].islower() for text in ROUTES.values())


def test_explain_prints_the_routes_of_both_entry_points():
    text = explain(GSPO, rows=8192, vocab=32000, dtype=torch.bfloat16, seq_len=512)
    assert "route       deferred+kernels: " in text and "(also: deferred+torch)" in text
    assert "lm_head     lm_head:sequences+kernels: " in text
    assert "route       fused: " in explain(LossSpec(), rows=16, vocab=100, dtype=torch.float32)


def test_log_routes_logs_one_line_per_call(monkeypatch, caplog):
    monkeypatch.setattr(headloss.env, "LOG_ROUTES", True)
    with caplog.at_level(logging.INFO, logger="headloss.routes"):
        head_loss(make_logits((3, V)), make_targets((3,), V), backend="torch")
    assert [r.getMessage() for r in caplog.records] == [f"head_loss [3, {V}] float32 -> torch"]


def test_the_plain_torch_paths_former_name_still_runs_with_a_warning_at_the_callers_line():
    logits, targets = make_logits((3, V)), make_targets((3,), V)
    for argument in ("backend", "route"):
        with pytest.warns(FutureWarning, match=f"{argument}: 'reference' is now called 'torch'") as caught:
            out = head_loss(logits, targets, **{"backend": "torch", argument: "reference"})
        assert out.route == "torch"
        assert caught[0].filename == __file__
    with pytest.warns(FutureWarning, match="backend: 'reference'"):
        assert linear_head_loss(torch.randn(3, 4), torch.randn(V, 4), targets, backend="reference").route == "torch"
