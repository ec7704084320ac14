"""The one output type of every headloss entry point, and how the kernels' buffers become it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from .plan import KernelPlan, in_metric_order
from .validation import check_pending

RETAIN_GRAPH_ERROR = (
    "headloss: a second backward through the same fused-mode loss (retain_graph=True). The fused mode "
    "computes the gradient once, in forward, and hands that buffer to autograd on the first backward. Use "
    "differentiable_outputs=True or reduction='none' (deferred mode, which recomputes it per backward), or call "
    "the loss again."
)


def guard_second_backward(ctx) -> None:
    """One retain-graph guard for every fused-mode Function, the reference's too (eager; under
    torch.compile the hand-off token carries it, see headloss.ops.take)."""
    if torch.compiler.is_compiling():
        return
    if getattr(ctx, "consumed", False):
        raise RuntimeError(RETAIN_GRAPH_ERROR)
    ctx.consumed = True


@dataclass
class HeadLossOutput:
    """What a head-loss call returns; always this type, unrequested fields are ``None``.

    loss              scalar (reduction mean/sum) or per-token [N] / [B, T] (reduction none); a
                      tensor of its own (never a view), so ``loss *= s`` works
    metrics           detached device scalars (all in one tensor: ``packed_metrics()``), in
                      this order (headloss.plan.METRIC_ORDER, the same on every path): ``loss``;
                      when present ``ce``, ``nll`` (with label smoothing), ``z_loss`` (mean
                      lse**2), ``dft``, ``entropy``, ``distill/divergence``,
                      ``distill/teacher_entropy``, ``distill/top1_agreement`` -- means over
                      non-ignored tokens, each term unweighted -- then with a policy term TRL's and
                      verl's ``clip_ratio/{low_mean,low_min,high_mean,high_max,region_mean}``,
                      ``pg_clipfrac``, ..., ``ratio/{mean,min,max}``, ``logprob/mean``, ``kl`` (see
                      headloss.policy), then ``token_accuracy``; ``n_tokens`` last
    predicted_tokens  int64 argmax of the transformed logits, -1 at ignored positions
    logprobs          fp32 log p(target), 0 at ignored positions
    lse               fp32 logsumexp of the transformed logits, 0 at ignored positions
    token_loss        fp32 combined per-token loss (before reduction), 0 at ignored positions
    entropy           fp32 per-token entropy, 0 at ignored positions
    selected_logprobs fp32 [.., K] log p of each of the call's ``selected_ids``, 0 at -1 and at ignored
                      positions
    topk_ids          int64 [.., k] the student's ``student_topk`` most likely ids, largest first (ties:
                      the lower id), -1 at ignored positions
    topk_logprobs     fp32 [.., k] their log-probs, 0 at ignored positions (no gradient)
    overlap_count     int64 with ``student_topk`` and a top-k teacher: how many of the teacher's ids are among
                      the student's top-k (verl's ``overlap_count``), 0 at ignored positions
    overlap_token_advantage
                      fp32 the mean of -q (log q - log p) over those ids (verl's token KL of each, its
                      ``log_prob_min_clamp`` applied), 0 where none is and at ignored positions (no gradient)
    route             the name of the route the call took (headloss.routes.ROUTES)

    Per-token tensors are shaped like the targets. They are detached unless the spec sets
    ``differentiable_outputs``.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    predicted_tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    token_loss: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    selected_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    overlap_count: torch.Tensor | None = None
    overlap_token_advantage: torch.Tensor | None = None
    route: str | None = None

    def packed_metrics(self) -> torch.Tensor:
        """Every metric in one detached float64 tensor, in the order of ``metrics`` (one stack op;
        float64 holds the fp32 values and the int64 ``n_tokens`` exactly). One output where each
        output costs: a function under ``torch.cuda.make_graphed_callables`` pays host time per
        output it returns. A replayed graph rewrites its output in place: copy or log it before the
        next replay. Log it with one copy, ``dict(zip(out.metrics, packed.tolist()))`` (an error the
        device-side input checks found is then raised by the next headloss call;
        ``metrics_as_floats`` raises it at once)."""
        return pack_metrics(self.metrics, self.loss.device)

    def metrics_as_floats(self) -> dict[str, float]:
        """Host copies of the metrics, for logging: one device sync for all of them (which also
        raises any error the device-side input checks found)."""
        if not self.metrics:
            return {}
        values = self.packed_metrics().cpu().tolist()
        check_pending(wait=True)
        return dict(zip(self.metrics, values))


def pack_metrics(metrics: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """A metrics dict's values stacked in one detached float64 tensor, in its order (empty on
    ``device`` when there are none): :meth:`HeadLossOutput.packed_metrics`."""
    if not metrics:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([value.detach().double().reshape(()) for value in metrics.values()])


def column(rows: torch.Tensor, plan: KernelPlan, name: str) -> torch.Tensor | None:
    """One per-row value of the packed buffer (a strided view), or None when the plan has none."""
    index = getattr(plan.cols, name)
    return None if index < 0 else rows[:, index]


class HeadOutputs(NamedTuple):
    """What the head writes: the loss (token-shaped for reduction "none", so the loss is never a view), the
    packed per-row values (per-token outputs are its columns), the argmax (empty without it) and the
    column means (the metrics), in the order of HeadFunction's outputs."""

    loss: torch.Tensor
    rows: torch.Tensor
    pred: torch.Tensor
    means: torch.Tensor

    @classmethod
    def empty(cls, plan: KernelPlan, n_out: int, device, token_shape: tuple[int, ...], extra_means: int = 0
              ) -> HeadOutputs:
        """The outputs of a call with ``n_out`` slots, unfilled; ``extra_means``: room after the plan's
        means (deferred mode's policy metrics)."""
        f32 = dict(dtype=torch.float32, device=device)
        rows = torch.empty(n_out, plan.cols.N, **f32)
        pred = torch.empty(n_out if plan.flags.HAS_ARGMAX else 0, dtype=torch.int64, device=device)
        loss = torch.empty(token_shape if plan.reduction == "none" else (), **f32)
        means = torch.empty(plan.means_size + extra_means, **f32)  # column means, the loss ('loss' metric), policy
        return cls(loss, rows, pred, means)

    def of_rows(self, start: int, stop: int) -> HeadOutputs:
        """The outputs of the rows start:stop (a chunk's part): its rows, argmax and per-row losses; the
        call's means and scalar loss."""
        loss = self.loss.view(-1)[start:stop] if self.loss.dim() else self.loss
        return HeadOutputs(loss, self.rows[start:stop], self.pred[start:stop] if self.pred.numel() else self.pred,
                           self.means)


class FunctionOutputs(NamedTuple):
    """The outputs of the doors' autograd Functions (engine.HeadFunction, lm_head.LinearFunction): the
    head's outputs and the call's scratch (layouts.Scratch; its first word the counted rows). ``apply``
    returns them as a plain tuple, in this order."""

    loss: torch.Tensor
    rows: torch.Tensor
    pred: torch.Tensor
    means: torch.Tensor
    scratch: torch.Tensor


def assemble(plan: KernelPlan, token_shape: tuple[int, ...], head: HeadOutputs, scratch: torch.Tensor,
             extra_metrics: dict[str, torch.Tensor] | None = None, *, route: str | None = None,
             lazy: bool = False) -> HeadLossOutput:
    """HeadLossOutput from the engine's buffers: metrics are views of the column means (in
    plan.METRIC_ORDER, as the plain-torch path gives them), per-token outputs views of the packed rows
    (differentiable in deferred mode); ``route`` the name of the route that ran. ``lazy``: the metrics
    and per-token views made when one of them is first read (no ``extra_metrics``)."""
    loss, rows, pred, means = head
    if lazy:
        out = _Deferred(loss, (plan, token_shape, head, scratch))
        out.__dict__["route"] = route
        return out
    means = means.unbind(0)
    metrics = {"loss": means[plan.cols.N]}  # its own storage: an in-place change of the loss leaves it
    for name, index in plan.metric_index:  # (in METRIC_ORDER already)
        metrics[name] = means[index]
    if extra_metrics:
        metrics.update(extra_metrics)
    metrics["n_tokens"] = scratch[0]
    if extra_metrics:
        metrics = in_metric_order(metrics)
    out = HeadLossOutput(loss=loss, metrics=metrics, route=route)
    detach = rows.requires_grad and not plan.spec.differentiable_outputs

    def columns(start: int, k: int = 0) -> torch.Tensor:
        """Column ``start`` as a token-shaped view, or with ``k`` the block of k columns from it, [.., k]."""
        value = rows.select(1, start) if not k else rows[:, start:start + k]
        return value.view(*token_shape, *((k,) if k else ()))

    for name, index in plan.output_index:
        value = columns(index)
        setattr(out, name, value.detach() if detach else value)
    if plan.cols.selected >= 0:
        value = columns(plan.cols.selected, plan.flags.SELECTED)
        out.selected_logprobs = value.detach() if detach else value
    k = plan.flags.STUDENT_TOPK
    if k and "topk_logprobs" in plan.spec.outputs:  # (values only: detached)
        out.topk_logprobs = columns(plan.cols.topk_logprobs, k).detach()
    if k and "topk_ids" in plan.spec.outputs:  # int32 bits in the fp32 buffer
        out.topk_ids = columns(plan.cols.topk_ids, k).detach().contiguous().view(torch.int32).long()
    if "overlap_count" in plan.spec.outputs:  # (the column holds count / k)
        out.overlap_count = (columns(plan.cols.overlap).detach() * k).round().long()
    if "overlap_token_advantage" in plan.spec.outputs:
        out.overlap_token_advantage = columns(plan.cols.overlap_advantage).detach()
    if plan.flags.HAS_ARGMAX and "predicted_tokens" in plan.spec.outputs:
        out.predicted_tokens = pred if len(token_shape) == 1 else pred.view(token_shape)
    return out


_DEFERRED_FIELDS = ("metrics", "predicted_tokens", "logprobs", "lse", "token_loss", "entropy", "selected_logprobs",
                    "topk_ids", "topk_logprobs", "overlap_count", "overlap_token_advantage")


class _Deferred(HeadLossOutput):
    """A HeadLossOutput whose metrics and per-token views are made on first access of any of them:
    a training step that reads only the loss does not pay their host time (benchmarks/NOTES.md).
    Equal in everything else (it is a HeadLossOutput; assigning a field works)."""

    def __init__(self, loss: torch.Tensor, _parts: tuple | None = None, **fields) -> None:
        if _parts is None:  # as HeadLossOutput(...) (dataclasses.replace)
            HeadLossOutput.__init__(self, loss, **fields)
            return
        self.__dict__["loss"] = loss
        self.__dict__["_parts"] = _parts

    def __repr__(self) -> str:
        return "HeadLossOutput" + HeadLossOutput.__repr__(self)[len(type(self).__qualname__):]

    def _made(self) -> dict:
        parts = self.__dict__.pop("_parts", None)
        if parts is not None:
            out = assemble(*parts)
            self.__dict__.update({"_" + name: getattr(out, name) for name in _DEFERRED_FIELDS})
        return self.__dict__


def _deferred_field(name: str) -> property:
    def get(self):
        return self._made()["_" + name]

    def put(self, value):
        self._made()["_" + name] = value

    return property(get, put)


for _name in _DEFERRED_FIELDS:
    setattr(_Deferred, _name, _deferred_field(_name))


# A pytree node (its tensors the children, the route the context), as tuples and dicts are: code that finds
# a forward's output tensors through torch.utils._pytree (FSDP2's backward hooks, DDP, activation
# checkpointing, torch.export) finds the loss inside it. Flattening makes a lazily built output.
_TENSOR_FIELDS = ("loss", "metrics", "predicted_tokens", "logprobs", "lse", "token_loss", "entropy",
                  "selected_logprobs", "topk_ids", "topk_logprobs", "overlap_count", "overlap_token_advantage")


def _flatten(out: HeadLossOutput) -> tuple[list, str | None]:
    return [getattr(out, name) for name in _TENSOR_FIELDS], out.route


def _flatten_with_keys(out: HeadLossOutput) -> tuple[list, str | None]:
    return [(pytree.GetAttrKey(name), getattr(out, name)) for name in _TENSOR_FIELDS], out.route


def _unflatten(values, route: str | None) -> HeadLossOutput:
    return HeadLossOutput(*values, route=route)


for _type in (HeadLossOutput, _Deferred):
    pytree.register_pytree_node(_type, _flatten, _unflatten, serialized_type_name=f"headloss.{_type.__name__}",
                                flatten_with_keys_fn=_flatten_with_keys)
