"""One reversible patch for any Hugging Face causal LM, and a Trainer callback for its metrics.

::

    from headloss.integrations.transformers import patch

    handle = patch(model, LossSpec(z_loss=ZLoss(weight=1e-4), entropy=Entropy(), token_accuracy=True))
    out = model(input_ids=ids, labels=labels)      # loss through linear_head_loss, no full logits
    out.loss.backward(); out.metrics["token_accuracy"]
    handle.undo()                                   # the model's own forward again

How it works, the same for every ``*ForCausalLM`` / ``*ForConditionalGeneration`` (no per-model
forward copies): with ``labels`` (or ``shift_labels``) the model's forward runs as written, but its
output embedding (``model.get_output_embeddings()``) computes the spec's loss from the hidden
states it receives with :func:`headloss.linear_head_loss` and returns an empty ``[B, T, 0]``
placeholder instead of the logits; the model's ``loss_function`` returns that loss. Whatever the
model adds to the loss (a MoE router's auxiliary loss) is kept. Without labels (generation,
evaluation of logits) nothing changes. Because the loss is computed inside the head's own call,
FSDP2 has the weight gathered there, and a tied embedding gets its gradient as usual.

The head's transform is read from the config -- Gemma 2/3 ``final_logit_softcapping``, Cohere
``logit_scale``, Granite ``logits_scaling``, Falcon-H1 ``lm_head_multiplier`` -- and checked: at patch
time a short probe compares the model's own logits and loss with the patched ones, and a model
whose head headloss cannot reproduce (another transform, a LoRA or quantised lm_head, a loss that
is not the causal-LM cross-entropy) is refused with an error, never scored wrongly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback

from ..api import head_loss, linear_head_loss
from ..linear import skips_ignored
from ..metrics import MetricsAccumulator
from ..output import HeadLossOutput
from ..plan import SpecLike
from ..scored import ScoredRows, scored_rows
from ..spec import LogitTransform, LossSpec
from .hf_model import (
    PatchError,
    causal_lm,
    check_head,
    check_stock_loss,
    full_tensor,
    head_transform,
    labels_position,
    merged_spec,
    probe_stock,
    restore_attribute,
    tolerance,
)

__all__ = ["HeadLossCallback", "HeadPatch", "PatchError", "head_transform", "patch"]


PATCH_CHUNK_BYTES = 128 << 20
"""The patch's logits chunk: half linear_head_loss's default, because in a whole training step the
head's working set adds to the body's activations (the trade is measured in docs/integrations.md)."""


@dataclass
class _PendingLoss:
    """One forward with labels, between the model's forward and its head."""

    labels: torch.Tensor | None
    shift_labels: torch.Tensor | None
    num_items_in_batch: Any
    ignore_index: int | None
    scored: ScoredRows | None = None  # the rows the head scores, queued at the forward's start (headloss.scored)
    every_row: bool = False  # the head computes every row: known from the shapes that too few are ignored to skip
    result: HeadLossOutput | None = None
    extra: dict = field(default_factory=dict)


class HeadPatch:
    """A patched model (see the module doc); undo with :meth:`undo` or use as a context manager.

    Attributes:
        spec: the LossSpec in use (the model's transform merged in).
        metrics: :class:`~headloss.metrics.MetricsAccumulator` fed by every training forward with
            labels (device tensors; no sync until ``metrics.compute()``).
        eval_metrics: the same for forwards in eval mode.
        last: the last call's :class:`~headloss.HeadLossOutput` (loss, metrics, per-token outputs).
    """

    def __init__(self, model, spec: SpecLike | None = None, *, chunk_bytes: int = PATCH_CHUNK_BYTES,
                 keep_logits: bool = False, fp32_weight_grad: bool = False, compact: bool = True, verify: bool = True,
                 validate=None, backend: str = "auto", metric_names: dict[str, str] | None = None) -> None:
        self.outer = model  # what the caller runs (a PEFT wrapper, an FSDP2 root): the probe runs through it
        self.model = causal_lm(model)
        self.head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        check_head(self.head)
        if getattr(self.model, "_headloss_patch", None) is not None:
            raise PatchError("model: already patched by headloss; undo() the earlier patch first")
        self.spec = merged_spec(LossSpec.coerce(spec), head_transform(self.model))
        self.chunk_bytes = chunk_bytes
        self.keep_logits = keep_logits
        self.fp32_weight_grad = fp32_weight_grad
        if not isinstance(compact, bool):
            raise TypeError(f"compact: expected True or False, got {type(compact).__name__}")
        self.compact = compact
        self.validate = validate
        self.backend = backend
        self.metrics = MetricsAccumulator(names=metric_names)
        self.eval_metrics = MetricsAccumulator(names=metric_names, prefix="eval_")
        self.last: HeadLossOutput | None = None
        self._pending: _PendingLoss | None = None
        self._inputs: dict[str, Any] = {}
        self._specs: dict[int, LossSpec] = {}
        self._active = False
        if verify:
            self._verify()
        self._apply()

    # --- installing and removing -----------------------------------------------------------------

    def _apply(self) -> None:
        model, head = self.model, self.head
        self._had_forward = "forward" in model.__dict__
        self._saved_forward = model.__dict__.get("forward")
        self._had_head_forward = "forward" in head.__dict__
        self._saved_head_forward = head.__dict__.get("forward")
        self._had_loss_function = "_loss_function" in model.__dict__
        self._saved_loss_function = model.__dict__.get("_loss_function")
        original_forward = model.forward
        original_head = head.forward
        original_loss = model.loss_function
        self._original_loss = original_loss
        labels_at = labels_position(original_forward)

        @functools.wraps(original_forward)
        def forward(*args, **kwargs):
            labels = kwargs.get("labels")
            if labels is None and labels_at is not None and len(args) > labels_at:
                labels = args[labels_at]
            shift_labels = kwargs.get("shift_labels")
            if not self._active or (labels is None and shift_labels is None) or self._pending is not None \
                    or kwargs.get("fused_lm_head"):
                return original_forward(*args, **kwargs)  # (fused_lm_head: TRL's own head, as TRL asks)
            call = _PendingLoss(labels=labels, shift_labels=shift_labels,
                         num_items_in_batch=kwargs.get("num_items_in_batch"), ignore_index=kwargs.get("ignore_index"))
            tokens = next((t for t in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1])
                           if t is not None), None)
            call.scored = self._scored_ahead(call, tokens.shape[1] if isinstance(tokens, torch.Tensor)
                                             and tokens.dim() >= 2 else None, tokens)
            self._pending = call
            try:
                out = original_forward(*args, **kwargs)
            finally:
                self._pending = None
            if call.result is None:
                raise RuntimeError(
                    f"{type(model).__name__}: the forward took labels but never called its lm_head; "
                    "headloss cannot compute its loss (undo() the patch for this model)"
                )
            return self._finish(out, call)

        def head_forward(hidden, *args, **kwargs):
            call = self._pending
            if not self._active or call is None or call.result is not None or args or kwargs:
                return original_head(hidden, *args, **kwargs)
            return self._head_loss(call, hidden, original_head)

        def loss_function(logits=None, labels=None, vocab_size=None, **kwargs):
            call = self._pending
            if not self._active or call is None or call.result is None:
                return original_loss(logits, labels, vocab_size, **kwargs)
            call.extra["loss_calls"] = call.extra.get("loss_calls", 0) + 1
            return call.result.loss

        model.forward = forward
        head.forward = head_forward
        model.loss_function = loss_function
        model._headloss_patch = self
        self._installed = (forward, head_forward, loss_function)
        # the Trainer's evaluation collects every output key but these into its "logits"
        config = model.config
        self._had_ignore = "keys_to_ignore_at_inference" in config.__dict__
        self._saved_ignore = config.__dict__.get("keys_to_ignore_at_inference")
        ignore = list(getattr(config, "keys_to_ignore_at_inference", None) or ["past_key_values"])
        config.keys_to_ignore_at_inference = ignore + [k for k in ("metrics", "headloss") if k not in ignore]
        self._active = True

    def undo(self) -> None:
        """Restore the model's own forward, head and loss function (idempotent)."""
        if not self._active:
            return
        model, head = self.model, self.head
        forward, head_forward, loss_function = self._installed
        self._active = False  # the wrappers pass everything through from here on
        # restore only what is still ours: a wrapper installed over ours (accelerate's autocast
        # forward, say) stays, and reaches the original through our now inactive one
        if model.__dict__.get("forward") is forward:
            restore_attribute(model, "forward", self._had_forward, self._saved_forward)
        if head.__dict__.get("forward") is head_forward:
            restore_attribute(head, "forward", self._had_head_forward, self._saved_head_forward)
        if model.__dict__.get("_loss_function") is loss_function:
            restore_attribute(model, "_loss_function", self._had_loss_function, self._saved_loss_function)
        restore_attribute(model.config, "keys_to_ignore_at_inference", self._had_ignore, self._saved_ignore)
        model.__dict__.pop("_headloss_patch", None)

    @contextlib.contextmanager
    def inputs(self, **tensors):
        """Per-call inputs of the spec's terms for the forwards inside the block (the policy term's
        advantages, old_logprobs, ref_logprobs, loss_mask, importance_weights; teacher_logits),
        passed to headloss as they are: shaped like the labels the forward gets."""
        before = self._inputs
        self._inputs = {k: v for k, v in tensors.items() if v is not None}
        try:
            yield self
        finally:
            self._inputs = before

    @property
    def active(self) -> bool:
        return self._active

    def __enter__(self) -> HeadPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    # --- one forward -------------------------------------------------------------------------------

    def _spec_for(self, ignore_index: int | None) -> LossSpec:
        if ignore_index is None or ignore_index == self.spec.ignore_index:
            return self.spec
        spec = self._specs.get(ignore_index)
        if spec is None:
            spec = LossSpec.model_validate({**dict(self.spec), "ignore_index": int(ignore_index)})
            self._specs[ignore_index] = spec
        return spec

    def _scored_ahead(self, call: _PendingLoss, seq_len: int | None, tokens=None) -> ScoredRows | None:
        """The rows the head will score, queued before the model's body runs (headloss.scored): the head's
        call then skips the ignored rows without a host sync behind the body's forward (it waits for the GPU
        to pass the forward's start instead). Where the head's call compacts only; the labels are moved to
        the head's device here, once. ``seq_len``: the input tokens' T (labels [B, T], or completion ids
        [B, T - 1]); ``tokens``: the input ids. Labels that are the input ids themselves (a negative
        ignore_index, which no token id equals) leave one row of each sequence unscored, the shift's last:
        where that is below linear.COMPACT_MIN_SHARE (linear.skips_ignored) the call would compute every row
        anyway, so nothing is queued or waited for (``call.every_row``)."""
        weight = getattr(self.head, "weight", None)
        if not self.compact or self.keep_logits or self.backend == "torch" or not isinstance(weight, torch.Tensor) \
                or weight.device.type == "meta" or torch.compiler.is_compiling() \
                or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        shift = call.shift_labels is None
        targets = call.labels if shift else call.shift_labels
        if not isinstance(targets, torch.Tensor) or targets.dim() != 2 or targets.device.type == "meta":
            return None
        ignore_index = self._spec_for(call.ignore_index).ignore_index
        if shift and targets is tokens and ignore_index < 0 and not skips_ignored(targets.numel(), targets.shape[0]):
            call.every_row = True  # (the B ignored rows: the shift's last of each sequence)
            return None
        targets = targets.to(weight.device)  # (labels on another device: the head's call gets this copy)
        if shift:
            call.labels = targets
        else:
            call.shift_labels = targets
        if not shift or seq_len is None or targets.shape[1] not in (seq_len, seq_len - 1):
            seq_len = None
        try:
            return scored_rows(targets, shift=shift, ignore_index=ignore_index, seq_len=seq_len)
        except (TypeError, ValueError):  # (bad labels: the head's call says what is wrong with them)
            return None

    def _head_loss(self, call: _PendingLoss, hidden: torch.Tensor, original_head) -> torch.Tensor:
        spec = self._spec_for(call.ignore_index)
        if call.shift_labels is not None:
            targets, shift = call.shift_labels, False
        else:
            targets, shift = call.labels, True
        if targets.device != hidden.device:
            targets = targets.to(hidden.device)
        num_items = call.num_items_in_batch
        if isinstance(num_items, torch.Tensor) and num_items.device != hidden.device:
            num_items = num_items.to(hidden.device)
        if self.keep_logits:
            logits = original_head(hidden)
            call.result = head_loss(logits, targets, spec, shift=shift, num_items_in_batch=num_items,
                                    validate=self.validate, backend=self.backend, **self._inputs)
            return logits
        weight, bias = full_tensor(self.head.weight), full_tensor(getattr(self.head, "bias", None))
        scored = call.scored  # (one that does not fit the call -- labels the model wrote in place, hidden states
        # it sliced -- is left out: the call counts its rows itself)
        fits = scored is not None and scored.fits(targets, shift, spec.ignore_index, tuple(hidden.shape[:-1]))
        compact = scored if fits else self.compact and not call.every_row
        call.result = linear_head_loss(
            hidden, weight, targets, spec, bias=bias, shift=shift, num_items_in_batch=num_items,
            chunk_bytes=self.chunk_bytes, fp32_weight_grad=self.fp32_weight_grad, compact=compact,
            validate=self.validate, backend=self.backend, **self._inputs,
        )
        return hidden.new_empty(*hidden.shape[:-1], 0)

    def _finish(self, out, call: _PendingLoss):
        result = call.result
        self.last = result
        accumulator = self.metrics if self.model.training else self.eval_metrics
        if torch.is_grad_enabled() or not self.model.training:
            accumulator.update(result, num_items_in_batch=call.num_items_in_batch,
                               reduction="sum" if self.spec.reduction == "sum" else "mean")
        if isinstance(out, tuple):
            return out
        fields = {k: v for k, v in out.items()}
        if not self.keep_logits:
            fields.pop("logits", None)
        # a subclass of the model's output type with two more fields (not two more keys: DDP and
        # pytree rebuild an output from its dataclass fields)
        return _with_metrics(type(out))(**fields, metrics=dict(result.metrics), headloss=result)

    # --- the check at patch time ------------------------------------------------------------------

    def _verify(self) -> None:
        """Run a short probe through the stock model and through the patch, and compare logits and loss (both
        in eval mode: no dropout, no router jitter)."""
        was_training = self.outer.training
        try:
            self.outer.eval()
            stock, ids, labels, self.spec = probe_stock(self.outer, self.head, self.spec)
            check_stock_loss(self.model, stock, labels)
            self._probe_patched(stock, ids, labels)
        finally:
            self.outer.train(was_training)

    def _probe_patched(self, stock, ids, labels) -> None:
        """The patched loss of the probe equals the model's own cross-entropy (CE-only spec)."""
        name = type(self.model).__name__
        t = self.spec.transform
        probe = LossSpec(transform=LogitTransform(logit_scale=t.logit_scale, softcap=t.softcap), ignore_index=-100)
        full, self.spec = self.spec, probe
        self._apply()
        try:
            with torch.no_grad():
                try:
                    mine = self.outer(input_ids=ids, labels=labels, use_cache=False)
                except TypeError:
                    mine = self.outer(input_ids=ids, labels=labels)
        finally:
            self.undo()
            self.spec = full
            self.metrics.reset()
            self.eval_metrics.reset()
            self.last = None
        if not torch.allclose(mine.loss.float(), stock.loss.float(), **tolerance(stock.logits.dtype)):
            raise PatchError(
                f"{name}: the patched loss of a probe ({float(mine.loss):.6g}) differs from the model's own "
                f"({float(stock.loss):.6g}); refused rather than mis-scored"
            )


_OUTPUT_TYPES: dict[type, type] = {}


def _with_metrics(cls: type) -> type:
    """``cls`` (a transformers ModelOutput dataclass) with ``metrics`` and ``headloss`` fields."""
    sub = _OUTPUT_TYPES.get(cls)
    if sub is None:
        sub = dataclasses.make_dataclass(
            f"{cls.__name__}WithHeadLoss",
            [("metrics", dict | None, dataclasses.field(default=None)),
             ("headloss", Any, dataclasses.field(default=None))],
            bases=(cls,),
        )
        sub.__module__ = __name__
        sub.__doc__ = f"{cls.__name__} with headloss's metrics and HeadLossOutput (per-token outputs)."
        _OUTPUT_TYPES[cls] = sub
    return sub


def patch(model, spec: SpecLike | None = None, **options) -> HeadPatch:
    """Patch ``model`` (any HF causal LM, or a PEFT model around one) to compute ``spec`` (default:
    mean cross-entropy) through headloss whenever it gets labels. Returns a :class:`HeadPatch`
    (``.undo()``, context manager, ``.metrics``).

    Options: ``chunk_bytes`` (the logits chunk of linear_head_loss; default :data:`PATCH_CHUNK_BYTES`),
    ``keep_logits`` (also return the logits: materialises them and uses head_loss on them),
    ``fp32_weight_grad``, ``compact`` (False: every row computed, ignored ones too; by default ignored rows
    are skipped, their count queued at the forward's start: headloss.scored), ``verify``
    (the probe at patch time; False for weights that cannot run yet), ``validate``, ``backend``,
    ``metric_names`` (e.g. :data:`headloss.metrics.TRL_NAMES`).
    """
    return HeadPatch(model, spec, **options)


class HeadLossCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that adds a patch's metrics to the Trainer's logs.

    ``HeadLossCallback(handle)`` (a :class:`HeadPatch`, or a MetricsAccumulator): at each log, the
    metrics accumulated since the last one -- token-weighted over micro-batches, reduced over the
    data-parallel ranks with one collective, read with one host sync -- join the logged values
    (the Trainer's own ``loss`` is kept; ``drop`` names ours to leave out). Put it first so that
    reporting callbacks see the values: ``trainer.callback_handler.callbacks.insert(0, cb)`` or
    :func:`attach`.
    """

    def __init__(self, source: HeadPatch | MetricsAccumulator, drop: tuple[str, ...] = ("loss",)) -> None:
        self.train = source.metrics if isinstance(source, HeadPatch) else source
        self.eval = source.eval_metrics if isinstance(source, HeadPatch) else None
        self.drop = set(drop)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        is_eval = any(k.startswith("eval_") for k in logs)
        accumulator = self.eval if is_eval else self.train
        if accumulator is None:
            return
        values = {k: v for k, v in accumulator.compute().items() if k.removeprefix("eval_") not in self.drop}
        logs.update(values)
        if state.log_history and state.log_history[-1] is not logs:
            state.log_history[-1].update(values)


def attach(trainer, handle: HeadPatch, **options):
    """Add a :class:`HeadLossCallback` for ``handle`` in front of the Trainer's callbacks (so that
    the reporters -- console, W&B, TensorBoard -- log its values); returns the callback."""
    callback = HeadLossCallback(handle, **options)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


__all__ += ["PatchError", "attach"]
