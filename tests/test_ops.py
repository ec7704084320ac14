"""torch.compile(fullgraph=True) with the default Inductor backend traces head_loss and
linear_head_loss in one graph: on CPU through the plain-torch reference, and on the kernel path
through the ``headloss::`` torch.library ops (here the interpreter runs them; on a GPU the compiled
kernels, tests/test_gpu.py). ``torch.library.opcheck`` passes for every op."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_close_norm, make_logits, make_targets, needs_kernel

import headloss
from headloss import LossSpec, head_loss, linear_head_loss
from headloss.chunks import LinearRun
from headloss.engine import HeadRun
from headloss.head import CallTensors
from headloss.kernels.sparse import block_of
from headloss.linear_ops import run_args
from headloss.ops import flat_geometry, geo_ints, hand_off
from headloss.output import RETAIN_GRAPH_ERROR

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
V = 37
SFT = LossSpec(z_loss={"weight": 1e-3}, entropy={"weight": 0.0}, token_accuracy=True,
               outputs=("predicted_tokens", "logprobs"))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compare(step, *inputs):
    """Compiled (fullgraph) and eager ``step`` give the same outputs and input gradients."""
    eager_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    compiled_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    want = step(*eager_in)
    got = torch.compile(step, fullgraph=True)(*compiled_in)
    for a, b in zip(got, want):
        assert_close_norm(a, b, rtol=1e-5, atol=1e-6, name="output")
    got[0].sum().backward()
    want[0].sum().backward()
    for a, b in zip(compiled_in, eager_in):
        if a.requires_grad:
            assert_close_norm(a.grad, b.grad, rtol=1e-5, atol=1e-7, name="grad")


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", [SFT, SFT.to_dict(), str(CONFIGS / "sft_zloss.yaml")], ids=["LossSpec", "dict", "path"]
)
def test_reference_path_compiles_in_one_graph_with_any_spec_form(spec):
    def step(x, y):
        out = head_loss(x, y, spec, backend="torch")
        return out.loss, out.metrics["z_loss"], out.metrics["token_accuracy"]

    _compare(step, make_logits((6, V), seed=1).requires_grad_(), make_targets((6,), V, seed=1, ignore_frac=0.2))


@pytest.mark.slow
def test_reference_policy_path_compiles_in_one_graph():
    spec = LossSpec(cross_entropy=None, policy={"loss_type": "grpo", "kl_beta": 0.04, "entropy_coef": 0.01})
    gen = torch.Generator().manual_seed(3)
    adv = torch.randn(2, generator=gen)
    old, ref = -torch.rand(2, 3, generator=gen) - 3, -torch.rand(2, 3, generator=gen)

    def step(x, y):
        out = head_loss(x, y, spec, advantages=adv, old_logprobs=old, ref_logprobs=ref - 3, backend="torch")
        return out.loss, out.metrics["clip_ratio/low_min"], out.metrics["kl"], out.metrics["ratio/max"]

    _compare(step, make_logits((2, 3, V), seed=3).requires_grad_(), make_targets((2, 3), V, seed=3))


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [SFT, LossSpec(reduction="none", outputs=("entropy",), differentiable_outputs=True)],
    ids=["fused", "deferred"],
)
def test_kernel_path_compiles_in_one_graph_through_the_ops(spec):
    def step(x, y):
        out = head_loss(x, y, spec, backend="triton")
        return out.loss, out.metrics["loss"]

    _compare(step, make_logits((2, 3, V), seed=4).requires_grad_(), make_targets((2, 3), V, seed=4, ignore_frac=0.2))


@needs_kernel
@pytest.mark.slow
def test_kernel_path_compiles_with_shift_and_a_teacher():
    spec = LossSpec(cross_entropy={"weight": 0.5}, distillation={"divergence": "jsd", "temperature": 2.0})

    def step(x, t, y):
        out = head_loss(x, y, spec, teacher_logits=t, shift=True, backend="triton")
        return out.loss, out.metrics["distill/divergence"]

    _compare(step, make_logits((2, 4, V), seed=5).requires_grad_(), make_logits((2, 4, V), seed=6),
             make_targets((2, 3), V, seed=5))


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("spec", [SFT, LossSpec(reduction="none")], ids=["fused", "deferred"])
def test_linear_head_compiles_in_one_graph(spec):
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(V, 8, generator=gen).requires_grad_()

    def step(h, w, y):
        out = linear_head_loss(h, w, y, spec, chunk_bytes=3 * V * 4, backend="triton")
        return out.loss, out.metrics["loss"]

    _compare(step, torch.randn(7, 8, generator=gen).requires_grad_(), weight, make_targets((7,), V, seed=8,
                                                                                           ignore_frac=0.2))


# --- opcheck ------------------------------------------------------------------------------------------


def _plan_key(spec: LossSpec) -> str:
    return headloss.plan.compile_plan(spec).key


@needs_kernel
@pytest.mark.parametrize("grad_mode", ["none", "fresh", "handoff"])
def test_opcheck_head_forward(grad_mode):
    from headloss.inputs import geometry
    from headloss.validation import Normaliser

    spec = LossSpec(z_loss={"weight": 1e-3}, token_accuracy=True, outputs=("predicted_tokens",))
    logits, targets = make_logits((5, V), seed=9), make_targets((5,), V, seed=9)
    geo = geometry((5, V), (0, V), 5, 0, None, -100, Normaliser())
    run = HeadRun(headloss.plan.compile_plan(spec), geo, False, "off", (5,))
    args = (logits, [*CallTensors(targets), None, None], *run.op_args(), grad_mode, 0)
    # a handoff token names its own buffers, so two calls' tokens differ by design: the AOT check,
    # which compares two calls' outputs, runs for the other modes (the compile tests cover handoff)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    op = torch.ops.headloss.head_forward_beside if grad_mode == "handoff" else torch.ops.headloss.head_forward
    torch.library.opcheck(op.default, args, **(dict(test_utils=utils) if grad_mode == "handoff" else {}))


@needs_kernel
def test_opcheck_head_backward():
    from headloss.inputs import geometry
    from headloss.validation import Normaliser

    spec = LossSpec(reduction="none", outputs=("lse",), differentiable_outputs=True)
    logits, targets = make_logits((5, V), seed=10), make_targets((5,), V, seed=10)
    geo = geometry((5, V), (0, V), 5, 0, None, -100, Normaliser())
    run = HeadRun(headloss.plan.compile_plan(spec), geo, False, "off", (5,))
    loss, rows, pred, means, scratch, _ = torch.ops.headloss.head_forward(
        logits, [*CallTensors(targets), None, None], *run.op_args(), "none", 0)
    args = (logits, [targets, None, rows, torch.rand(5), torch.rand(rows.shape), None, scratch, None, None, None,
                     None, None, None], *run.op_args())
    torch.library.opcheck(torch.ops.headloss.head_backward.default, args)


def _checked_merged_stats(logits, targets, teacher, ids, logprobs, key, ints):
    """The shard statistics and their merge, each through opcheck; the merged statistics of one shard."""
    from headloss.head import merge_stats_op, shard_stats_op

    torch.library.opcheck(shard_stats_op.op, (logits, targets, teacher, ids, logprobs, None, None, key, ints, 0.0))
    part = shard_stats_op(logits, targets, teacher, ids, logprobs, None, None, key, ints, 0.0)
    tail = 0 if ids is None else block_of(ids.shape[-1])
    torch.library.opcheck(merge_stats_op.op, (torch.stack([part, part]), False, tail, 0))
    return merge_stats_op(part[None], False, tail, 0)


@needs_kernel
def test_opcheck_vocab_parallel_ops():
    """The shard statistics, their merge and the mixture JSD's shares (a compiled vocab-parallel call),
    here on a shard that is the whole vocabulary; and the head kernel and its backward on merged
    statistics."""
    from headloss.head import shard_jsd_op
    from headloss.inputs import geometry
    from headloss.validation import Normaliser

    spec = LossSpec(distillation={"divergence": "jsd", "beta": 0.3}, reduction="none")
    logits, teacher = make_logits((5, V), seed=13), make_logits((5, V), seed=14)
    targets = make_targets((5,), V, seed=13)
    geo = geometry((5, V), (0, V), 5, 0, teacher, -100, Normaliser())._replace(V_total=V)
    key = _plan_key(spec)
    ints = geo_ints(geo)
    stats = _checked_merged_stats(logits, targets, teacher, None, None, key, ints)
    torch.library.opcheck(shard_jsd_op.op, (logits, targets, teacher, stats, None, key, ints, 0.0))
    jsd = shard_jsd_op(logits, targets, teacher, stats, None, key, ints, 0.0)
    run = HeadRun(headloss.plan.compile_plan(spec), geo, False, "off", (5,))
    forward = (logits, [*CallTensors(targets, teacher), stats, jsd], *run.op_args(), "none", 0)
    torch.library.opcheck(torch.ops.headloss.head_forward.default, forward)
    loss, rows, pred, means, scratch, _ = torch.ops.headloss.head_forward(*forward)
    torch.library.opcheck(torch.ops.headloss.head_backward.default,
                          (logits, [targets, teacher, rows, torch.rand(5), None, None, scratch, stats, None, None,
                                    None, None, None], *run.op_args()))


@needs_kernel
@pytest.mark.slow  # (the same ops with more tensor arguments; their opcheck without them is fast)
def test_opcheck_ops_with_a_top_k_teacher():
    """A top-k teacher through the ops: its ids and log-probs in the tensor lists, its K logits after the
    merged statistics of a vocab-parallel call (here one shard holding the whole vocabulary)."""
    from headloss.inputs import geometry
    from headloss.validation import Normaliser

    spec = LossSpec(distillation={"teacher": "topk", "topk": "rest", "divergence": "reverse_kl"}, reduction="none")
    logits, targets = make_logits((5, V), seed=15), make_targets((5,), V, seed=15)
    gen = torch.Generator().manual_seed(16)
    ids = torch.stack([torch.randperm(V, generator=gen)[:3] for _ in range(5)])
    # a teacher's log-probs of those ids (its mass on them below 1: the rest outcome has some)
    logprobs = torch.log_softmax(torch.randn(5, V, generator=gen) * 2, -1).gather(-1, ids)
    ids[1, 2] = -1
    geo = geometry((5, V), (0, V), 5, 0, None, -100, Normaliser())._replace(V_total=V)
    key = _plan_key(spec)
    ints = geo_ints(geo)
    stats = _checked_merged_stats(logits, targets, None, ids, logprobs, key, ints)
    run = HeadRun(headloss.plan.compile_plan(spec), geo, False, "off", (5,))
    call = CallTensors(targets, teacher_ids=ids, teacher_logprobs=logprobs)
    for merged in (None, stats):
        forward = (logits, [*call, merged, None], *run.op_args(), "none", 0)
        torch.library.opcheck(torch.ops.headloss.head_forward.default, forward)
        loss, rows, pred, means, scratch, _ = torch.ops.headloss.head_forward(*forward)
        torch.library.opcheck(torch.ops.headloss.head_backward.default,
                              (logits, [targets, None, rows, torch.rand(5), None, None, scratch, merged, ids,
                                        logprobs, None, None, None], *run.op_args()))


@needs_kernel
@pytest.mark.parametrize("test_util", ["test_schema", "test_autograd_registration", "test_faketensor"])
def test_opcheck_take_grad(test_util):
    """take_grad consumes its token's buffer (a second call is the retain-graph error), so each check
    gets a fresh token; test_aot_dispatch_dynamic calls the op twice and is covered by the compile
    tests above instead."""
    grad = torch.randn(5, V)
    token = hand_off([(grad.clone(), flat_geometry(grad))])
    torch.library.opcheck(torch.ops.headloss.take_grad.default, (token, torch.tensor([2.0]), 0, [5, V], grad.dtype),
                          test_utils=test_util)


@needs_kernel
def test_take_grad_scales_once_and_refuses_a_second_take():
    grad = torch.randn(5, V)
    token = hand_off([(grad.clone(), flat_geometry(grad))])
    got = torch.ops.headloss.take_grad(token, torch.tensor([2.0]), 0, [5, V], grad.dtype)
    torch.testing.assert_close(got, 2 * grad)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.ops.headloss.take_grad(token, torch.tensor([2.0]), 0, [5, V], grad.dtype)
    with pytest.raises(RuntimeError, match="holds no gradient"):
        torch.ops.headloss.take_grad(torch.zeros(1, dtype=torch.int64), torch.tensor([2.0]), 0, [5, V], grad.dtype)
    assert "retain_graph" in RETAIN_GRAPH_ERROR


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_compiled_fused_backward_hands_over_the_forward_buffer_without_a_copy(entry, monkeypatch):
    """Under compile a large fused gradient (here: every one) reaches backward beside the graph: the
    gradient autograd delivers is the very buffer the forward kernel wrote (Inductor would clone a
    backward-graph input before scaling it), scaled by d loss; a second backward raises as in eager."""
    import headloss.engine
    import headloss.linear_ops

    monkeypatch.setattr(headloss.ops, "HANDOFF_MIN_BYTES", 0)
    written = []

    def recording(grads):
        written.extend(g.data_ptr() for g, _ in filter(None, grads))
        return hand_off(grads)

    for module in (headloss.engine, headloss.linear_ops):  # the head's and the lm_head's forward ops
        monkeypatch.setattr(module, "hand_off", recording)
    gen = torch.Generator().manual_seed(14)
    if entry == "logits":
        x = make_logits((6, V), seed=14).requires_grad_()
        leaves = (x,)

        def step(x, y):
            return 3.0 * head_loss(x, y, SFT).loss
    else:
        x = torch.randn(6, 8, generator=gen).requires_grad_()
        w = torch.randn(V, 8, generator=gen).requires_grad_()
        leaves = (x, w)

        def step(x, y):
            return 3.0 * linear_head_loss(x, w, y, SFT).loss
    y = make_targets((6,), V, seed=14)
    loss = torch.compile(step, fullgraph=True)(x, y)
    loss.backward(retain_graph=True)
    assert written and all(leaf.grad.data_ptr() in written for leaf in leaves)
    want = [leaf.grad.clone() for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    (step(*leaves[:1], y) if entry == "hidden" else step(x, y)).backward()
    for got, ref in zip(want, (leaf.grad for leaf in leaves)):
        assert_close_norm(got, ref, rtol=1e-5, atol=1e-7, name="grad")
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@needs_kernel
@pytest.mark.parametrize("spec, handoff",
                         [(LossSpec(), False), (LossSpec(), True), (LossSpec(reduction="none"), False)],
                         ids=["fused", "fused-handoff", "deferred"])
def test_opcheck_linear_ops(spec, handoff):
    gen = torch.Generator().manual_seed(11)
    hidden, weight = torch.randn(7, 8, generator=gen), torch.randn(V, 8, generator=gen)
    targets = make_targets((7,), V, seed=11)
    run = LinearRun(plan=headloss.plan.compile_plan(spec), chunk_rows=3, fp32_weight_grad=False, compact=False,
                    validate="off", token_shape=(7,), ignore_index=-100, norm=0.0)
    policy_tensors, *args = run_args(run)
    forward_args = (hidden, weight, None, [*CallTensors(targets), *policy_tensors], *args, [True, True, False],
                    handoff)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")  # see test_opcheck_head_forward
    op = torch.ops.headloss.linear_forward_beside if handoff else torch.ops.headloss.linear_forward
    torch.library.opcheck(op.default, forward_args, **(dict(test_utils=utils) if handoff else {}))
    loss, rows, pred, means, scratch, *_ = torch.ops.headloss.linear_forward(*forward_args)
    d_loss = torch.rand(loss.shape if spec.reduction == "none" else ())
    backward_args = (hidden, weight, None, [*CallTensors(targets), rows, scratch, d_loss, None, None], *args,
                     [True, True, False])
    torch.library.opcheck(torch.ops.headloss.linear_backward.default, backward_args)


@needs_kernel
def test_opcheck_policy_ops():
    """The deferred mode's policy objective (its loss, metrics and d rows, or d rows alone) and the
    per-sequence clip extremes as ops; and the policy inputs carried through the lm_head's op
    (sequence chunks)."""
    from headloss.objective import policy_objective_op
    from headloss.policy.metrics import sequence_extremes
    from headloss.policy.tokens import PolicyTokens, policy_as_lists, policy_from_lists

    gen = torch.Generator().manual_seed(12)
    batch, length = 3, 4
    n = batch * length
    spec = LossSpec(cross_entropy=None, policy={"importance_sampling": "sequence", "kl_beta": 0.04,
                                                "entropy_coef": 0.01})
    plan = headloss.plan.compile_plan(spec)
    rows = torch.randn(n, plan.cols.N, generator=gen)
    old, ref = -torch.rand(n, generator=gen) - 1, -torch.rand(n, generator=gen) - 1
    adv, mask = torch.randn(n, generator=gen), (torch.rand(n, generator=gen) > 0.3).float()
    weight = mask / mask.sum()
    for metrics, grad in ((True, True), (False, True), (True, False)):
        args = (rows, [old, ref, adv, None, mask, weight, old, torch.rand(())], plan.key,
                [0, batch, length, 1, int(metrics), int(grad)])
        torch.library.opcheck(policy_objective_op.op, args)
    ratio, low, high = (torch.rand(n, generator=gen) for _ in range(3))
    means = [torch.rand((), generator=gen) for _ in range(3)]
    torch.library.opcheck(sequence_extremes.op, (ratio, low, high, mask, mask.sum(), *means, batch, length))
    inp = PolicyTokens(advantages=adv, old_logprobs=old, ref_logprobs=None, importance_weights=None, seq=None,
                       n_slots=batch, n_seq=torch.tensor(batch), seq_len=length, num_items_in_batch=7.0, mask=mask,
                       weight=weight, sequence_level=True, norm_length=None, adv_span=2, raw=True)
    back = policy_from_lists(*policy_as_lists(inp))
    for name, value in vars(inp).items():
        got = getattr(back, name)
        assert got is value if isinstance(value, torch.Tensor) else (got == value and type(got) is type(value)), name
    assert policy_from_lists(*policy_as_lists(None)) is None


@pytest.mark.slow
def test_a_spec_object_held_anywhere_compiles():
    """A LossSpec as a global, a default argument or a closure variable is read by attribute at trace
    time (pydantic's serializer cannot be traced)."""
    def step(x, y, spec=SFT):
        return (head_loss(x, y, spec, backend="torch").loss,)

    _compare(step, make_logits((6, V), seed=12).requires_grad_(), make_targets((6,), V, seed=12))


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_offloading_saved_tensors_under_compile_needs_the_handoff_off(entry, monkeypatch):
    """A saved-tensor hook that copies saved tensors (as save_on_cpu(pin_memory=True) does; here a
    clone) cannot carry the hand-off token of a large gradient: backward raises naming the cause.
    A gradient kept in the graph (a small one, or any with HEADLOSS_COMPILE_HANDOFF=0) is a saved
    tensor like any other: equal to eager."""
    gen = torch.Generator().manual_seed(15)
    x = make_logits((6, V), seed=15) if entry == "logits" else torch.randn(6, 8, generator=gen)
    w = torch.randn(V, 8, generator=gen)
    y = make_targets((6,), V, seed=15)

    def step(x, w, y):
        out = head_loss(x, y, SFT) if entry == "logits" else linear_head_loss(x, w, y, SFT)
        return 2.0 * out.loss

    def run(compiled):
        leaves = [x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            loss = (torch.compile(step, fullgraph=True) if compiled else step)(*leaves, y)
        loss.backward()
        return [leaf.grad for leaf in leaves]

    def same(got):
        for a, b in zip(got, want):
            if b is not None:
                assert_close_norm(a, b, rtol=1e-5, atol=1e-7, name="grad")

    want = run(False)
    same(run(True))  # small: in the graph
    torch._dynamo.reset()
    monkeypatch.setattr(headloss.ops, "HANDOFF_MIN_BYTES", 0)  # every gradient handed over
    with pytest.raises(RuntimeError, match="saved-tensor hook"):
        run(True)
    torch._dynamo.reset()
    monkeypatch.setattr(headloss.env, "COMPILE_HANDOFF", False)
    same(run(True))
