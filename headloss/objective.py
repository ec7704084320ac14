"""Deferred mode's policy term, outside the head kernel: the objective kernels on the packed per-token
log-probs (kernels/policy.py, two launches over [B, T] sequences), as a torch.library op under
torch.compile, in the head's autograd node (engine.HeadFunction, ``deferred+kernels`` on logits) or in
a node of its own (:class:`PolicyObjectiveFunction`, the lm_head's); and :class:`PolicyTerm`, where a
route runs the policy term besides the head kernel (one object per place, headloss.routes gives each
route one).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .bounded import cache
from .kernels.policy import launch_policy_objective
from .layouts import OBJECTIVE_METRICS, OBJECTIVE_OUT
from .ops import kernel_op
from .output import column
from .plan import KernelPlan, plan_from_key
from .policy.metrics import extremes
from .policy.objectives import policy_objective
from .policy.tokens import PolicyTokens
from .policy.weights import token_mean_weights
from .registry import objective_flags


class ObjectiveTensors(NamedTuple):
    """The policy objective kernels' per-token inputs (flat, from PolicyTokens), in op order."""

    old: torch.Tensor | None
    ref: torch.Tensor | None
    adv: torch.Tensor
    iw: torch.Tensor | None
    mask: torch.Tensor
    weight: torch.Tensor
    sampled: torch.Tensor | None  # the rollout's log-probs (else the old ones): the off-policy mask's
    bonus: torch.Tensor | None = None  # with token weights, TRL's entropy mean's per-token weights (else None:
    # the kernel's mask / count)

    @classmethod
    def of(cls, inp: PolicyTokens) -> ObjectiveTensors:
        sampled = inp.rollout_logprobs if inp.rollout_logprobs is not None else inp.old_logprobs
        bonus = None if inp.token_weights is None else token_mean_weights(inp.mask, inp)
        return cls(inp.old_logprobs, inp.ref_logprobs, inp.advantages, inp.importance_weights, inp.mask, inp.weight,
                   sampled, bonus)


def _objective_layout(inp: PolicyTokens) -> list[int]:
    """sequence_level, n_seq, seq_len, adv_span: the objective kernels' layout of ``inp``'s rows."""
    return [int(inp.sequence_level), inp.n_slots, inp.seq_len, inp.adv_span]


def objective_launch(plan: KernelPlan, rows: torch.Tensor, inp: PolicyTokens, *, traced: bool = False, **kwargs):
    """kernels.policy.launch_policy_objective on the deferred mode's packed rows and flat policy inputs;
    ``traced`` (under torch.compile): through the ``policy_objective`` op, into fresh outputs (``total``
    and ``out`` are not taken)."""
    tensors, layout = ObjectiveTensors.of(inp), _objective_layout(inp)
    if traced:
        metrics, grad = kwargs.get("metrics", True), kwargs.get("grad", True)
        total, out, d_rows = policy_objective_op(rows, [*tensors, kwargs.get("base_loss")], plan.key,
                                                 [*layout, int(metrics), int(grad)])
        return (total if metrics else None), (out if metrics else None), (d_rows if grad else None)
    return _launch_objective(plan, rows, tensors, layout, **kwargs)


def _launch_objective(plan: KernelPlan, rows, tensors: ObjectiveTensors, layout: list[int], **kwargs):
    pol = plan.spec.policy
    cols = plan.cols
    sequence_level, n_seq, seq_len, adv_span = layout
    flags = objective_flags(pol, bool(sequence_level))
    entropy = rows[:, cols.entropy] if cols.entropy >= 0 else None
    return launch_policy_objective(
        flags, plan.scalars, logp=rows[:, cols.logp], entropy=entropy, **tensors._asdict(),
        count=tensors.mask.sum() if flags.ENT_TOKEN_MEAN else None, n_seq=n_seq, seq_len=seq_len, adv_span=adv_span,
        off_policy=pol.off_policy_mask if pol.off_policy_mask is not None else 0.0, d_cols=cols.N,
        col_logp=cols.logp, col_ent=cols.entropy if flags.ENT_BONUS else -1, **kwargs)


def _objective_outputs(rows, tensors, key, layout):
    """policy_objective_op's outputs, unfilled: its fake."""
    _, n_seq, seq_len, _, metrics, grad = layout
    f32 = dict(dtype=torch.float32, device=rows.device)
    return (torch.empty(() if metrics else (0,), **f32), torch.empty(OBJECTIVE_OUT.N if metrics else 0, **f32),
            torch.empty((n_seq * seq_len, rows.shape[1]) if grad else (0,), **f32))


@kernel_op("headloss::policy_objective", fake=_objective_outputs)
def policy_objective_op(rows: torch.Tensor, tensors: list[torch.Tensor | None], key: str, layout: list[int]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The deferred mode's policy term by its two launches as an op (``tensors``: ObjectiveTensors, then the
    base loss; ``layout``: the objective layout, then whether metrics and a gradient are wanted): (base loss
    + the term, metrics (OBJECTIVE_OUT), d loss / d rows), each an empty tensor where not asked for."""
    metrics, grad = bool(layout[4]), bool(layout[5])
    total, out, d_rows = _launch_objective(plan_from_key(key), rows, ObjectiveTensors(*tensors[:-1]), layout[:4],
                                           base_loss=tensors[-1], metrics=metrics, grad=grad)
    empty = lambda t: rows.new_empty(0, dtype=torch.float32) if t is None else t  # noqa: E731
    return empty(total), empty(out), empty(d_rows)


class PolicyObjectiveFunction(torch.autograd.Function):
    """apply(loss, rows, plan, inp) -> (loss + the policy term, metrics (OBJECTIVE_OUT)): the deferred
    mode's policy objective on its packed rows, by two launches, in a node of its own (the lm_head's
    rows); the backward hands d loss / d rows (computed in forward, for one unit of upstream
    gradient) to the head's backward."""

    @staticmethod
    def forward(ctx, loss, rows, plan: KernelPlan, inp: PolicyTokens):
        total, out, d_rows = objective_launch(plan, rows, inp, base_loss=loss, grad=ctx.needs_input_grad[1],
                                              traced=torch.compiler.is_compiling())
        ctx.save_for_backward(d_rows)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(out)
        return total, out

    @staticmethod
    def backward(ctx, d_total, _):
        if d_total is None:
            return None, None, None, None
        (d_rows,) = ctx.saved_tensors
        return d_total, None if d_rows is None else d_rows * d_total, None, None


def objective_metrics(plan: KernelPlan, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The policy metrics of the objective kernels' vector ``out`` (layouts.OBJECTIVE_METRICS):
    policy.objectives.policy_objective's names in its key order, then "loss"."""
    values = dict(zip(OBJECTIVE_METRICS, out.unbind(), strict=True))
    names = _OBJECTIVE_NAMES.get(plan.key)
    if names is None:
        names = [name for name in OBJECTIVE_METRICS[1:]
                 if (name != "entropy" or plan.cols.entropy >= 0) and (name != "kl" or plan.spec.policy.kl_beta)]
        names = _OBJECTIVE_NAMES[plan.key] = (*names, "pg_clipfrac", "loss")
    values["pg_clipfrac"] = values["clip_ratio/region_mean"]
    return {name: values[name] for name in names}


_OBJECTIVE_NAMES: dict[str, tuple[str, ...]] = cache("objective.names", 1024,
                                                     "objective_metrics' metric names by plan key")


class PolicyTerm:
    """Where a route runs a call's policy term besides the head kernel, and what that adds to the output
    (headloss.routes gives each route one). This one: nowhere, the call has none."""

    name = ""
    epilogue = False  # the head kernel's row epilogue reads the policy inputs (the fused routes)
    in_head_node = False  # the objective runs inside the logits door's autograd node (engine.HeadRun.objective)

    def __repr__(self) -> str:
        return f"<policy term {self.name or 'none'}>"

    def share(self, plan: KernelPlan, out, scratch, pol: PolicyTokens | None, sequence_kernels: bool = False,
              reduced: bool = False) -> tuple[torch.Tensor, dict]:
        """The policy term's share outside the head kernel: (the head's outputs with the loss that has it,
        its metrics). ``out``: the head's outputs (output.HeadOutputs: loss, rows, pred, means);
        ``sequence_kernels``: the per-sequence metrics may launch kernels/policy.py ([B, T] rows);
        ``reduced``: the head kernel's last program reduced them."""
        if plan.spec.policy is not None:
            raise ValueError(f"route: this route runs no policy term ({self!r}), but the spec has one")
        return out, {}


class EpiloguePolicy(PolicyTerm):
    """The objective in the head kernel's row epilogue (row-local objectives); after it, the metrics the
    kernel did not reduce (per-sequence clip fractions of rows with sequence_ids, or of the chunked lm_head;
    none where the kernel's last program reduced them)."""

    name = "epilogue"
    epilogue = True

    def share(self, plan, out, scratch, pol, sequence_kernels=False, reduced=False):
        if reduced:
            return out, {}
        token_means = {name: out.means[index] for name, index in plan.metric_index}
        return out, extremes(token_means, column(out.rows, plan, "ratio"), column(out.rows, plan, "clip_low"),
                                  column(out.rows, plan, "clip_high"), pol.mask, scratch[0], pol, sequence_kernels)


class KernelsPolicy(PolicyTerm):
    """The whole objective on the per-token log-probs by two launches over [B, T] sequences
    (kernels/policy.py), in an autograd node of its own (:class:`PolicyObjectiveFunction`)."""

    name = "kernels"

    def share(self, plan, out, scratch, pol, sequence_kernels=False, reduced=False):
        total, values = PolicyObjectiveFunction.apply(out.loss, out.rows, plan, pol)
        return out._replace(loss=total), objective_metrics(plan, values)


class KernelsInHeadPolicy(KernelsPolicy):
    """The same launches inside the logits door's autograd node (engine.HeadFunction): the loss has the
    term already, its metrics follow the plan's means."""

    in_head_node = True

    def share(self, plan, out, scratch, pol, sequence_kernels=False, reduced=False):
        return out, objective_metrics(plan, out.means[plan.means_size:])


class TorchPolicy(PolicyTerm):
    """The whole objective on the per-token log-probs by torch ops (policy.objectives)."""

    name = "torch"

    def share(self, plan, out, scratch, pol, sequence_kernels=False, reduced=False):
        policy_loss, metrics = policy_objective(column(out.rows, plan, "logp"), column(out.rows, plan, "entropy"),
                                                pol.mask, plan.spec.policy, pol, extremes_by_kernel=sequence_kernels)
        loss = out.loss + policy_loss
        metrics["loss"] = loss.detach().clone()
        return out._replace(loss=loss), metrics


NO_POLICY, EPILOGUE, KERNELS, KERNELS_IN_HEAD, TORCH = (PolicyTerm(), EpiloguePolicy(), KernelsPolicy(),
                                                         KernelsInHeadPolicy(), TorchPolicy())
