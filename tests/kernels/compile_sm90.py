"""Compile the kernels that real calls launch for sm_90 (Hopper), on a machine without a GPU.

Run as a script with TRITON_INTERPRET unset (tests/test_compile_sm90.py does). Every kernel launch
of a set of real ``head_loss`` / ``linear_head_loss`` calls on CPU tensors is intercepted: its
keyword arguments (named tuples included) become a Triton signature by the JIT's own specialisation
(tensors are pointers, None is a constexpr, ints i32/i64, floats fp32; pointers and ints divisible by 16
carry that attribute, as on a GPU), and Triton's real front end and backend compile it down to PTX.
Prints {variant: {kernel: ptx}} as JSON.
"""

from __future__ import annotations

import inspect
import json
import sys

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import find_paths_if, get_iterable_path

import headloss
import headloss.env
from headloss.kernels import head, policy, shard, sparse
from headloss.kernels.launch import keyed

HOPPER = GPUTarget("cuda", 90, 32)


def compile_launch(kernel, kwargs: dict) -> str:
    """PTX of one launch's variant, specialised as Triton's JIT specialises a launch (its own
    specialisation of each argument: pointers and ints divisible by 16 carry that attribute, None and
    an int equal to 1 become constexprs, named tuples keep their types)."""
    params = inspect.signature(kernel.fn).parameters
    specialization = []
    for name, param in params.items():
        value = kwargs[name]
        if "constexpr" in str(param.annotation):
            specialization.append(("constexpr", value))
        else:
            specialization.append(native_specialize_impl(BaseBackend, value, False, True, True))
    sigvals = [kind for kind, _ in specialization]
    signature = dict(zip(params, sigvals))
    bound = [kwargs[name] for name in params]
    constexprs = {path: get_iterable_path(bound, path)
                  for path in find_paths_if(sigvals, lambda _, kind: kind == "constexpr")}
    attrvals = [attr for _, attr in specialization]
    attrs = {path: BaseBackend.parse_attr(get_iterable_path(attrvals, path))
             for path in find_paths_if(attrvals, lambda _, attr: isinstance(attr, str))}
    keyed(kernel)  # (as launch does: the layouts' positions key the binary, not only the source)
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=HOPPER, options={"num_warps": kwargs.get("num_warps", 4)}).asm["ptx"]


class Recorder:
    """Stands in for a kernel: records each launch's keyword arguments instead of running it."""

    def __init__(self, kernel, log: list) -> None:
        self.kernel, self.log = kernel, log
        self.fn = kernel.fn

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.log.append((self.kernel, kwargs))

        return launch


def launches(call) -> list:
    """(kernel, kwargs) of every launch ``call()`` makes."""
    log: list = []
    kernels = {head: ("prepare_kernel", "head_kernel", "head_backward_kernel", "finish_kernel", "scale_grad_kernel"),
               shard: ("shard_stats_kernel", "merge_stats_kernel", "shard_jsd_kernel"),
               policy: ("sequence_extremes_kernel", "extremes_finish_kernel", "policy_sequence_kernel",
                        "policy_objective_finish_kernel"),
               sparse: ("check_teacher_kernel", "check_selected_kernel")}
    real = {(module, name): getattr(module, name) for module, names in kernels.items() for name in names}
    try:
        for (module, name), kernel in real.items():
            setattr(module, name, Recorder(kernel, log))
        call()
    finally:
        for (module, name), kernel in real.items():
            setattr(module, name, kernel)
    return log


def _batch(rows=6, vocab=300, dtype=torch.bfloat16, batch=None):
    shape = (rows, vocab) if batch is None else (batch, rows, vocab)
    logits = torch.randn(shape).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, shape[:-1])
    return logits, targets


def _head(spec, dtype=torch.bfloat16, backward=True, **kwargs):
    def call():
        logits, targets = _batch(dtype=dtype, batch=2 if kwargs.get("shift") else None)
        if kwargs.pop("no_targets", False):
            targets = None
        extra = dict(kwargs)
        if "teacher" in extra:
            extra["teacher_logits"] = torch.randn(logits.shape).to(dtype)
            extra.pop("teacher")
        if extra.pop("probs", False):  # a teacher given as probabilities
            extra["teacher_probs"] = torch.softmax(torch.randn(logits.shape), -1).to(dtype)
        topk = extra.pop("topk", False)
        if topk:  # the teacher's top-8 ids (two of a row's entries -1) and log-probs (or their probabilities)
            ids = torch.stack([torch.randperm(logits.shape[-1])[:8] for _ in range(logits.shape[:-1].numel())])
            ids[0, 6:] = -1
            lq = -torch.rand(*logits.shape[:-1], 8) * 4
            extra.update(teacher_ids=ids.reshape(*logits.shape[:-1], 8),
                         **({"teacher_probs": lq.exp()} if topk == "probs" else {"teacher_logprobs": lq}))
        if extra.pop("token", False):
            extra["teacher_logprobs"] = -torch.rand(targets.shape) * 4
        if extra.pop("row_temperature", False):  # one per row (spec.transform.per_row_temperature)
            extra["temperature"] = 0.5 + torch.rand(targets.shape)
        if extra.pop("weighted", False):  # one per token (spec.token_weights)
            extra["token_weights"] = torch.rand(targets.shape)
        k = extra.pop("selected", 0)
        if k:  # k ids per token (outputs: selected_logprobs), -1 among them
            extra["selected_ids"] = torch.randint(-1, logits.shape[-1], (*targets.shape, k))
        if "policy" in extra:
            extra.pop("policy")
            extra.update(advantages=torch.randn(logits.shape[0]), sequence_ids=torch.arange(logits.shape[0]) // 3,
                         old_logprobs=torch.randn(logits.shape[0]), ref_logprobs=torch.randn(logits.shape[0]),
                         importance_weights=torch.rand(logits.shape[0]))
        validate = extra.pop("validate", False)
        out = headloss.head_loss(logits, targets, spec, backend="triton", validate=validate, **extra)
        if backward:
            total = out.loss.sum()
            if out.selected_logprobs is not None and out.selected_logprobs.requires_grad:  # (its d rows)
                total = total + out.selected_logprobs.sum()
            total.backward()

    return call


def _linear(spec, policy=False, **kwargs):
    def call():
        hidden = torch.randn(2, 7, 16).to(torch.bfloat16).requires_grad_()
        weight = torch.randn(300, 16).to(torch.bfloat16).requires_grad_()
        extra = dict(kwargs)
        if policy:
            extra.update(advantages=torch.randn(2), old_logprobs=torch.randn(2, 7))
        if extra.pop("row_temperature", False):
            extra["temperature"] = 0.5 + torch.rand(2)
        if extra.pop("weighted", False):
            extra["token_weights"] = torch.rand(2, 7)
        validate = extra.pop("validate", False)
        out = headloss.linear_head_loss(hidden, weight, torch.randint(0, 300, (2, 7)), spec, backend="triton",
                                        validate=validate, compact=False, chunk_bytes=3 * 300 * 2, **extra)
        out.loss.sum().backward()

    return call


def _batched_policy(spec, **kwargs):
    """[B, T, V] logits with one advantage per sequence (read by index in the kernel)."""
    def call():
        logits = torch.randn(2, 5, 300).to(torch.bfloat16).requires_grad_()
        ids = torch.randint(0, 300, (2, 5))
        out = headloss.head_loss(logits, ids, spec, backend="triton", advantages=torch.randn(2),
                                 old_logprobs=torch.randn(2, 5), ref_logprobs=torch.randn(2, 5), **kwargs)
        out.loss.backward()

    return call


def _sharded(call):
    """``call`` as rank 1 of 2 vocab-parallel ranks (columns 300..599 of 600), without a process
    group: the layout and the statistics exchange are stood in for; the kernels are the real ones."""
    def run():
        import headloss.head as head
        import headloss.linear as linear
        import headloss.lm_head as lm_head
        import headloss.logits as logits_entry
        import headloss.parallel

        layout = headloss.parallel.VocabShard(group=None, vocab_start=300, vocab_total=600, world=2)
        stand_ins = {
            (logits_entry, "shard_of"): lambda group, width, device, fresh=False: layout,
            (lm_head, "rows_shard"): lambda weight, group, fresh=False: (weight, layout),
            (head, "gather_merged"): lambda part, _shard, own_temp=False, tail=0, merge=True, keys=0: (
                shard.launch_merge(torch.stack([part, part]), own_temp, tail, keys) if merge else
                torch.stack([part, part])),
            (head, "all_reduce_sum"): lambda t, _shard, what="dh": t,
            (linear, "all_reduce_sum"): lambda t, _shard, what="dh": t,
        }
        saved = {key: getattr(*key) for key in stand_ins}
        try:
            for (module, name), value in stand_ins.items():
                setattr(module, name, value)
            call()
        finally:
            for (module, name), value in saved.items():
                setattr(module, name, value)

    return run


FULL = headloss.LossSpec(
    cross_entropy={"label_smoothing": 0.1}, z_loss={"weight": 1e-3}, dft={"weight": 0.5}, entropy={"weight": -0.05},
    token_accuracy=True, outputs=("predicted_tokens", "logprobs", "lse", "token_loss", "entropy"),
    transform={"softcap": 30.0, "temperature": 0.9},
)
VARIANTS = {
    "ce-only": _head(headloss.LossSpec()),
    "all-bf16": _head(FULL),
    "all-fp16": _head(FULL, dtype=torch.float16),
    "all-fp32": _head(FULL, dtype=torch.float32),
    "entropy-metric-no-targets": _head(headloss.LossSpec(cross_entropy=None, entropy={"weight": 0.0},
                                                         outputs=("entropy",)), no_targets=True),
    "deferred-all": _head(FULL.model_copy(update={"differentiable_outputs": True})),
    "shift-labels": _head(FULL, shift=True),
    **{f"distill-{kind}": _head(headloss.LossSpec(distillation={"divergence": kind, "temperature": 2.0},
                                                  token_accuracy=True), teacher=True)
       for kind in ("forward_kl", "reverse_kl", "jsd")},
    "policy-token": _head(headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": 0.04,
                                                                        "kl_importance_correction": True,
                                                                        "entropy_coef": 0.01}), policy=True),
    "policy-batched": _batched_policy(headloss.LossSpec(cross_entropy=None, policy={"loss_type": "grpo",
                                                                                   "kl_beta": 0.04})),
    "linear-policy": _linear(headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo"}), policy=True),
    "linear-fused": _linear(headloss.LossSpec(token_accuracy=True, outputs=("predicted_tokens",))),
    "linear-deferred": _linear(headloss.LossSpec(reduction="none")),
    "policy-sequence": _head(headloss.LossSpec(cross_entropy=None, policy={"importance_sampling": "sequence"}),
                             policy=True),
    "policy-gspo-batched": _batched_policy(headloss.LossSpec(cross_entropy=None, policy={
        "loss_type": "dapo", "importance_sampling": "sequence", "kl_beta": 0.04, "kl_importance_correction": True,
        "entropy_coef": 0.01, "off_policy_mask": 0.1})),
    "linear-gspo": _linear(headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo",
                                                                         "importance_sampling": "sequence_token"}),
                           policy=True),
    "sharded-all": _sharded(_head(FULL, group=object())),
    "sharded-deferred": _sharded(_head(FULL.model_copy(update={"differentiable_outputs": True}), group=object())),
    **{f"sharded-distill-{kind}": _sharded(_head(headloss.LossSpec(
        distillation={"divergence": kind, "temperature": temp}, token_accuracy=True), teacher=True, group=object()))
       for kind, temp in (("forward_kl", 1.0), ("reverse_kl", 2.0), ("jsd", 1.5))},
    "sharded-policy": _sharded(_batched_policy(headloss.LossSpec(cross_entropy=None, entropy={"weight": 0.0},
                                                                 policy={"loss_type": "dapo", "kl_beta": 0.04}),
                                               group=object())),
    "sharded-linear": _sharded(_linear(headloss.LossSpec(token_accuracy=True, entropy={"weight": 0.0}),
                                       group=object())),
    # a sparse teacher: its phase-2 piece, the K-sparse rewrite after the gradient pass, the shard's K logits
    **{f"topk-{form}-{kind}": _head(headloss.LossSpec(distillation={"teacher": "topk", "topk": form,
                                                                    "divergence": kind}), topk=True)
       for form, kind in (("renormalized", "reverse_kl"), ("rest", "jsd"))},
    "topk-verl-deferred-softcap": _head(headloss.LossSpec(
        distillation={"teacher": "topk", "log_prob_min_clamp": -8.0}, reduction="none",
        transform={"softcap": 30.0}), topk=True),
    "token-k3": _head(headloss.LossSpec(distillation={"teacher": "token", "estimator": "k3",
                                                      "estimator_clamp": True}), token=True),
    "topk-validated": _head(headloss.LossSpec(distillation={"teacher": "topk"}), topk=True, validate=True),
    "token-validated": _head(headloss.LossSpec(distillation={"teacher": "token"}), token=True, validate=True),
    "sharded-topk": _sharded(_head(headloss.LossSpec(distillation={"teacher": "topk"}, token_accuracy=True),
                                   topk=True, group=object())),
    # the rest form: d summed in float64, the shard's sum off the ids merged, the tail read back in backward
    "sharded-topk-rest": _sharded(_head(headloss.LossSpec(distillation={"teacher": "topk", "topk": "rest"}),
                                        topk=True, group=object())),
    "topk-rest-deferred": _head(headloss.LossSpec(distillation={"teacher": "topk", "topk": "rest",
                                                                "divergence": "reverse_kl"}, reduction="none"),
                                topk=True),
    # each row at its own temperature: the fused and deferred kernels, the prepare kernel's check, the shard's
    "row-temperature": _head(headloss.LossSpec(z_loss={"weight": 1e-3}, entropy={"weight": 0.01},
                                               transform={"softcap": 30.0, "per_row_temperature": True}),
                             row_temperature=True, validate=True),
    "row-temperature-deferred": _head(headloss.LossSpec(reduction="none", transform={"per_row_temperature": True}),
                                      row_temperature=True),
    "sharded-row-temperature-jsd": _sharded(_head(headloss.LossSpec(distillation={"divergence": "jsd"},
                                                                     transform={"per_row_temperature": True}),
                                                  teacher=True, row_temperature=True, group=object())),
    # a teacher given as probabilities: log2 q on load, the rows' mass checked into the verdict
    "teacher-probs": _head(headloss.LossSpec(distillation={"teacher": "probs", "divergence": "reverse_kl"}),
                           probs=True, validate=True),
    "sharded-teacher-probs-jsd": _sharded(_head(headloss.LossSpec(distillation={"teacher": "probs",
                                                                                "divergence": "jsd"}),
                                                probs=True, validate=True, group=object())),
    # a top-k teacher given as probabilities: their log read as the log-probs, checked into the verdict
    "topk-probs": _head(headloss.LossSpec(distillation={"teacher": "topk", "topk": "rest"}), topk="probs",
                        validate=True),
    "linear-row-temperature": _linear(headloss.LossSpec(transform={"per_row_temperature": True}),
                                      row_temperature=True, validate=True),
    # per-token weights: on the token loss and u, a weighted mean's divisor summed and checked by the prepare
    "token-weights": _head(headloss.LossSpec(entropy={"weight": 0.01}, token_weights={}), weighted=True,
                           validate=True),
    "token-weights-deferred": _head(headloss.LossSpec(reduction="none", token_weights={}), weighted=True),
    # the selected ids' log-probs: K logits loaded after the stats pass; with their gradient, -G in A and each
    # id's share added in the gradient pass from a sorted list (a top-k teacher's ids by a binary search of it
    # in their scatter); vocab-parallel: their merged logits
    "selected": _head(headloss.LossSpec(outputs=("selected_logprobs",)), selected=64, validate=True),
    "selected-deferred-topk": _head(headloss.LossSpec(
        distillation={"teacher": "topk", "topk": "rest"}, outputs=("selected_logprobs",),
        differentiable_outputs=True), topk=True, selected=8),
    # the student's top-k, bounded in the stats pass (k 64), and beside a top-k teacher its overlap
    "student-topk": _head(headloss.LossSpec(student_topk=64, outputs=("topk_ids", "topk_logprobs")), validate=True),
    "student-topk-overlap": _head(headloss.LossSpec(student_topk=8, distillation={"teacher": "topk"}), topk=True),
    "sharded-student-topk": _sharded(_head(headloss.LossSpec(student_topk=16, outputs=("topk_ids",)),
                                           group=object())),
    "sharded-selected-deferred": _sharded(_head(headloss.LossSpec(outputs=("selected_logprobs",),
                                                                  differentiable_outputs=True), selected=5,
                                                group=object())),
    "policy-token-weights": _head(headloss.LossSpec(cross_entropy={"weight": 0.3}, token_weights={},
                                                    policy={"loss_type": "bnpo", "entropy_coef": 0.01,
                                                            "entropy_aggregation": "token-mean"}),
                                  policy=True, weighted=True, validate=True),
    # the objective kernel with TRL's entropy mean by the token weights (its bonus pointer)
    "policy-gspo-token-weights": _batched_policy(headloss.LossSpec(cross_entropy=None, token_weights={}, policy={
        "loss_type": "dapo", "importance_sampling": "sequence", "entropy_coef": 0.01,
        "entropy_aggregation": "token-mean"}), token_weights=torch.rand(2, 5)),
    "linear-token-weights": _linear(headloss.LossSpec(token_weights={"normalize": "tokens"}), weighted=True,
                                    validate=True),
}


def variants() -> dict[str, dict[str, str]]:
    headloss.env.INTERPRETER = True  # let backend="triton" take CPU tensors; nothing is launched
    out: dict[str, dict[str, str]] = {}
    for name, call in VARIANTS.items():
        compiled: dict[str, str] = {}
        for kernel, kwargs in launches(call):
            key = kernel.fn.__name__
            if key not in compiled:
                compiled[key] = compile_launch(kernel, kwargs)
        out[name] = compiled
    return out


if __name__ == "__main__":
    json.dump(variants(), sys.stdout)
