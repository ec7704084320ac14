"""Megatron-core: a ``GPTModel``'s language-model loss computed by headloss (docs/engines.md).

* :func:`patch_gpt_model` -- one call: the model's loss from the tensor-parallel lm_head with any
  :class:`~headloss.LossSpec` of ``reduction="none"`` (Megatron's loss function masks and sums the
  per-token loss itself). ``fused=True`` (default) computes it from the final hidden states and the
  output layer's weight shard (:func:`headloss.linear_head_loss`, no [s, b, V / tp] logits; with
  sequence parallelism the hidden states are gathered as the output layer gathers them and dh goes
  back reduce-scattered); ``fused=False`` keeps Megatron's output layer and replaces its
  cross-entropy (:func:`headloss.head_loss` on the vocab-parallel logits). The returned
  :class:`MegatronPatch` holds the last call's output (its metrics: z-loss, entropy, accuracy ...)
  and ``restore()``.
* :func:`vocab_parallel_cross_entropy` -- ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``'s
  signature and outputs ([s, b] per-token loss), one all_gather where Megatron makes three
  all-reduces.

Megatron's vocabulary shards are equal (``padded_vocab_size`` is a multiple of the tensor-parallel
size); headloss takes any contiguous shards, so nothing is asked of the layout beyond what Megatron
builds. Pipeline stages: the patch applies to the stage that holds the output layer
(``post_process``). Multi-token prediction (DeepSeek-V3's, ``mtp_num_layers``): with ``fused=True`` each
depth's loss is computed from its hidden states as the main loss is, inside Megatron's own loop (its rolled
labels and loss mask, ``mtp_loss_scaling_factor``, the MTPLossAutoScaler that carries its gradient, the
per-depth losses it logs); with ``fused=False`` each depth's logits go through the patched loss. Inference
goes through Megatron's own path unchanged.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..api import head_loss, linear_head_loss
from ..chunks import DEFAULT_CHUNK_BYTES
from ..output import HeadLossOutput
from ..spec import LossSpec

_REDUCTION = ("spec: Megatron's loss function masks and sums the per-token loss itself: the spec's reduction "
              "must be 'none', got {!r}")


def megatron_spec(spec: Any = None) -> LossSpec:
    """``spec`` (a LossSpec, dict or path; default cross-entropy) checked for Megatron: per-token loss."""
    spec = LossSpec.coerce(spec if spec is not None else {"cross_entropy": {}, "reduction": "none"})
    if spec.reduction != "none":
        raise ValueError(_REDUCTION.format(spec.reduction))
    if (spec.policy is not None or spec.distillation is not None or spec.token_weights is not None
            or spec.transform.per_row_temperature):
        raise ValueError("spec: a GPTModel's loss gets the labels only; its policy, distillation, token_weights or "
                         "per-row temperature inputs have no way in (call headloss.linear_head_loss from the "
                         "training step instead; Megatron's loss mask weighs the per-token loss)")
    return spec


def _group(group):
    """None for a single rank (headloss's single-device path), else the group."""
    return None if group is None or dist.get_world_size(group) == 1 else group


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, group=None) -> torch.Tensor:
    """Megatron's ``vocab_parallel_cross_entropy``: logits [s, b, V / tp] (this rank's vocabulary
    slice), target [s, b] -> per-token loss [s, b] (fp32), gradient to the logits; ``group``: the
    tensor-parallel group (default Megatron's). ``label_smoothing`` as Megatron defines it: the target
    keeps 1 - label_smoothing and the rest is spread over the other V - 1 ids, over the whole
    vocabulary (Megatron's own spreads it over this rank's slice: with tp > 1 its smoothed loss differs
    by rank; docs/engines.md)."""
    from megatron.core import parallel_state

    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1), got {label_smoothing!r}")
    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    vocab = vocab_parallel_logits.shape[-1] * (dist.get_world_size(group) if group is not None else 1)
    smoothing = label_smoothing * vocab / (vocab - 1) if label_smoothing else 0.0  # as torch's convention
    spec = LossSpec(cross_entropy={"label_smoothing": smoothing}, reduction="none")
    return head_loss(vocab_parallel_logits, target, spec, group=_group(group)).loss


@dataclass
class MegatronPatch:
    """A patched GPTModel: ``output`` is the last loss call's :class:`~headloss.HeadLossOutput`
    (``output.metrics`` for logging), ``mtp_outputs`` its multi-token prediction depths' (fused mode),
    ``restore()`` puts Megatron's methods back."""

    model: Any
    spec: LossSpec
    fused: bool
    output: HeadLossOutput | None = None
    mtp_outputs: list[HeadLossOutput] = field(default_factory=list)  # each multi-token prediction depth's, in order
    _saved: dict = field(default_factory=dict)

    def restore(self) -> None:
        for name in self._saved:
            self.model.__dict__.pop(name, None)
        self._saved.clear()


def patch_gpt_model(model, spec: Any = None, *, fused: bool = True) -> MegatronPatch:
    """Compute ``model``'s (a megatron.core GPTModel, its last pipeline stage) language-model loss with
    headloss. The output weight is checked here on every rank of the tensor-parallel group (a shard
    of the wrong shape raises on all of them, naming it)."""
    spec = megatron_spec(spec)
    for name in ("output_layer", "compute_language_model_loss", "_postprocess", "pg_collection"):
        if not hasattr(model, name):
            raise TypeError(f"model: expected a megatron.core GPTModel (its last pipeline stage), got "
                            f"{type(model).__name__} without {name!r}")
    if "_postprocess" in model.__dict__ or "compute_language_model_loss" in model.__dict__:
        raise ValueError("model: already patched (restore() the earlier patch first)")
    _check_weight(model)
    patch = MegatronPatch(model, spec, fused)
    if fused:
        original = type(model)._postprocess
        signature = inspect.signature(original)
        patch._saved["_postprocess"] = original
        model._postprocess = types.MethodType(
            lambda self, *args, **kwargs: _postprocess(patch, original, signature, self, *args, **kwargs), model)
    else:
        patch._saved["compute_language_model_loss"] = type(model).compute_language_model_loss
        model.compute_language_model_loss = types.MethodType(
            lambda self, labels, logits: _logits_loss(patch, self, labels, logits), model)
    return patch


def _output_weight(model) -> torch.Tensor:
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _check_weight(model) -> None:
    """Every rank's output weight is [vocab_size / tp, hidden]; the verdict reduced over the group, so
    that every rank raises (no rank waits in a collective the others left)."""
    group = model.pg_collection.tp
    world = dist.get_world_size(group) if group is not None else 1
    weight = _output_weight(model)
    vocab = getattr(model, "vocab_size", None)
    expected = (vocab // world if vocab is not None and vocab % world == 0 else -1, model.config.hidden_size)
    got = tuple(weight.shape) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else ()
    ok = torch.tensor([1.0 if got == expected else 0.0])
    if world > 1:
        ok = ok.to(weight.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if float(ok) != 1.0:
        raise ValueError(f"weight: the output layer's weight must be this rank's shard of the vocabulary, "
                         f"[vocab_size / tp, hidden] = {list(expected)} on every rank of the tensor-parallel group; "
                         f"this rank has {list(got)} (a rank whose shard does not match raises on every rank)")


def _logits_loss(patch: MegatronPatch, model, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """compute_language_model_loss: labels [b, s], logits [s, b, V / tp] -> loss [b, s]."""
    out = head_loss(logits.transpose(0, 1), labels, patch.spec, group=_group(model.pg_collection.tp))
    patch.output = out
    return out.loss


def _postprocess(patch: MegatronPatch, original, signature, model, *args, **kwargs):
    """GPTModel._postprocess with every loss it computes from the hidden states: Megatron's own runs, its
    output layer handing the hidden states through and its compute_language_model_loss taking them
    (:func:`fused_loss`) -- the main loss, and with multi-token prediction each depth's, whose labels and
    loss mask Megatron rolls, scales, logs and attaches as it does for its own logits. Every other case (no
    labels, inference, the config logger) by Megatron's own."""
    from megatron.core.config_logger import has_config_logger_enabled

    bound = signature.bind(model, *args, **kwargs)
    call = bound.arguments
    labels = call.get("labels")
    if (labels is None or call.get("inference_context") is not None
            or call.get("inference_params") is not None or has_config_logger_enabled(model.config)):
        return original(model, *args, **kwargs)
    layer = model.output_layer
    outputs: list[HeadLossOutput] = []

    def loss_of(self, labels: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = _output_weight(self)
        out = fused_loss(hidden_states, weight, labels, patch.spec, group=self.pg_collection.tp,
                         sequence_parallel=layer.sequence_parallel, bias=getattr(layer, "bias", None),
                         gradient_accumulation_fusion=getattr(layer, "gradient_accumulation_fusion", False)
                         and hasattr(weight, "main_grad"))
        outputs.append(out)
        return out.loss

    saved = layer.__dict__.get("forward")  # (instance attributes: what was there comes back in finally)
    layer.forward = _hidden_states_through
    model.compute_language_model_loss = types.MethodType(loss_of, model)
    try:
        loss = original(model, *args, **kwargs)
    finally:
        del model.compute_language_model_loss
        if saved is None:
            del layer.forward
        else:
            layer.forward = saved
    patch.output = outputs[-1] if outputs else None  # (Megatron computes the main loss last)
    patch.mtp_outputs = outputs[:-1]
    return loss


def _hidden_states_through(input_, weight=None, runtime_gather_output=None):
    """The output layer's forward while headloss computes the loss: its input, for the loss to take."""
    return input_, None


def fused_loss(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: Any = None, *,
               group=None, sequence_parallel: bool = False, bias: torch.Tensor | None = None,
               gradient_accumulation_fusion: bool = False) -> HeadLossOutput:
    """The loss of Megatron's column-parallel output layer without its logits: ``hidden_states`` [s, b, h]
    ([s / tp, b, h] with ``sequence_parallel``), ``weight`` this rank's [V / tp, h], ``labels`` [b, s] ->
    HeadLossOutput with loss [b, s]. dh reaches the hidden states as the output layer sends it: summed
    over the group (or reduce-scattered along s). ``gradient_accumulation_fusion`` (the output layer's, where
    Megatron's DDP gave the weight a ``main_grad``): dW goes into ``weight.main_grad`` as Megatron's layer
    sends it there (``linear_head_loss(weight_grad="main_grad")``), and the bytes of the dW buffer that is
    then not allocated go to the chunks (the same peak in fewer, taller chunks: docs/performance.md)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    spec = megatron_spec(spec)
    group = _group(group)
    if hidden_states.dim() != 3 or hidden_states.shape[1] != labels.shape[0]:
        raise ValueError(f"hidden_states: expected [s, b, h] with b = labels' {labels.shape[0]}, got "
                         f"{list(hidden_states.shape)}")
    if group is not None and sequence_parallel:  # the whole sequence on every rank; dh reduce-scattered back
        hidden_states = gather_from_sequence_parallel_region(hidden_states, group=group)
    hidden = hidden_states.transpose(0, 1).contiguous()  # [b, s, h], as the labels
    if group is not None and not sequence_parallel:  # each rank's dh share summed (its all-reduce needs a
        hidden = copy_to_tensor_model_parallel_region(hidden, group=group)  # contiguous gradient: [b, s, h])
    if tuple(hidden.shape[:2]) != tuple(labels.shape):
        raise ValueError(f"hidden_states: expected [s, b, h] matching labels [b, s] = {list(labels.shape)}, got "
                         f"{list(hidden_states.shape)}")
    chunk_bytes = DEFAULT_CHUNK_BYTES
    if gradient_accumulation_fusion:  # (the per-token loss's deferred backward then allocates no dW)
        chunk_bytes += weight.numel() * weight.element_size()
    return linear_head_loss(hidden, weight, labels, spec, bias=bias, group=group, chunk_bytes=chunk_bytes,
                            hidden_grad="partial" if group is not None else "reduced",
                            weight_grad="main_grad" if gradient_accumulation_fusion else "return")
