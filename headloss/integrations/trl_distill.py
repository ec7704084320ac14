"""TRL's distillation trainers computing their loss with headloss.

* ``HeadLossDistillationTrainer`` -- TRL 1.16's ``DistillationTrainer`` (a dense teacher model beside
  the student: generalized JSD from both models' hidden states and lm_heads). TRL's own loss already
  never materialises the [N, V] logits (its chunked ``ChunkedDivergenceFunction``); the subclass
  runs that step as one :func:`headloss.linear_head_loss` with the teacher's hidden states and
  weight instead (the fused head's chunks, its gradient in forward: :func:`dense_distillation_loss`,
  the same contract as TRL's ``_chunked_divergence_loss``). Everything else stays TRL's.
* ``HeadLossServerDistillationTrainer`` -- TRL's experimental ``ServerDistillationTrainer`` (the
  teacher's top-k from a vLLM server), its loss as one head pass with a sparse teacher.
* ``HeadLossGKDTrainer`` -- TRL's experimental ``GKDTrainer``, whose ``generalized_jsd_loss`` takes
  both models' logits: one head pass with the teacher's logits (:func:`generalized_jsd_loss`) instead
  of both log-softmaxes, the mixture and the [B, T, V] divergence.

::

    from headloss.integrations.trl_distill import HeadLossServerDistillationTrainer

    trainer = HeadLossServerDistillationTrainer(model=model, args=ServerDistillationConfig(...), ...)

TRL 1.16's ``ServerDistillationTrainer`` gets the teacher from a vLLM server as its top-k
log-probs (``loss_top_k``) and its log-prob of each sampled token, then takes the student's whole
log-softmax [B, T, V] to gather K columns. The subclass changes one method, ``compute_loss``: the
same student forward, teacher request and slicing, then :func:`server_distillation_loss` -- one
:func:`headloss.head_loss` pass over the student's logits with the teacher's support as a sparse
teacher (no log-softmax, gradient written once into the logits' gradient):

==============================  ==============================================================
TRL                             headloss
==============================  ==============================================================
``beta == 0``                   the teacher's top-k, forward KL
``beta > 0`` (top-1 support)    the teacher's top-1 id and the sampled token (once when they
                                are the same), ``divergence="jsd"`` with ``beta`` (1: reverse KL)
``loss_add_tail``               ``topk="rest"`` (else ``"renormalized"``)
``temperature``                 ``LogitTransform.temperature`` (the student's logits / T)
``batchmean`` over labels       the mean over counted rows (``labels`` as targets, -100 ignored)
==============================  ==============================================================

What TRL's hooks do not allow: the server trainer's ``compute_loss`` calls the model for its full
logits, so the student's [B, L, V] logits are still materialised by the model's forward (only the
log-softmax and its backward are saved); a hidden-state path would need TRL's
``_get_last_hidden_state`` under the same ``_forward_redirection`` as its dense ``DistillationTrainer``,
which this trainer's ``compute_loss`` does not use. TRL's tail bucket clamps the top-k mass at
``1 - 1e-7``; headloss's rest outcome is exact (they differ only where the student puts all but 1e-7
of its mass on the ids). In the dense trainer a teacher with its own logit scale or softcap is
refused (headloss transforms the student's logits only), and with ``temperature`` != 1 the logged
entropy is the student's at temperature 1 (TRL logs it at the distillation temperature); the loss
and its gradient are TRL's at any temperature.
"""

from __future__ import annotations

from typing import Any

import torch

from ..api import head_loss, linear_head_loss
from ..bounded import memoize
from ..spec import Distillation, Entropy, LogitTransform, LossSpec

__all__ = ["HeadLossDistillationTrainer", "HeadLossGKDTrainer", "HeadLossServerDistillationTrainer",
           "dense_distillation_loss", "generalized_jsd_loss", "server_distillation_loss", "server_distillation_spec",
           "server_support"]


def _trl_trainer(module: str, name: str) -> type:
    import importlib

    return getattr(importlib.import_module(module), name)


@memoize("trl.server_spec", 64, "TRL server distillation specs by (beta, loss_add_tail, temperature)")
def server_distillation_spec(beta: float, loss_add_tail: bool, temperature: float = 1.0) -> LossSpec:
    """The LossSpec of TRL's server distillation loss: a sparse teacher's divergence alone."""
    divergence = "forward_kl" if beta == 0 else "reverse_kl" if beta == 1 else "jsd"
    return LossSpec(cross_entropy=None, transform=LogitTransform(temperature=float(temperature)),
                    distillation=Distillation(teacher="topk", topk="rest" if loss_add_tail else "renormalized",
                                              divergence=divergence, beta=float(beta) if 0 < beta < 1 else 0.5))


def server_support(teacher_result: dict[str, torch.Tensor], completion_tokens: torch.Tensor, labels: torch.Tensor,
                   beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs) [B, T, K] of the teacher's support as TRL's server loss takes it: the top-k
    (-inf log-probs: no entry) for ``beta == 0``; else the teacher's top-1 id and the sampled token
    (the sampled one alone for ``beta == 1``), with TRL's checks that the positions scored have
    finite teacher log-probs."""
    top_lp, top_ids = teacher_result["topk_logprobs"], teacher_result["topk_token_ids"]
    if beta == 0:
        given = top_lp > float("-inf")
        return torch.where(given, top_ids, -1), torch.where(given, top_lp, 0.0)
    actual = teacher_result["actual_logprobs"]
    required = labels != -100
    missing = required & ~torch.isfinite(actual)
    if bool(missing.any()):
        raise ValueError("teacher_result: the teacher server is missing actual-token logprobs for required "
                         f"reverse-KL positions: {int(missing.sum())}/{int(required.sum())}")
    actual = torch.where(required, actual, 0.0)
    if beta == 1:
        return completion_tokens[..., None], actual[..., None]
    top1, top1_ids = top_lp[..., 0], top_ids[..., 0]
    missing = required & ~torch.isfinite(top1)
    if bool(missing.any()):
        raise ValueError("teacher_result: the teacher server is missing top-1 logprobs for required forward-KL "
                         f"positions: {int(missing.sum())}/{int(required.sum())}")
    top1 = torch.where(required, top1, 0.0)
    second = torch.where(completion_tokens == top1_ids, -1, completion_tokens)
    return torch.stack([top1_ids, second], -1), torch.stack([top1, actual], -1)


def server_distillation_loss(student_logits: torch.Tensor, teacher_result: dict[str, torch.Tensor],
                             completion_tokens: torch.Tensor, labels: torch.Tensor, *, beta: float,
                             loss_add_tail: bool, temperature: float = 1.0) -> torch.Tensor:
    """TRL ServerDistillationTrainer's loss (its ``_compute_server_forward_kl_loss`` for ``beta == 0``,
    else ``_compute_server_sparse_top_1_divergence_loss``) on the student's logits [B, T, V] of the
    completion positions, by one head pass: the mean over positions whose label is not -100."""
    ids, logprobs = server_support(teacher_result, completion_tokens, labels, beta)
    spec = server_distillation_spec(beta, loss_add_tail, temperature)
    return head_loss(student_logits, labels, spec, teacher_ids=ids, teacher_logprobs=logprobs).loss


@memoize("trl.dense_spec", 64, "TRL dense distillation specs by (beta, temperature, student scale and softcap)")
def dense_distillation_spec(beta: float, temperature: float = 1.0, logit_scale: float = 1.0,
                            softcap: float | None = None) -> LossSpec:
    """The LossSpec of TRL's generalized JSD (``beta`` 0: forward KL, 1: reverse KL) at ``temperature``,
    summed, with the student's entropy as a metric."""
    divergence = "forward_kl" if beta == 0 else "reverse_kl" if beta == 1 else "jsd"
    return LossSpec(cross_entropy=None, entropy=Entropy(weight=0.0), reduction="sum",
                    transform=LogitTransform(logit_scale=float(logit_scale), softcap=softcap),
                    distillation=Distillation(divergence=divergence, beta=float(beta) if 0 < beta < 1 else 0.5,
                                              temperature=float(temperature)))


def _full(weight, bias, dtype):
    """A DTensor lm_head (FSDP2) gathered once, as TRL does, in the hidden states' dtype."""
    if isinstance(weight, torch.distributed.tensor.DTensor):
        weight = weight.full_tensor().to(dtype)
        bias = bias.full_tensor() if bias is not None else None
    return weight, bias


def dense_distillation_loss(student_hidden_states: torch.Tensor, teacher_hidden_states: torch.Tensor,
                            student_lm_head_weight: torch.Tensor, teacher_lm_head_weight: torch.Tensor,
                            completion_mask: torch.Tensor, beta: float, num_items_in_batch: Any = None,
                            student_lm_head_bias: torch.Tensor | None = None,
                            teacher_lm_head_bias: torch.Tensor | None = None, student_logit_scale: float = 1.0,
                            teacher_logit_scale: float = 1.0, student_final_logit_softcapping: float | None = None,
                            teacher_final_logit_softcapping: float | None = None, temperature: float = 1.0):
    """TRL DistillationTrainer's ``_chunked_divergence_loss`` (same arguments and returns: the loss, the
    sum of the student's per-token entropy and the number of valid positions) as one fused head with
    the teacher's hidden states and weight."""
    if teacher_logit_scale != 1.0 or teacher_final_logit_softcapping is not None:
        raise ValueError("teacher_logit_scale / teacher_final_logit_softcapping: headloss transforms the student's "
                         "logits only; a teacher with its own logit scale or softcap runs on TRL's own loss")
    student_lm_head_weight, student_lm_head_bias = _full(student_lm_head_weight, student_lm_head_bias,
                                                         student_hidden_states.dtype)
    teacher_lm_head_weight, teacher_lm_head_bias = _full(teacher_lm_head_weight, teacher_lm_head_bias,
                                                         teacher_hidden_states.dtype)
    valid = completion_mask != 0
    spec = dense_distillation_spec(beta, temperature, student_logit_scale, student_final_logit_softcapping)
    out = linear_head_loss(student_hidden_states, student_lm_head_weight, torch.where(valid, 0, -100), spec,
                           bias=student_lm_head_bias, teacher_hidden=teacher_hidden_states,
                           teacher_weight=teacher_lm_head_weight, teacher_bias=teacher_lm_head_bias)
    n_valid = valid.sum()
    if num_items_in_batch is None:
        loss = out.loss / n_valid.clamp(min=1)
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(out.loss.device)
        loss = out.loss / num_items_in_batch
    entropy_sum = (out.metrics["entropy"] * out.metrics["n_tokens"]).detach()
    return loss, entropy_sum, n_valid


class HeadLossDistillationTrainer(_trl_trainer("trl.trainer.distillation_trainer", "DistillationTrainer")):
    """TRL's DistillationTrainer with its divergence computed by :func:`dense_distillation_loss`."""

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        import trl.trainer.distillation_trainer as trl_module

        own = trl_module._chunked_divergence_loss
        trl_module._chunked_divergence_loss = dense_distillation_loss  # (TRL reads it from its module per call)
        try:
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        finally:
            trl_module._chunked_divergence_loss = own


class HeadLossServerDistillationTrainer(_trl_trainer("trl.experimental.server_distillation",
                                                     "ServerDistillationTrainer")):
    """TRL's ServerDistillationTrainer with its loss computed by :func:`server_distillation_loss`."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # TRL's own preamble: the prompt and completion as one batch, labels -100 outside the completion
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        completion_labels = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, -100))
        labels = torch.cat([torch.full_like(prompt_ids, -100), completion_labels], dim=1)
        inputs: dict[str, Any] = {**inputs, "input_ids": input_ids, "attention_mask": attention_mask,
                                  "labels": labels, "prompt_attention_mask": prompt_mask}
        student_outputs = model(input_ids=input_ids, attention_mask=attention_mask)
        prompt_length = self._compute_prompt_length(inputs)
        labels = labels[:, prompt_length:]
        completion_tokens = input_ids[:, prompt_length:]
        teacher_result = self._get_teacher_token_logprobs_from_server(inputs, prompt_length)
        comp_len = teacher_result["actual_logprobs"].shape[1]
        student_logits = student_outputs.logits[:, prompt_length - 1: -1, :][:, :comp_len]
        loss = server_distillation_loss(student_logits, teacher_result, completion_tokens[:, :comp_len],
                                        labels[:, :comp_len], beta=self.beta, loss_add_tail=self.loss_add_tail,
                                        temperature=self.temperature)
        if self.model.training:  # (TRL: the server path normalises locally, then by the accumulation steps)
            loss = loss / self.current_gradient_accumulation_steps
        return (loss, student_outputs) if return_outputs else loss


@memoize("trl.gkd_spec", 64, "TRL GKD specs by (beta, temperature)")
def _gkd_spec(beta: float, temperature: float) -> LossSpec:
    divergence = "forward_kl" if beta == 0 else "reverse_kl" if beta == 1 else "jsd"
    return LossSpec(cross_entropy=None, reduction="sum",
                    distillation=Distillation(divergence=divergence, beta=float(beta) if 0 < beta < 1 else 0.5,
                                              temperature=float(temperature)))


def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                         reduction="batchmean", num_items_in_batch=None):
    """TRL GKDTrainer's ``generalized_jsd_loss`` (the same arguments and value) as one head pass: the
    divergence summed over the positions whose label is not -100, divided by ``num_items_in_batch``,
    or reduced as ``reduction`` says ("batchmean": per position, "mean": per position and vocabulary
    entry, "sum"). TRL's "none" (its [positions, V] element-wise divergence) is not formed by a head
    pass and is refused."""
    if reduction not in ("batchmean", "mean", "sum"):
        raise ValueError(f"reduction: 'batchmean', 'mean' or 'sum' (TRL's 'none' is its [positions, V] "
                         f"element-wise divergence, which one head pass does not form), got {reduction!r}")
    out = head_loss(student_logits, labels, _gkd_spec(float(beta), float(temperature)), teacher_logits=teacher_logits)
    total = out.loss
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    count = out.metrics["n_tokens"].clamp(min=1).to(total.dtype)
    return total / count if reduction == "batchmean" else total / (count * student_logits.shape[-1])


class HeadLossGKDTrainer(_trl_trainer("trl.experimental.gkd", "GKDTrainer")):
    """TRL's GKDTrainer with its generalized JSD computed by :func:`generalized_jsd_loss`."""

    generalized_jsd_loss = staticmethod(generalized_jsd_loss)
