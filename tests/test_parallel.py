"""Vocab-parallel head_loss on 2 and 3 gloo ranks (CPU; the kernels under the interpreter, and the
reference path): every output equals the single-process result on the whole vocabulary, each
rank's gradient is its slice, one collective per call. The compiled calls run under the aot_eager
backend in the fast tier (Dynamo's trace, the ops' fakes, AOTAutograd's joint graph; no code
generated) and under Inductor in the slow tier (whose cold start each rank would pay)."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import needs_kernel, seed_of, spawn_ranks
from torch._dynamo.testing import CompileCounterWithBackend

from headloss import CrossEntropy, Entropy, LogitTransform, LossSpec, Policy, ZLoss, head_loss

V = 53  # split unevenly below
OUTPUTS = ("predicted_tokens", "logprobs", "lse", "token_loss", "entropy")
SPECS = {
    "full_sft": LossSpec(z_loss=ZLoss(weight=1e-2), entropy=Entropy(weight=0.0), token_accuracy=True,
                         outputs=OUTPUTS),
    "smoothing_softcap_temperature": LossSpec(
        cross_entropy=CrossEntropy(label_smoothing=0.1), entropy=Entropy(weight=0.05), token_accuracy=True,
        transform=LogitTransform(logit_scale=1.3, softcap=4.0, temperature=0.7), outputs=OUTPUTS),
    "dft_sum": LossSpec(cross_entropy=None, dft={"weight": 1.0}, reduction="sum", outputs=("logprobs",)),
    "grpo": LossSpec(cross_entropy=None, entropy=Entropy(weight=0.0),
                     policy=Policy(loss_type="dapo", kl_beta=0.04, eps_high=0.28)),
    "distill_forward_kl": LossSpec(distillation={"divergence": "forward_kl", "weight": 0.7}, token_accuracy=True,
                                   outputs=("predicted_tokens",)),
    "distill_reverse_kl_temperature": LossSpec(distillation={"divergence": "reverse_kl", "temperature": 2.0},
                                               entropy=Entropy(weight=0.0)),
    "distill_jsd": LossSpec(distillation={"divergence": "jsd", "temperature": 1.5}),
    # a sparse teacher: each rank scores the top-k ids in its shard, their logits merged in the same all_gather
    "distill_topk_rest": LossSpec(distillation={"teacher": "topk", "topk": "rest", "divergence": "jsd"},
                                  token_accuracy=True),
    "distill_topk_verl": LossSpec(cross_entropy=None, distillation={"teacher": "topk", "log_prob_min_clamp": -6.0},
                                  transform=LogitTransform(softcap=4.0)),
    "distill_token": LossSpec(distillation={"teacher": "token", "estimator": "k3", "estimator_clamp": True}),
    # a top-k teacher given as probabilities [.., K] (replicated, as its ids)
    "distill_topk_probs": LossSpec(distillation={"teacher": "topk", "topk": "rest", "divergence": "reverse_kl"}),
    "gspo": LossSpec(cross_entropy=None, policy=Policy(loss_type="grpo", importance_sampling="sequence")),
    "deferred": LossSpec(cross_entropy=CrossEntropy(label_smoothing=0.05), z_loss=ZLoss(weight=1e-2),
                         entropy=Entropy(weight=0.02), reduction="none", outputs=("logprobs", "lse", "entropy"),
                         differentiable_outputs=True),
    # each row at its own temperature (the call's `temperature`): every kernel of the shard reads it
    "row_temperature": LossSpec(cross_entropy=CrossEntropy(label_smoothing=0.1), entropy=Entropy(weight=0.05),
                                token_accuracy=True, transform=LogitTransform(softcap=4.0, per_row_temperature=True),
                                outputs=OUTPUTS),
    # a teacher given as probabilities, sharded like the student: its rows' mass checked after the merge
    "distill_probs_jsd": LossSpec(distillation={"divergence": "jsd", "teacher": "probs"}, token_accuracy=True),
    "distill_jsd_row_temperature": LossSpec(distillation={"divergence": "jsd", "temperature": 1.5},
                                            transform=LogitTransform(per_row_temperature=True)),
    # per-token weights (the call's `token_weights`): the weighted mean's divisor from the replicated weights
    "weighted_sft": LossSpec(cross_entropy=CrossEntropy(label_smoothing=0.1), entropy=Entropy(weight=0.05),
                             token_accuracy=True, token_weights={}, outputs=OUTPUTS),
    "weighted_grpo": LossSpec(cross_entropy=CrossEntropy(weight=0.3), token_weights={},
                              policy=Policy(loss_type="grpo", kl_beta=0.04, entropy_coef=0.01,
                                            entropy_aggregation="token-mean")),
    "weighted_jsd_deferred": LossSpec(distillation={"divergence": "jsd"}, reduction="none",
                                          token_weights={"normalize": "tokens"}, outputs=("logprobs", "entropy"),
                                          differentiable_outputs=True),
    # the selected ids' log-probs (the call's `selected_ids`): their logits merged in the same all_gather, after
    # a top-k teacher's; with differentiable outputs their gradient reaches each shard's own ids
    "selected_topk": LossSpec(distillation={"teacher": "topk", "topk": "rest"}, outputs=("selected_logprobs",),
                              transform=LogitTransform(softcap=4.0)),
    # ... and with their gradient: each shard's list walked by its pass, the teacher's ids rewritten with theirs
    "selected_topk_deferred": LossSpec(distillation={"teacher": "topk", "topk": "rest"},
                                       outputs=("logprobs", "selected_logprobs"), differentiable_outputs=True,
                                       transform=LogitTransform(softcap=4.0)),
    "selected_deferred": LossSpec(entropy=Entropy(weight=0.05), outputs=("logprobs", "selected_logprobs"),
                                  differentiable_outputs=True, transform=LogitTransform(temperature=0.7)),
    # the student's top-k: each shard's keys in the same all_gather, the top k of all of them; with a top-k
    # teacher verl's overlap (k 9 > the first shard of 3 ranks: 7 columns)
    "distill_topk_student": LossSpec(distillation={"teacher": "topk", "log_prob_min_clamp": -6.0}, student_topk=9,
                                     outputs=("topk_ids", "topk_logprobs", "overlap_count", "overlap_token_advantage"),
                                     transform=LogitTransform(softcap=4.0)),
    # a dense teacher beside the student's top-k and selected ids: the merged statistics' rows hold both tails
    "distill_jsd_student_selected": LossSpec(distillation={"divergence": "jsd", "temperature": 1.5}, student_topk=4,
                                             outputs=("topk_ids", "selected_logprobs"), token_accuracy=True),
}


def _splits(world: int) -> list[int]:
    """Uneven contiguous shard widths summing to V."""
    return {2: [30, 23], 3: [7, 31, 15]}[world]



def _inputs(name: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed_of("parallel", name))  # (str hashes differ per process)
    b, t = 3, 5
    logits = (torch.randn(b, t, V, generator=gen, dtype=torch.float64) * 3).to(dtype)
    logits[0, 1, 40] = logits[0, 1].max() + 2.0  # a clear argmax in a later shard
    ids = torch.randint(0, V, (b, t), generator=gen)
    ids[1, 2] = -100
    kwargs = {}
    if name.startswith(("distill", "weighted_jsd", "selected_topk")):
        noise = torch.randn(b, t, V, generator=gen, dtype=torch.float64)
        teacher = (logits.double() + noise).to(dtype)
        if name.startswith(("distill_topk", "selected_topk")):  # 6 ids per row (the first gives 4)
            top = torch.log_softmax(teacher.double(), -1).topk(6, dim=-1)
            ids_k, logprobs = top.indices.clone(), top.values.float()
            ids_k[0, 0, 4:] = -1
            kwargs = dict(teacher_ids=ids_k, teacher_logprobs=logprobs)
            if name == "distill_topk_probs":
                kwargs = dict(teacher_ids=ids_k, teacher_probs=logprobs.exp())
        elif name.startswith("distill_probs"):
            kwargs["teacher_probs"] = torch.softmax(teacher.double(), -1).to(dtype)
        elif name == "distill_token":
            kwargs["teacher_logprobs"] = torch.log_softmax(teacher.double(), -1).gather(
                -1, ids.clamp(min=0)[..., None])[..., 0].float()
        else:
            kwargs["teacher_logits"] = teacher
    if "selected" in name:  # 7 ids per row in every shard, -1 among them and an id twice
        kwargs["selected_ids"] = torch.randint(-1, V, (b, t, 7), generator=gen)
        kwargs["selected_ids"][0, 2, 5] = kwargs["selected_ids"][0, 2, 1] = 40
        if "teacher_ids" in kwargs:  # on the teacher's ids too (rewritten whole after the pass)
            kwargs["selected_ids"][..., 2:4] = kwargs["teacher_ids"][..., :2]
    if name in ("grpo", "gspo", "weighted_grpo"):  # GSPO: sequence-level ratios, the objective in torch (deferred mode)
        old = -torch.rand(b, t, generator=gen) * 4
        kwargs = dict(advantages=torch.randn(b, generator=gen), old_logprobs=old,
                      ref_logprobs=old + 0.1 * torch.randn(b, t, generator=gen),
                      loss_mask=(torch.rand(b, t, generator=gen) > 0.2).float())
    if "row_temperature" in name:  # one per sequence: [B]
        kwargs["temperature"] = 0.4 + 1.2 * torch.rand(b, generator=gen)
    if name.startswith("weighted"):  # one per token, a 0 among them
        kwargs["token_weights"] = 2.0 * torch.rand(b, t, generator=gen)
        kwargs["token_weights"][2, 1] = 0.0
    return logits, ids, kwargs


def _compare(full, sharded, grad_full, grad_local, start, width) -> dict[str, float]:
    """Largest relative differences: loss, metrics, per-token outputs, the gradient slice."""
    errs = {}

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) if b.numel() else 0.0

    errs["loss"] = rel(sharded.loss.detach(), full.loss.detach())
    for k, v in full.metrics.items():
        errs[f"metric {k}"] = rel(sharded.metrics[k], v)
    for k in (*OUTPUTS, "selected_logprobs", "topk_ids", "topk_logprobs", "overlap_count", "overlap_token_advantage"):
        if getattr(full, k, None) is not None:
            errs[f"output {k}"] = rel(getattr(sharded, k), getattr(full, k))
    errs["grad"] = rel(grad_local, grad_full[..., start: start + width])
    return errs


def _backward(out) -> None:
    """The loss (summed when per-token) plus, with differentiable outputs, weighted per-token outputs:
    every upstream gradient the deferred backward combines."""
    total = out.loss.sum()
    for name, w in (("logprobs", 0.3), ("lse", -0.2), ("entropy", 0.1)):
        value = getattr(out, name)
        if value is not None and value.requires_grad:
            total = total + w * value.sum()
    selected = getattr(out, "selected_logprobs", None)
    if selected is not None and selected.requires_grad:  # a gradient of its own per entry
        total = total + (selected * torch.linspace(-1.0, 1.0, selected.numel()).view_as(selected)).sum()
    total.backward()


# the fast tier's cases: each kind of term once (the fused kernel, the deferred policy term, the
# mixture JSD's extra all-reduce), the reference path once, shifted and not
QUICK = {("full_sft", torch.float32, "triton", False), ("full_sft", torch.float32, "torch", True),
         ("deferred", torch.float32, "triton", True), ("grpo", torch.bfloat16, "triton", False),
         ("gspo", torch.float32, "triton", False), ("distill_jsd", torch.float32, "triton", False),
         ("distill_topk_rest", torch.float32, "triton", False), ("row_temperature", torch.float32, "triton", True),
         ("selected_deferred", torch.float32, "triton", True)}


def _cases(quick: bool) -> list[tuple]:
    """(spec name, dtype, backend, shift): every spec in fp32 unshifted, bf16 and shift where they
    change the path; ``quick`` keeps QUICK of them."""
    cases = []
    for name in SPECS:
        for dtype in (torch.float32, torch.bfloat16):
            for backend in ("triton", "torch"):
                for shift in (False, True):
                    if shift and name not in ("full_sft", "deferred", "row_temperature", "weighted_sft",
                                              "selected_deferred"):
                        continue
                    if dtype == torch.bfloat16 and name not in ("full_sft", "grpo", "distill_jsd"):
                        continue
                    cases.append((name, dtype, backend, shift))
    return [case for case in cases if case in QUICK] if quick else cases


def _rank(rank: int, world: int, port: int, jobs: tuple, quick: bool, results) -> None:
    """One process group, the named jobs in turn: results[rank] = {job: what it returns}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = {job: JOBS[job](rank, world, quick) for job in jobs}
    finally:
        dist.destroy_process_group()


def _logits_job(rank: int, world: int, quick: bool) -> tuple:
    from headloss.parallel import COLLECTIVES

    widths = _splits(world)
    start = sum(widths[:rank])
    out = {}
    gathers = []
    original = dist.all_gather

    def counted(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    dist.all_gather = counted
    head_loss(torch.randn(2, widths[rank]), torch.zeros(2, dtype=torch.long), group=dist.group.WORLD)
    first = (len(gathers), COLLECTIVES["layout"])  # the shard layout, exchanged once and cached
    for name, dtype, backend, shift in _cases(quick):
        spec = SPECS[name]
        logits, ids, kwargs = _inputs(name, dtype)
        x = logits.clone().requires_grad_()
        full = head_loss(x, ids, spec, shift=shift, backend=backend, **kwargs)
        _backward(full)
        local = logits[..., start: start + widths[rank]].clone().requires_grad_()
        mine = dict(kwargs)
        for key in ("teacher_logits", "teacher_probs"):  # sharded like the student's (a top-k teacher's: not)
            if key in mine and mine[key].shape[-1] == V:
                mine[key] = mine[key][..., start: start + widths[rank]]
        before = len(gathers), COLLECTIVES["stats"], COLLECTIVES["jsd"]
        sharded = head_loss(local, ids, spec, shift=shift, backend=backend, group=dist.group.WORLD, **mine)
        _backward(sharded)
        calls = (len(gathers) - before[0], COLLECTIVES["stats"] - before[1], COLLECTIVES["jsd"] - before[2])
        errs = _compare(full, sharded, x.grad, local.grad, start, widths[rank])
        out[(name, str(dtype), backend, shift)] = (errs, calls)
    # refusals are raised on every rank, before any collective
    refusals = {}
    for label, call in {
        "target_out_of_range": lambda: head_loss(torch.randn(4, widths[rank]), torch.full((4,), V),
                                                 LossSpec(), group=dist.group.WORLD, backend="triton"),
    }.items():
        try:
            call()
            refusals[label] = None
        except ValueError as exc:
            refusals[label] = str(exc)
    dist.all_gather = original
    return (out, refusals, first, COLLECTIVES["layout"])


def check_logits_job(results, world: int, quick: bool) -> None:
    for rank in range(world):
        out, refusals, first, layouts = results[rank]["logits"]
        assert first == (2, 1) and layouts == 1  # the first call also learnt the layout; never again
        assert len(out) == len(_cases(quick)) == (len(QUICK) if quick else 66)
        for (name, dtype, backend, shift), (errs, calls) in out.items():
            tol = 1e-5 if dtype == "torch.float32" else 2e-2  # bf16: the gradient's own rounding
            for what, err in errs.items():
                limit = tol if what == "grad" else 2e-5
                assert err <= limit, (rank, name, dtype, backend, shift, what, err)
            if backend == "triton":  # one all_gather per call; the mixture JSD adds one all-reduce
                assert calls == (1, 1, int("jsd" in name)), (name, calls)
        assert "outside [0, 53)" in refusals["target_out_of_range"]


def test_merge_matches_the_whole_row():
    """The statistics merge alone, against one row's whole-vocabulary values (no processes)."""
    from headloss.parallel import merge

    gen = torch.Generator().manual_seed(3)
    x2 = torch.randn(4, 10, generator=gen) * 3
    x2[1, 7] = float("-inf")
    x2[2, :4] = float("-inf")  # a shard with nothing but masked columns
    parts = []
    for lo, hi in ((0, 4), (4, 9), (9, 10)):
        seg = x2[:, lo:hi]
        m = seg.max(1).values
        e = torch.where(seg == float("-inf"), 0.0, torch.exp2(seg - m[:, None]))
        row = torch.zeros(4, 8)
        row[:, 0], row[:, 1] = m, e.sum(1)
        row[:, 2] = torch.where(seg == float("-inf"), 0.0, seg).sum(1)
        row[:, 3] = (e * torch.where(seg == float("-inf"), 0.0, seg)).sum(1)
        row[:, 4] = (seg.argmax(1) + lo).float()
        y = torch.tensor([3, 5, 9, 0])
        owned = (y >= lo) & (y < hi)
        at = (y - lo).clamp(0, hi - lo - 1)[:, None]
        row[:, 5] = torch.where(owned, seg.gather(1, at)[:, 0], 0.0)
        row[:, 6] = owned.float()
        parts.append(row)
    merged = merge(torch.stack(parts))
    top = x2.max(1).values
    torch.testing.assert_close(merged[:, 0], top)
    torch.testing.assert_close(merged[:, 1], torch.exp2(x2 - top[:, None]).sum(1))
    torch.testing.assert_close(merged[:, 4], x2.argmax(1).float())
    torch.testing.assert_close(merged[:, 5], x2.gather(1, torch.tensor([[3], [5], [9], [0]]))[:, 0])
    assert torch.equal(merged[:, 6], torch.ones(4))


H = 12
LINEAR_NAMES = ("full_sft", "smoothing_softcap_temperature", "grpo", "gspo", "deferred", "teacher_weight",
                "teacher_logits", "distill_topk_rest", "distill_topk_verl", "distill_token", "row_temperature",
                "distill_probs_jsd", "distill_topk_probs", "weighted_sft", "weighted_grpo", "selected_topk",
                "selected_topk_deferred", "selected_deferred", "distill_topk_student", "distill_jsd_student_selected")
LINEAR_QUICK = ("full_sft", "gspo", "teacher_weight")  # (a row temperature: the logits QUICK; here slow)


def _linear_job(rank: int, world: int, quick: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from headloss import linear_head_loss
    from headloss.parallel import COLLECTIVES

    widths = _splits(world)
    start, width = sum(widths[:rank]), widths[rank]
    out = {}
    distill = LossSpec(distillation={"divergence": "reverse_kl", "temperature": 1.5}, token_accuracy=True)
    jsd = LossSpec(distillation={"divergence": "jsd"}, token_accuracy=True)
    for name in LINEAR_QUICK if quick else LINEAR_NAMES:
        spec = SPECS.get(name, distill if name == "teacher_weight" else jsd)
        for backend in ("triton",) if quick else ("triton", "torch"):
            gen = torch.Generator().manual_seed(seed_of("linear", name))
            hidden = torch.randn(3, 5, H, generator=gen, dtype=torch.float64).float()
            weight = torch.randn(V, H, generator=gen, dtype=torch.float64).float() * 0.5
            bias = torch.randn(V, generator=gen, dtype=torch.float64).float() * 0.1
            _, ids, kwargs = _inputs(name, torch.float32)
            mine = dict(kwargs)
            for key in ("teacher_probs", "teacher_logits"):  # dense: sharded on the vocabulary
                if key in mine and mine[key].shape[-1] == V:
                    mine[key] = mine[key][..., start: start + width]
            if name == "teacher_weight":  # a teacher head: replicated hidden states, its weight's rows sharded
                t_weight = torch.randn(V, H + 2, generator=gen)
                kwargs["teacher_hidden"] = mine["teacher_hidden"] = torch.randn(3, 5, H + 2, generator=gen)
                kwargs["teacher_weight"], mine["teacher_weight"] = t_weight, t_weight[start: start + width]
            if name == "teacher_logits":  # the teacher's logits, sharded on the vocabulary
                t_logits = torch.randn(3, 5, V, generator=gen) * 2
                kwargs["teacher_logits"], mine["teacher_logits"] = t_logits, t_logits[..., start: start + width]
            shift = name not in ("grpo", "gspo", "weighted_grpo")
            h1, w1, b1 = (t.clone().requires_grad_() for t in (hidden, weight, bias))
            full = linear_head_loss(h1, w1, ids, spec, bias=b1, shift=shift, backend=backend, **kwargs)
            _backward(full)
            h2 = hidden.clone().requires_grad_()
            w2 = weight[start: start + width].clone().requires_grad_()
            b2 = bias[start: start + width].clone().requires_grad_()
            before = dict(COLLECTIVES)
            sharded = linear_head_loss(h2, w2, ids, spec, bias=b2, shift=shift, backend=backend,
                                       group=dist.group.WORLD, chunk_bytes=4 * H * 4, **mine)
            _backward(sharded)
            counts = {k: COLLECTIVES[k] - before[k] for k in COLLECTIVES}
            errs = _compare(full, sharded, w1.grad.t(), w2.grad.t(), start, width)
            errs["dh"] = float((h2.grad - h1.grad).abs().max() / h1.grad.abs().max())
            errs["db"] = float((b2.grad - b1.grad[start: start + width]).abs().max() / b1.grad.abs().max())
            out[("linear", name, backend)] = (errs, counts)
    # DTensors: logits sharded on the vocabulary, an lm_head weight sharded on its rows
    mesh = init_device_mesh("cpu", (world,))
    logits, ids, _ = _inputs("full_sft", torch.float32)
    x = logits.clone().requires_grad_()
    full = head_loss(x, ids, SPECS["full_sft"])
    full.loss.backward()
    dx = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_()
    sharded = head_loss(dx, ids, SPECS["full_sft"])
    sharded.loss.backward()
    grad = dx.grad.full_tensor()
    errs = _compare(full, sharded, x.grad, grad, 0, V)
    out[("dtensor", "logits", "triton")] = (errs, {})
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(3, 5, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    full = linear_head_loss(h1, w1, ids, SPECS["full_sft"], shift=True)
    full.loss.backward()
    h2 = hidden.clone().requires_grad_()
    dw = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
    sharded = linear_head_loss(h2, dw, ids, SPECS["full_sft"], shift=True)
    sharded.loss.backward()
    errs = _compare(full, sharded, w1.grad.t(), dw.grad.full_tensor().t(), 0, V)
    errs["dh"] = float((h2.grad - h1.grad).abs().max() / h1.grad.abs().max())
    out[("dtensor", "weight", "triton")] = (errs, {})
    return out


def check_linear_job(results, world: int, quick: bool) -> None:
    for rank in range(world):
        out = results[rank]["linear"]
        assert len(out) == (len(LINEAR_QUICK) if quick else 2 * len(LINEAR_NAMES)) + 2
        for key, (errs, counts) in out.items():
            for what, err in errs.items():
                assert err <= 2e-5, (rank, key, what, err)
            if key[0] == "linear" and key[2] == "triton":
                assert counts["dh"] == 1, (key, counts)  # dh reduced once, in the forward
                assert counts["stats"] >= 3, (key, counts)  # one per chunk: 4-row chunks here


# compiled vocab-parallel calls: the fused kernel (shifted), the fused policy epilogue, the deferred
# policy kernels, the mixture JSD (its second collective), deferred mode with differentiable outputs
COMPILED = ("full_sft", "grpo", "gspo", "distill_jsd", "deferred", "distill_topk_rest", "distill_token")
COMPILED_QUICK = ("grpo",)  # (the dense teacher compiled: the slow tier)


def _compile_backend(quick: bool) -> str:
    """torch.compile's backend: aot_eager in the fast tier, Inductor (the default) in the slow tier."""
    return "aot_eager" if quick else "inductor"


def _compiled_refusals(calls: dict, backend: str) -> dict:
    """Each call's loss under torch.compile(fullgraph=True): its error's text (None if it ran)."""
    out = {}
    for what, call in calls.items():
        try:
            torch.compile(lambda call=call: call().loss, fullgraph=True, backend=backend)()
            out[what] = None
        except Exception as exc:  # (Dynamo wraps it)
            out[what] = str(exc)
    return out


def _compiled_job(rank: int, world: int, quick: bool) -> dict:
    """A vocab-parallel head_loss under torch.compile(fullgraph=True) against the same call in eager
    mode: one graph, the same route, every output and the gradient slice equal."""
    widths = _splits(world)
    start = sum(widths[:rank])
    out = {}
    for name in COMPILED_QUICK if quick else COMPILED:
        spec = SPECS[name]
        logits, ids, kwargs = _inputs(name, torch.float32)
        if "teacher_logits" in kwargs:
            kwargs["teacher_logits"] = kwargs["teacher_logits"][..., start: start + widths[rank]]
        shift = name in ("full_sft", "deferred")

        def step(x, ids=ids, spec=spec, kwargs=kwargs, shift=shift):
            return head_loss(x, ids, spec, shift=shift, backend="triton", group=dist.group.WORLD, **kwargs)

        def fn(x, step=step):
            result = step(x)
            return result.loss, result.metrics, [getattr(result, k) for k in OUTPUTS], result.route

        eager_x = logits[..., start: start + widths[rank]].clone().requires_grad_()
        want = step(eager_x)
        _backward(want)
        torch._dynamo.reset()
        graphs = CompileCounterWithBackend(_compile_backend(quick))  # fullgraph: a break raises, naming it
        x = logits[..., start: start + widths[rank]].clone().requires_grad_()
        loss, metrics, outputs, route = torch.compile(fn, fullgraph=True, backend=graphs)(x)
        got = type(want)(loss, **{k: v for k, v in zip(OUTPUTS, outputs)}, metrics=metrics)
        _backward(got)
        errs = _compare(want, got, eager_x.grad, x.grad, 0, widths[rank])
        out[name] = (errs, graphs.frame_count, (want.route, route))
    torch._dynamo.reset()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    spec, ids = LossSpec(), torch.zeros(3, 5, dtype=torch.long)
    sharded = distribute_tensor(torch.randn(3, 5, V), init_device_mesh("cpu", (world,)), [Shard(2)])
    refusals = {"sync": lambda: head_loss(torch.randn(3, 5, widths[rank]), ids, spec, group=dist.group.WORLD,
                                          validate="sync"),
                "dtensor": lambda: head_loss(sharded, ids, spec),
                "torch": lambda: head_loss(torch.randn(3, 5, widths[rank]), ids, spec, group=dist.group.WORLD,
                                           backend="torch")}
    out.update(_compiled_refusals(refusals, _compile_backend(quick)))
    return out


# compiled vocab-parallel lm_head calls: deferred mode (the forward's merged statistics reach the
# backward op), a computed teacher (its weight's rows sharded), the fused kernel, the policy routes
COMPILED_LINEAR = ("deferred", "teacher_weight", "full_sft", "grpo", "gspo", "distill_topk_verl")
COMPILED_LINEAR_QUICK = ("deferred",)  # (the computed teacher compiled: the slow tier)


def _compiled_linear_job(rank: int, world: int, quick: bool) -> dict:
    """A vocab-parallel linear_head_loss under torch.compile(fullgraph=True) against the same call in
    eager mode: one graph, the same route, every output, dh, the weight's and the bias's gradient
    slices equal; DTensors and validate="sync" refused naming them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from headloss import linear_head_loss

    width = _splits(world)[rank]
    out = {}
    for name in COMPILED_LINEAR_QUICK if quick else COMPILED_LINEAR:
        spec = SPECS.get(name, LossSpec(distillation={"divergence": "reverse_kl", "temperature": 1.5},
                                        token_accuracy=True))
        gen = torch.Generator().manual_seed(seed_of("compiled linear", name))
        hidden = torch.randn(3, 5, H, generator=gen)
        weight = torch.randn(width, H, generator=gen) * 0.5
        bias = torch.randn(width, generator=gen) * 0.1
        _, ids, kwargs = _inputs(name, torch.float32)
        if name == "teacher_weight":
            kwargs["teacher_hidden"] = torch.randn(3, 5, H + 2, generator=gen)
            kwargs["teacher_weight"] = torch.randn(width, H + 2, generator=gen)
        shift = name not in ("grpo", "gspo")

        def fn(h, w, b, ids=ids, spec=spec, kwargs=kwargs, shift=shift):
            result = linear_head_loss(h, w, ids, spec, bias=b, shift=shift, backend="triton", group=dist.group.WORLD,
                                      chunk_bytes=4 * V * 4, **kwargs)
            return result.loss, result.metrics, [getattr(result, k) for k in OUTPUTS], result.route

        def leaves(sources=(hidden, weight, bias)):
            return [t.clone().requires_grad_() for t in sources]

        eager = leaves()
        loss, metrics, outputs, route = fn(*eager)
        want = SimpleNamespace(loss=loss, **dict(zip(OUTPUTS, outputs)), metrics=metrics, route=route)
        _backward(want)
        torch._dynamo.reset()
        graphs = CompileCounterWithBackend(_compile_backend(quick))  # fullgraph: a break raises, naming it
        compiled = leaves()
        loss, metrics, outputs, route = torch.compile(fn, fullgraph=True, backend=graphs)(*compiled)
        got = SimpleNamespace(loss=loss, **dict(zip(OUTPUTS, outputs)), metrics=metrics, route=route)
        _backward(got)
        errs = _compare(want, got, eager[1].grad.t(), compiled[1].grad.t(), 0, width)
        for what, i in (("dh", 0), ("db", 2)):
            errs[what] = float((compiled[i].grad - eager[i].grad).abs().max() / eager[i].grad.abs().max())
        out[name] = (errs, graphs.frame_count, (want.route, got.route))
    torch._dynamo.reset()
    hidden, ids = torch.randn(3, 5, H), torch.zeros(3, 5, dtype=torch.long)
    weight = torch.randn(width, H)
    sharded = distribute_tensor(torch.randn(V, H), init_device_mesh("cpu", (world,)), [Shard(0)])
    refusals = {"sync": lambda: linear_head_loss(hidden, weight, ids, group=dist.group.WORLD, validate="sync"),
                "dtensor": lambda: linear_head_loss(hidden, sharded, ids),
                "torch": lambda: linear_head_loss(hidden, weight, ids, group=dist.group.WORLD, backend="torch")}
    out.update(_compiled_refusals(refusals, _compile_backend(quick)))
    return out


def check_compiled_job(results, world: int, quick: bool) -> None:
    for rank in range(world):
        linear = results[rank]["compiled_linear"]
        refused = ("sync", "dtensor", "torch")
        assert set(linear) == {*(COMPILED_LINEAR_QUICK if quick else COMPILED_LINEAR), *refused}
        assert "validate: 'sync' waits on the host" in linear.pop("sync")
        assert "weight: a DTensor is not traceable by torch.compile" in linear.pop("dtensor")
        assert "group: the plain-torch path of a vocab-parallel call" in linear.pop("torch")
        out = results[rank]["compiled"]
        assert set(out) == {*(COMPILED_QUICK if quick else COMPILED), *refused}
        assert "validate: 'sync' waits on the host" in out.pop("sync")
        assert "logits: a DTensor is not traceable by torch.compile" in out.pop("dtensor")
        assert "group: the plain-torch path of a vocab-parallel call" in out.pop("torch")
        out.update({("linear", name): value for name, value in linear.items()})
        for name, (errs, graphs, routes) in out.items():
            assert graphs == 1, (rank, name, graphs)  # one graph, no break (fullgraph)
            assert routes[0] == routes[1], (rank, name, routes)
            for what, err in errs.items():
                assert err <= 1e-5, (rank, name, what, err)


JOBS = {"logits": _logits_job, "linear": _linear_job, "compiled": _compiled_job,
        "compiled_linear": _compiled_linear_job}


@needs_kernel
def test_vocab_parallel_logits_on_two_ranks_equal_the_whole_vocabulary():
    """The fast tier's vocab-parallel logits cases (QUICK), in one process group."""
    check_logits_job(spawn_ranks(_rank, 2, ("logits",), True), 2, True)


@needs_kernel
def test_vocab_parallel_lm_head_and_compiled_calls_on_two_ranks_equal_the_whole_vocabulary():
    """The fast tier's vocab-parallel lm_head and compiled cases (LINEAR_QUICK, COMPILED_QUICK,
    COMPILED_LINEAR_QUICK), in a second process group (the two run side by side on two workers)."""
    results = spawn_ranks(_rank, 2, ("linear", "compiled", "compiled_linear"), True)
    check_linear_job(results, 2, True)
    check_compiled_job(results, 2, True)


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_logits_lm_head_and_dtensors_equal_the_whole_vocabulary(world):
    """Every case of the three jobs, on 2 and 3 ranks (uneven shards)."""
    results = spawn_ranks(_rank, world, ("logits", "linear", "compiled", "compiled_linear"), False)
    check_logits_job(results, world, False)
    check_linear_job(results, world, False)
    check_compiled_job(results, world, False)


@needs_kernel
@pytest.mark.parametrize("world", [1, 2, 3])
def test_merge_kernel_equals_the_torch_merge(world):
    from headloss.kernels.shard import launch_merge
    from headloss.parallel import merge

    gen = torch.Generator().manual_seed(world)
    n = 300  # more than one block of rows
    parts = torch.randn(world, n, 8, generator=gen) * 3
    parts[..., 1] = parts[..., 1].abs() + 0.5
    parts[..., 4] = torch.randint(0, 1000, (world, n), generator=gen).float()
    parts[..., 6] = 0.0
    owner = torch.randint(0, world, (n,), generator=gen)
    parts[owner, torch.arange(n), 6] = 1.0
    parts[:, 5, 0] = float("-inf")  # an uncounted row everywhere
    parts[0, 7, 0] = float("-inf")  # one shard fully masked
    parts[:, 9, 0] = 2.5  # a tie: the lowest rank's argmax
    parts[world - 1, 11, 0] = float("nan")  # NaN logits somewhere
    expected = merge(parts)
    got = launch_merge(parts.contiguous())
    got[11, 4] = expected[11, 4] = 0.0  # the argmax of a NaN row means nothing
    torch.testing.assert_close(got[:, :7], expected[:, :7], equal_nan=True)
    assert got[9, 4] == parts[0, 9, 4]
    assert torch.isnan(got[11, 0])


def _rank_errors(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from headloss.parallel import COLLECTIVES

    try:
        widths = _splits(world)
        gen = torch.Generator().manual_seed(1)
        logits = torch.randn(6, V, generator=gen)[:, sum(widths[:rank]): sum(widths[: rank + 1])]
        ids = torch.randint(0, V, (6,), generator=gen)
        out = {}
        cases = {
            "good": (logits, ids),
            "bad_targets_on_rank_1": (logits, ids[:5] if rank == 1 else ids),
            "rows_differ": (logits[:5] if rank == 1 else logits, ids[:5] if rank == 1 else ids),
            "target_out_of_range_on_rank_1": (logits, torch.where(torch.arange(6) == 2, V + 3, ids) if rank == 1
                                              else ids),
            "logits_1d_on_rank_1": (logits[0] if rank == 1 else logits, ids),
        }
        grpo = LossSpec(cross_entropy=None, policy=Policy())
        mask = torch.ones(2, 3)
        if rank == 1:
            mask[1, 2] = 0.5
        policy_cases = {  # [2, 3] rows of the same logits
            "policy_good": dict(advantages=torch.ones(2)),
            "advantages_on_rank_1": dict(advantages=torch.ones(3 if rank == 1 else 2)),
            "loss_mask_on_rank_1": dict(advantages=torch.ones(2), loss_mask=mask),
        }
        for backend in ("triton", "torch"):
            for name, (x, y) in cases.items():
                before = COLLECTIVES["handshake"]
                try:
                    head_loss(x, y, LossSpec(), group=dist.group.WORLD, validate="sync", backend=backend)
                    out[backend, name] = ("ok", COLLECTIVES["handshake"] - before)
                except ValueError as exc:
                    out[backend, name] = (str(exc), COLLECTIVES["handshake"] - before)
            for name, inputs in policy_cases.items():
                before = COLLECTIVES["handshake"]
                try:
                    head_loss(logits.reshape(2, 3, -1), ids.reshape(2, 3), grpo, group=dist.group.WORLD,
                              validate="sync", backend=backend, **inputs)
                    out[backend, name] = ("ok", COLLECTIVES["handshake"] - before)
                except ValueError as exc:
                    out[backend, name] = (str(exc), COLLECTIVES["handshake"] - before)
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@needs_kernel
def test_a_bad_input_on_one_rank_raises_on_every_rank_with_sync_validation():
    """Shapes and values, on the kernel path (the inputs' exchange, then the device's verdict) and on
    the reference path (the rows' exchange before gathering the vocabulary, then the call's error)."""
    results = spawn_ranks(_rank_errors, 2)
    for rank in (0, 1):
        out = results[rank]
        for backend in ("triton", "torch"):
            def expect(name, mine, others, handshakes, out=out, backend=backend, rank=rank):
                message, count = out[backend, name]
                assert count == handshakes, (backend, name, count)
                assert (mine in message) if rank == 1 else (others in message), (backend, name, rank, message)

            assert out[backend, "good"] == ("ok", 2)
            assert out[backend, "policy_good"] == ("ok", 2)
            # kernel: one exchange of the inputs' check, nothing ran; reference: the rows, then the check
            expect("bad_targets_on_rank_1", "targets: shape", "rank(s) [1] rejected", 1 if backend == "triton" else 2)
            expect("advantages_on_rank_1", "advantages: expected", "rank(s) [1] rejected",
                   1 if backend == "triton" else 2)
            # no vocabulary dimension: the layout exchange fails on every rank (rank 1 with its own error)
            expect("logits_1d_on_rank_1", "logits: expected", "every rank needs a non-empty vocabulary shard", 0)
            message, _ = out[backend, "rows_differ"]
            assert "different row counts" in message
            # values: the device's verdict (kernel) or the reference's check, exchanged
            found = "rank(s) [1] found bad" if backend == "triton" else "rank(s) [1] rejected"
            expect("target_out_of_range_on_rank_1", f"value {V + 3} at position (2,)", found, 2)
            expect("loss_mask_on_rank_1", "loss_mask: the value at position (1, 2) is neither 0 nor 1", found, 2)


def _rank_more_errors(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from headloss import linear_head_loss

    try:
        out = {}
        try:  # an empty shard on rank 1: the layout exchange runs first, and fails on every rank
            head_loss(torch.randn(3, 0 if rank == 1 else V), torch.zeros(3, dtype=torch.long), group=dist.group.WORLD)
            out["empty_shard"] = "ok"
        except ValueError as exc:
            out["empty_shard"] = str(exc)
        widths = _splits(world)
        gen = torch.Generator().manual_seed(0)  # the same hidden states on every rank, as vocab-parallel needs
        hidden, weight = torch.randn(4, H, generator=gen), torch.randn(widths[rank], H)
        ids = torch.zeros(4 if rank == 0 else 3, dtype=torch.long)  # wrong on rank 1
        grpo = LossSpec(cross_entropy=None, policy=Policy())
        mask = torch.ones(2, 2)
        if rank == 1:
            mask[0, 1] = 0.5
        for backend in ("triton", "torch"):
            calls = {
                "linear_bad_targets": lambda backend=backend: linear_head_loss(
                    hidden, weight, ids, group=dist.group.WORLD, validate="sync", backend=backend),
                # a policy input checked after the targets (its error, too, reaches every rank)
                "linear_advantages": lambda backend=backend: linear_head_loss(
                    hidden.reshape(2, 2, H), weight, torch.zeros(2, 2, dtype=torch.long), grpo,
                    group=dist.group.WORLD, validate="sync", backend=backend,
                    advantages=torch.ones(3 if rank == 1 else 2)),
                "linear_loss_mask": lambda backend=backend: linear_head_loss(
                    hidden.reshape(2, 2, H), weight, torch.zeros(2, 2, dtype=torch.long), grpo,
                    group=dist.group.WORLD, validate="sync", backend=backend, advantages=torch.ones(2),
                    loss_mask=mask),
                # rows that differ across the ranks (each rank its own batch): refused on every rank
                "linear_hidden_differs": lambda backend=backend: linear_head_loss(
                    hidden + rank, weight, torch.zeros(4, dtype=torch.long), group=dist.group.WORLD,
                    validate="sync", backend=backend),
            }
            for name, call in calls.items():
                try:
                    call()
                    out[backend, name] = "ok"
                except ValueError as exc:
                    out[backend, name] = str(exc)
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@needs_kernel
def test_an_empty_shard_and_a_bad_lm_head_input_raise_on_every_rank():
    results = spawn_ranks(_rank_more_errors, 2)
    for rank in (0, 1):
        out = results[rank]
        assert "non-empty vocabulary shard" in out["empty_shard"]
        for backend in ("triton", "torch"):
            found = "rank(s) [1] found bad" if backend == "triton" else "rank(s) [1] rejected"
            for name, mine, others in (("linear_bad_targets", "targets: shape", "rank(s) [1] rejected"),
                                       ("linear_advantages", "advantages: expected", "rank(s) [1] rejected"),
                                       ("linear_loss_mask", "loss_mask: the value at position (0, 1)", found)):
                message = out[backend, name]
                assert (mine in message) if rank == 1 else (others in message), (backend, name, rank, message)
            assert out[backend, "linear_hidden_differs"].startswith("hidden: differs across the ranks of the group")


def _rank_recipes(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from headloss.logits import _RECIPES
    from headloss.parallel import COLLECTIVES, clear_layouts

    try:
        widths = _splits(world)
        start = sum(widths[:rank])
        gen = torch.Generator().manual_seed(2)
        logits = torch.randn(6, V, generator=gen)
        ids = torch.randint(0, V, (6,), generator=gen)
        local = logits[:, start: start + widths[rank]].contiguous()
        spec = LossSpec(z_loss=ZLoss(weight=1e-3), token_accuracy=True)
        out = {"whole": float(head_loss(logits, ids, spec).loss)}

        def call(y, **kwargs):
            leaf = local.clone().requires_grad_()
            got = head_loss(leaf, y, spec, group=dist.group.WORLD, backend="triton", **kwargs)
            got.loss.backward()
            return float(got.loss), leaf.grad

        before = len(_RECIPES)
        out["first"], grad = call(ids)
        out["recipes_made"] = len(_RECIPES) - before
        out["again"], grad_again = call(ids)
        out["same_grad"] = bool(torch.equal(grad, grad_again))
        out["recipes_after_again"] = len(_RECIPES) - before
        try:  # a repeated call's recipe skips the host checks; the device still checks the values
            call(torch.where(torch.arange(6) == 4, V + 1, ids))
            out["bad_target"] = "ok"
        except ValueError as exc:
            out["bad_target"] = str(exc)
        clear_layouts()  # a new layout, so a new recipe
        layouts = COLLECTIVES["layout"]
        out["after_clear"], _ = call(ids)
        out["layout_exchanges"] = COLLECTIVES["layout"] - layouts
        handshakes = COLLECTIVES["handshake"]
        for _ in range(2):
            call(ids, validate="sync")
        out["sync_handshakes"] = COLLECTIVES["handshake"] - handshakes
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@needs_kernel
def test_a_repeated_group_call_takes_its_recipe_and_keeps_its_promises():
    """A group's repeated call (the default validation) finds its checks and route in a recipe keyed by the
    cached vocabulary layout: the same values, the target values still checked on the device, a new recipe
    after clear_layouts(); validate="sync" calls still exchange every rank's verdict each time."""
    results = spawn_ranks(_rank_recipes, 2)
    for rank in (0, 1):
        out = results[rank]
        assert out["first"] == pytest.approx(out["whole"], rel=1e-5)
        assert out["again"] == out["first"] and out["same_grad"]
        assert out["recipes_made"] == 1 and out["recipes_after_again"] == 1
        assert f"targets: value {V + 1} at position (4,)" in out["bad_target"]
        assert out["after_clear"] == out["first"] and out["layout_exchanges"] == 1
        assert out["sync_handshakes"] == 4  # two a call: the inputs, then the device verdict
