"""One metric order (headloss.plan.METRIC_ORDER) on every path and entry point: ``out.metrics``,
``out.packed_metrics()`` and MetricsAccumulator list the same names in the same order, whatever
route the call takes (fused, deferred, the lm_head's chunks) and on the plain-torch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import generator, make_logits, make_targets, needs_kernel, row_inputs, teacher_inputs

from headloss import LossSpec, head_loss, linear_head_loss
from headloss.metrics import TRL_NAMES, MetricsAccumulator
from headloss.plan import METRIC_ORDER, in_metric_order
from headloss.spec import Policy

B, T, V, H = 2, 6, 13, 8
CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def _policy(**fields) -> LossSpec:
    return LossSpec(cross_entropy=None, policy=Policy(**fields))


SPECS = {
    **{f"config:{path.stem}": LossSpec.from_file(path) for path in CONFIGS},
    "sft-every-term": LossSpec(cross_entropy={"label_smoothing": 0.1}, z_loss={"weight": 1e-3}, dft={},
                               entropy={"weight": -0.01}, token_accuracy=True),
    "eval-metrics-only": LossSpec(cross_entropy={"weight": 0.0}, entropy={}, token_accuracy=True),
    "deferred-sft": LossSpec(z_loss={}, entropy={}, token_accuracy=True, outputs=("entropy",),
                             differentiable_outputs=True),
    "distill-jsd": LossSpec(cross_entropy=None, distillation={"divergence": "jsd", "beta": 0.5},
                            token_accuracy=True),
    "distill-reverse-and-ce": LossSpec(distillation={"divergence": "reverse_kl"}, entropy={}),
    "distill-topk-rest-and-z": LossSpec(distillation={"teacher": "topk", "topk": "rest"}, z_loss={},
                                        token_accuracy=True),
    "distill-token-and-entropy": LossSpec(distillation={"teacher": "token", "estimator": "k2"}, entropy={}),
    "grpo-kl": _policy(kl_beta=0.04, entropy_coef=0.01),
    "grpo-with-ce": LossSpec(entropy={}, token_accuracy=True, policy=Policy(loss_type="dapo")),
    "gspo": _policy(importance_sampling="sequence", loss_type="grpo"),
    "cispo": _policy(objective="cispo", eps_high=4.0, loss_type="dapo"),
    "sapo": _policy(objective="sapo"),
    "vespo": _policy(objective="vespo", loss_type="grpo"),
    "top-entropy": _policy(top_entropy_quantile=0.5, entropy_coef=0.02, entropy_aggregation="token-mean"),
    "off-policy": _policy(off_policy_mask=0.1, loss_type="dr_grpo", max_completion_length=T),
    "verl-vanilla": _policy(convention="verl", dual_clip_c=3.0, loss_type="token-mean", kl_beta=0.01,
                            kl_estimator="k3", kl_clamp=True),
    "verl-gspo": _policy(convention="verl", importance_sampling="sequence_token", loss_type="seq-mean-token-mean"),
    "verl-gpg": _policy(convention="verl", objective="gpg", loss_type="token-mean"),
    "verl-dro": _policy(convention="verl", objective="dro", dro_beta=0.1, loss_type="token-mean"),
    "verl-dppo": _policy(convention="verl", objective="dppo_tv", loss_type="token-mean"),
    "verl-reinforce": _policy(convention="verl", objective="reinforce", loss_type="token-mean"),
    "verl-gmpo": _policy(convention="verl", objective="gmpo", loss_type="seq-mean-token-mean"),
    "verl-clip-cov": _policy(convention="verl", objective="clip_cov", cov_ratio=0.2, loss_type="token-mean"),
    "verl-kl-cov": _policy(convention="verl", objective="kl_cov", cov_ratio=0.2, loss_type="token-mean"),
}


def _inputs(spec: LossSpec, seed: int) -> dict:
    """The call's tensors: logits, hidden states and weight, targets, and what the spec's terms read."""
    gen = generator(seed)
    logits = make_logits((B, T, V), seed=seed)
    targets = make_targets((B, T), V, seed=seed, ignore_frac=0.2, ignore_index=spec.ignore_index)
    kwargs = {}
    kwargs.update(teacher_inputs(spec, logits, targets, seed + 1))
    kwargs.update(row_inputs(spec, (B, T), seed + 2))
    if spec.policy is not None:
        logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        kwargs.update(advantages=torch.randn(B, generator=gen),
                      old_logprobs=logp + 0.2 * torch.randn(B, T, generator=gen))
        if spec.policy.kl_beta:
            kwargs["ref_logprobs"] = logp + 0.2 * torch.randn(B, T, generator=gen)
        if spec.policy.off_policy_mask is not None:
            kwargs["rollout_logprobs"] = kwargs["old_logprobs"] + 0.1 * torch.randn(B, T, generator=gen)
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / 2
    return dict(logits=logits, hidden=hidden, weight=weight, targets=targets, kwargs=kwargs)


def _call(entry: str, spec: LossSpec, backend: str, seed: int):
    case = _inputs(spec, seed)
    if entry == "head_loss":
        return head_loss(case["logits"], case["targets"], spec, backend=backend, **case["kwargs"])
    return linear_head_loss(case["hidden"], case["weight"], case["targets"], spec, backend=backend,
                            chunk_bytes=5 * V * 4, **case["kwargs"])


LINEAR_FAST = ("sft-every-term", "deferred-sft", "distill-jsd", "distill-topk-rest-and-z", "grpo-kl", "gspo",
               "top-entropy", "verl-gmpo", "verl-kl-cov")
"""One spec of each route and term family the fused head runs in the fast tier."""


@needs_kernel
@pytest.mark.parametrize(("name", "entry"), [  # (the fused head's plan orders the metrics as the logits path's
    pytest.param(name, entry, marks=pytest.mark.slow)  # does: its cases past LINEAR_FAST in the slow tier)
    if entry == "linear_head_loss" and name not in LINEAR_FAST else (name, entry)
    for name in SPECS for entry in ("head_loss", "linear_head_loss")])
def test_both_paths_list_the_metrics_in_the_one_order(name, entry):
    spec = SPECS[name]
    kernel = _call(entry, spec, "triton", seed=len(name))
    plain = _call(entry, spec, "torch", seed=len(name))
    names = list(kernel.metrics)
    assert names == list(plain.metrics), (kernel.route, plain.route)
    assert names == [metric for metric in METRIC_ORDER if metric in names]  # every name listed, in its place
    for out in (kernel, plain):  # packed_metrics() holds the values in that order
        assert out.packed_metrics().tolist() == [float(value) for value in out.metrics.values()]


def test_the_readmes_order():
    """README's example (configs/sft_zloss.yaml): loss, ce, z_loss, entropy, token_accuracy, n_tokens."""
    spec = SPECS["config:sft_zloss"]
    case = _inputs(spec, 3)
    out = head_loss(case["logits"], case["targets"], spec, backend="torch")
    assert list(out.metrics) == ["loss", "ce", "z_loss", "entropy", "token_accuracy", "n_tokens"]


def test_the_order_follows_the_spec_fields():
    """Each term's metrics sit where its field sits in LossSpec; loss first, n_tokens last."""
    fields = list(LossSpec.model_fields)
    assert METRIC_ORDER.index("ce") < METRIC_ORDER.index("z_loss") < METRIC_ORDER.index("dft") < \
        METRIC_ORDER.index("entropy") < METRIC_ORDER.index("distill/divergence") < \
        METRIC_ORDER.index("clip_ratio/low_mean") < METRIC_ORDER.index("token_accuracy")
    assert fields.index("cross_entropy") < fields.index("z_loss") < fields.index("dft") < fields.index("entropy") < \
        fields.index("distillation") < fields.index("policy") < fields.index("token_accuracy")
    assert METRIC_ORDER[0] == "loss" and METRIC_ORDER[-1] == "n_tokens"


def test_in_metric_order_puts_unlisted_names_before_n_tokens():
    metrics = {"n_tokens": 0, "mine": 1, "token_accuracy": 2, "loss": 3, "other": 4, "ce": 5}
    assert list(in_metric_order(metrics)) == ["loss", "ce", "token_accuracy", "mine", "other", "n_tokens"]
    ordered = {"loss": 0, "ce": 1, "n_tokens": 2}
    assert in_metric_order(ordered) is ordered


@pytest.mark.parametrize("spec_name", ["sft-every-term", "grpo-kl"])
def test_the_accumulator_computes_in_the_one_order(spec_name):
    spec = SPECS[spec_name]
    acc = MetricsAccumulator()
    named = MetricsAccumulator(names=TRL_NAMES, prefix="train/")
    for seed in (1, 2):
        case = _inputs(spec, seed)
        out = head_loss(case["logits"], case["targets"], spec, backend="torch", **case["kwargs"])
        acc.update(out)
        named.update(out)
    order = list(out.metrics)
    assert list(acc.compute()) == order
    assert list(named.compute()) == ["train/" + TRL_NAMES.get(name, name) for name in order]
