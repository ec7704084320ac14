"""Every route a call takes in eager mode runs under torch.compile(fullgraph=True) with the same kernels
(the ``headloss::`` torch.library ops; here the interpreter runs them, on a GPU tests/test_gpu.py):
the compiled call takes the same route, traces into one graph without a break (``fullgraph=True``
raises at a break, naming it; the backend is handed exactly one graph), and its loss, every metric
(also packed in one tensor) and every input gradient equal eager's.

Two backends: ``aot_eager`` (Dynamo's trace, the ops' fake implementations, AOTAutograd's joint graph
of forward and backward and its partition; the graphs then run eagerly) on FAST's cases (every route,
entry and spec) in the fast tier, on the others in the slow tier; Inductor (the default backend: the
same trace, then code generated around the ops) on every case in the slow tier, whose first compile
pays Inductor's cold start (~40 s of CPU).

The corrected lm_head routes (clip_cov / kl_cov, the guessed top-entropy mask) read a count on the host:
under compile, as under CUDA-graph capture, they take deferred mode, with the same values. (clip_cov's
own draw is a host operation, as verl's torch.randperm is: it breaks the graph on every path.)"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close_norm, generator, make_logits, make_targets, needs_kernel, seed_of
from torch._dynamo.testing import CompileCounterWithBackend

from headloss import LossSpec, head_loss, linear_head_loss
from headloss.plan import SPEC_OBJECT_CONSTANT

pytestmark = needs_kernel

B, T, V, H = 2, 5, 37, 8
DAPO_K3 = {"loss_type": "dapo", "kl_beta": 0.04, "kl_estimator": "k3", "eps_low": 0.2, "eps_high": 0.28}
SPECS = {
    "sft": LossSpec(z_loss={"weight": 1e-3}, entropy={"weight": 0.0}, token_accuracy=True,
                    outputs=("predicted_tokens", "logprobs")),
    "distill": LossSpec(cross_entropy={"weight": 0.5}, distillation={"divergence": "jsd", "beta": 0.3}),
    "deferred": LossSpec(reduction="none", entropy={"weight": 0.1}, outputs=("entropy",)),
    "grpo": LossSpec(cross_entropy=None, policy=DAPO_K3),
    "gspo": LossSpec(cross_entropy=None, policy={**DAPO_K3, "importance_sampling": "sequence", "eps_low": 3e-4,
                                                 "eps_high": 4e-4}),
    "gmpo": LossSpec(cross_entropy=None, policy={"objective": "gmpo", "loss_type": "grpo", "kl_beta": 0.04}),
    "kl_cov": LossSpec(cross_entropy=None, policy={"objective": "kl_cov", "loss_type": "dapo", "cov_ratio": 0.2}),
    "top_entropy": LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "top_entropy_quantile": 0.5}),
}
# (entry, spec, eager route, compiled route when it differs)
CASES = {
    "logits-fused-sft": ("logits", "sft", "fused"),
    "logits-fused-distill": ("logits", "distill", "fused"),
    "logits-deferred": ("logits", "deferred", "deferred"),
    "logits-fused-grpo": ("logits", "grpo", "fused"),
    "logits-fused-grpo-rows": ("rows", "grpo", "fused"),
    "logits-deferred+kernels-gspo": ("logits", "gspo", "deferred+kernels"),
    "logits-deferred+torch-gmpo": ("logits", "gmpo", "deferred+torch"),
    "lm_head-fused-sft": ("hidden", "sft", "lm_head:fused"),
    "lm_head-fused-distill-teacher-hidden": ("teacher", "distill", "lm_head:fused"),
    "lm_head-fused-distill-teacher-logits": ("teacher_logits", "distill", "lm_head:fused"),
    "lm_head-deferred": ("hidden", "deferred", "lm_head:deferred"),
    "lm_head-fused-grpo": ("hidden", "grpo", "lm_head:fused"),
    "lm_head-sequences+kernels-gspo": ("hidden", "gspo", "lm_head:sequences+kernels"),
    "lm_head-sequences+torch-gmpo": ("hidden", "gmpo", "lm_head:sequences+torch"),
    "lm_head-covariance-kl_cov": ("hidden", "kl_cov", "lm_head:covariance", "lm_head:deferred+torch"),
    "logits-deferred+torch-top_entropy": ("logits", "top_entropy", "deferred+torch"),
    "lm_head-entropy-guess": ("hidden", "top_entropy", "lm_head:entropy-guess", "lm_head:deferred+torch"),
}
# the fast tier (aot_eager): every route, entry (logits, rows, hidden, a teacher's hidden) and spec at
# least once. The other six cases take a route FAST takes, with another spec or input: the fused logits
# route (FAST: sft, rows of grpo) with distill and grpo, the fused lm_head (FAST: distill from a teacher's
# hidden states) with sft, grpo and a teacher's logits, deferred+torch on logits (FAST: gmpo) with
# top_entropy (FAST: on the lm_head)
FAST = ("logits-fused-sft", "logits-fused-grpo-rows", "logits-deferred", "logits-deferred+kernels-gspo",
        "logits-deferred+torch-gmpo", "lm_head-fused-distill-teacher-hidden", "lm_head-deferred",
        "lm_head-sequences+kernels-gspo", "lm_head-sequences+torch-gmpo", "lm_head-covariance-kl_cov",
        "lm_head-entropy-guess")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _case(name: str, seed: int):
    """(loss function of the differentiable inputs -> (loss, metrics, route, packed metrics), those
    inputs)."""
    entry, spec_name, *_ = CASES[name]
    spec = SPECS[spec_name]
    gen = generator(seed)
    kwargs = {}
    if spec.policy is not None:
        logp_like = -torch.rand(B, T, generator=gen) - 2.0
        kwargs = dict(advantages=torch.randn(B, generator=gen), old_logprobs=logp_like,
                      ref_logprobs=logp_like - 0.1 * torch.rand(B, T, generator=gen),
                      loss_mask=(torch.rand(B, T, generator=gen) > 0.2).float())
        kwargs["num_items_in_batch"] = kwargs["loss_mask"].sum()
    ids = make_targets((B, T), V, seed=seed)
    if entry in ("logits", "rows"):
        x = make_logits((B, T + 1, V), seed=seed)
        if spec.distillation is not None:
            kwargs["teacher_logits"] = make_logits((B, T + 1, V), seed=seed + 1)
        if entry == "rows":  # [N, V] rows naming their sequences: the per-sequence metrics by torch
            x = x[:, :T].reshape(B * T, V).contiguous()
            kwargs = {k: v.reshape(-1) if k != "advantages" and v.dim() == 2 else v for k, v in kwargs.items()}
            kwargs["advantages"] = kwargs["advantages"].repeat_interleave(T)
            kwargs["sequence_ids"] = torch.arange(B).repeat_interleave(T)

            def fn(x):
                out = head_loss(x, ids.reshape(-1), spec, backend="triton", **kwargs)
                return out.loss, out.metrics, out.route, out.packed_metrics()

            return fn, [x.requires_grad_()]

        def fn(x):
            out = head_loss(x, ids, spec, shift=True, backend="triton", **kwargs)
            return out.loss, out.metrics, out.route, out.packed_metrics()

        return fn, [x.requires_grad_()]
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    if entry == "teacher":
        kwargs.update(teacher_hidden=torch.randn(B, T, H, generator=gen),
                      teacher_weight=torch.randn(V, H, generator=gen) * 0.5)
    if entry == "teacher_logits":
        kwargs["teacher_logits"] = make_logits((B, T, V), seed=seed + 1)

    def fn(h, w):
        out = linear_head_loss(h, w, ids, spec, chunk_bytes=4 * V * 4, backend="triton", **kwargs)
        return out.loss, out.metrics, out.route, out.packed_metrics()

    return fn, [hidden.requires_grad_(), weight.requires_grad_()]


def _grads(result, inputs):
    loss = result[0]
    (loss.sum() if loss.dim() else loss).backward()
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return grads


@pytest.mark.parametrize("name, backend", [
    pytest.param(name, backend, id=f"{name}-{backend}",
                 marks=() if backend == "aot_eager" and name in FAST else pytest.mark.slow)
    for backend in ("aot_eager", "inductor") for name in CASES])
def test_a_compiled_call_takes_the_eager_route_in_one_graph_with_equal_values(name, backend):
    expected = CASES[name][2]
    compiled_route = CASES[name][3] if len(CASES[name]) > 3 else expected
    fn, inputs = _case(name, seed=seed_of("compiled", name))
    want = fn(*inputs)
    assert want[2] == expected
    want_grads = _grads(want, inputs)
    graphs = CompileCounterWithBackend(backend)  # counts the graphs Dynamo hands the backend
    got = torch.compile(fn, fullgraph=True, backend=graphs)(*inputs)
    assert graphs.frame_count == 1
    assert got[2] == compiled_route
    assert_close_norm(got[0], want[0], rtol=1e-5, atol=1e-6, name="loss")
    assert set(got[1]) == set(want[1])
    for key, value in want[1].items():
        assert_close_norm(got[1][key], value, rtol=1e-5, atol=1e-6, name=f"metrics[{key}]")
    for result in (want, got):  # every metric in one float64 tensor, in the dict's order
        assert torch.equal(result[3], torch.stack([v.double() for v in result[1].values()]))
    for a, b in zip(_grads(got, inputs), want_grads):
        assert float(b.norm()) > 0
        assert_close_norm(a, b, rtol=1e-5, atol=1e-7, name="grad")


FRESH_TRACE = """
import torch, headloss
V, H = 41, 10
gen = torch.Generator().manual_seed(17)
for teacher, key in (("logits", "teacher_logits"), ("probs", "teacher_probs")):
    spec = headloss.LossSpec(distillation={"divergence": "jsd", "teacher": teacher})
    y = torch.randint(0, V, (2, 5), generator=gen)
    t = torch.randn(2, 5, V, generator=gen)
    t = t if teacher == "logits" else torch.softmax(t, -1)
    h, w = torch.randn(2, 5, H, generator=gen), torch.randn(V, H, generator=gen)
    def call(h, w, y, t):
        return headloss.linear_head_loss(h, w, y, spec, chunk_bytes=4 * V * 4, **{key: t}).loss
    got = torch.compile(call, backend="aot_eager", fullgraph=True)(h, w, y, t)
    torch.testing.assert_close(got, call(h, w, y, t))
print("traced")
"""


@pytest.mark.slow  # (a fresh interpreter: the dense teacher's in-process compiled cases stay fast)
def test_a_dense_teacher_traces_in_one_graph_in_a_fresh_process():
    """An lm_head call whose teacher rows are an argument of the compiled function, traced first thing in a
    process (no eager call before it): the dense teacher's checks trace in one graph (Dynamo once broke on
    a property of the spec's distillation there)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FRESH_TRACE], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and "traced" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not SPEC_OBJECT_CONSTANT, reason="torch < 2.13: Dynamo gives assume_constant_result no object")
@pytest.mark.parametrize("entry", ["logits", pytest.param("lm_head", marks=pytest.mark.slow)])
def test_dynamic_shapes_take_each_spec_objects_plan(entry):
    """torch.compile(dynamic=True): a LossSpec's floats are not traced as symbols (the plan is read from the
    spec object at trace time), so the call compiles without a break; another LossSpec object (other floats
    and terms) gets its own plan, and another number of rows reuses the dynamic graphs. Each equals eager."""
    specs = (LossSpec(z_loss={"weight": 1e-2}, transform={"temperature": 0.7}),
             LossSpec(cross_entropy={"label_smoothing": 0.1}, entropy={"weight": 0.05}, token_accuracy=True))
    weight = torch.randn(V, H, generator=generator(71))

    def call(x, y, spec):
        if entry == "logits":
            out = head_loss(x, y, spec)
        else:
            out = linear_head_loss(x, weight, y, spec, chunk_bytes=4 * V * 4)
        return out.loss, out.metrics

    graphs = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(call, backend=graphs, dynamic=True, fullgraph=True)
    frames = []
    for rows in (6, 9):
        gen = generator(rows)
        x = torch.randn(rows, V if entry == "logits" else H, generator=gen)
        y = torch.randint(0, V, (rows,), generator=gen)
        for spec in specs:
            (got, got_metrics), (want, want_metrics) = compiled(x, y, spec), call(x, y, spec)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert set(got_metrics) == set(want_metrics)
        frames.append(graphs.frame_count)
    assert frames[1] == frames[0]  # another number of rows: the dynamic graphs again, no recompile
