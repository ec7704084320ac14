"""The public entry points: :func:`head_loss` / :class:`HeadLoss` on logits, :func:`linear_head_loss` /
:class:`LinearHeadLoss` on hidden states x lm_head weight (the fused lm_head, no full logits).

The door only bundles: each call's keywords become a few typed objects (headloss.batch: the
:class:`~headloss.batch.Teacher`, the :class:`~headloss.batch.PolicyBatch`, the row
:class:`~headloss.batch.Layout`, the :class:`~headloss.batch.Options`) and the spec's plan, which
headloss.logits / headloss.lm_head run: checks -> route -> kernels (or plain torch) -> output.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Unpack

import torch

from .batch import CallInputs, HeadInputs, LinearInputs, LinearOptions, Options
from .chunks import DEFAULT_CHUNK_BYTES
from .lm_head import run_linear
from .logits import run_head
from .output import HeadLossOutput
from .plan import SpecLike, plan_for, selecting
from .scored import ScoredRows
from .spec import LossSpec
from .validation import Validate, check_pending

Backend = Literal["auto", "triton", "torch"]


def head_loss(
    logits: torch.Tensor,
    targets: torch.Tensor | None = None,
    spec: SpecLike | None = None,
    *,
    inplace_grad: bool = False,
    validate: Validate = None,
    backend: Backend = "auto",
    group: Any = None,
    **inputs: Unpack[HeadInputs],
) -> HeadLossOutput:
    """Every loss, metric and per-token output of ``spec`` from one pass over ``logits``.

    Args:
        logits: [N, V] or [B, T, V], fp32/bf16/fp16 (strided rows allowed; the vocabulary dimension
            has stride 1).
        targets: [N] or [B, T] ids in [0, V) or ``spec.ignore_index``; optional when nothing requested
            reads them (every row then counts).
        spec: a :class:`LossSpec`, a dict, or a YAML/JSON path (default: mean cross-entropy).
        teacher_logits, ..., route: the per-call keywords (:class:`headloss.batch.HeadInputs`), below.
        teacher_logits: like ``logits``, for the distillation term; read only.
        teacher_probs: like ``logits``: a teacher given as probabilities (``teacher: probs``), each row
            summing to 1 within 1e-3 (checked as ``validate`` says); read only. Or, beside
            ``teacher_ids`` (``teacher: topk``), the top-k teacher's probabilities [.., K] in place of
            ``teacher_logprobs`` (their log).
        teacher_ids, teacher_logprobs: a sparse teacher (``spec.distillation.teacher``): its top-k ids
            [.., K] (-1 where a row has fewer) and their log-probs [.., K], rows like ``logits``'; or
            (teacher ``"token"``) its log-prob of each target, shaped like ``targets``
            (docs/distillation.md).
        advantages, old_logprobs, ref_logprobs, loss_mask, importance_weights, rollout_logprobs,
            sequence_ids, num_sequences_in_batch, entropy_quantile_group: the policy term's inputs
            (:class:`headloss.batch.PolicyInputs`, docs/policy.md). Tokens outside ``loss_mask`` (0/1)
            count for no term.
        num_items_in_batch: with ``reduction="mean"``, divide the summed loss by this instead of the
            number of counted tokens (HF gradient accumulation). Number or tensor.
        shift: next-token scoring on the full [B, T, V] output without slicing it: ``targets`` are
            the HF labels [B, T] (row t against ``labels[:, t + 1]``) or completion ids [B, T - 1]
            (row t against ``ids[:, t]``); each sequence's last row is not scored (gradient 0).
        cu_seqlens, position_ids: packed sequences in [N, V] (or [1, N, V]) rows; shift and every
            sequence statistic work within each sequence (docs/runtime.md#packed-sequences).
        temperature: with ``spec.transform.per_row_temperature``, each row's temperature (every term
            sees softcap(logit_scale * z) / temperature of its own row): shaped like ``targets`` (row t's
            own, as the policy inputs are), or one per sequence ([B] for [B, T] targets, [S] for rows
            packed by ``cu_seqlens``); positive and finite (checked with the targets, as ``validate``
            says).
        token_weights: with ``spec.token_weights``, each token's weight on every term's value and gradient,
            shaped like ``temperature`` (row t's own: with HF labels and ``shift``, ``token_weights[:, t]``
            weighs the row that predicts ``labels[:, t + 1]``; or per sequence); >= 0 and finite (checked as
            ``temperature`` is); it takes no gradient. A mean divides by the counted tokens' summed
            weights, or their count (:class:`TokenWeights`).
        selected_ids: with ``selected_logprobs`` in ``spec.outputs``, K ids per row to score ([.., K] int,
            K <= 64, the rows shaped like ``temperature``; -1 where a row has fewer; an id may repeat):
            ``out.selected_logprobs`` [.., K] holds log p of each under the spec's transform (0 at -1 and at
            rows not scored), with gradient to the logits when ``differentiable_outputs`` is set.
        inplace_grad: write d loss / d logits over ``logits`` (saves N x V memory; the logits are
            destroyed). Ignored under torch.compile.
        validate: targets, counts and sequence ids checked on the device without a host wait:
            ``True`` (default: raised by the next call or ``metrics_as_floats``), ``"sync"`` (raised
            in the call), ``False`` / ``HEADLOSS_VALIDATE=0`` (off). An unchecked bad target gives
            NaN in its row, never an out-of-bounds read.
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"`` (plain torch),
            or ``"auto"``: triton where it runs, else torch.
        group: vocab-parallel: ``logits`` are this rank's contiguous vocabulary slice, the other inputs
            replicated; outputs equal the single-device result, the gradient is this rank's slice; one
            all_gather per call (docs/vocab-parallel.md). A DTensor sharded on its last dim needs none.
        route: run on this route (:data:`headloss.routes.ROUTES`) instead of the default; an error
            names the routes the call can take. ``out.route`` says which ran.

    Returns:
        :class:`HeadLossOutput`. NaN or +inf logits give NaN loss and gradient in their rows; -inf
        logits (a masked vocabulary) are fine unless at the target.
    """
    if not torch.compiler.is_compiling():
        check_pending()
    call = CallInputs.of(inputs, HeadInputs, "head_loss")
    backend, route = _renamed(backend, call.route)
    options = Options(validate=validate, backend=backend, route=route, group=group, inplace_grad=inplace_grad)
    plan = selecting(plan_for(spec, has_targets=targets is not None), call.selected_k)
    return run_head(logits, targets, plan, call, options)


def linear_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None = None,
    spec: SpecLike | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fp32_weight_grad: bool = False,
    compact: bool | ScoredRows = True,
    validate: Validate = None,
    backend: Backend = "auto",
    group: Any = None,
    hidden_grad: str = "reduced",
    weight_grad: str = "return",
    **inputs: Unpack[LinearInputs],
) -> HeadLossOutput:
    """:func:`head_loss` of ``hidden @ weight.T + bias`` without materialising the logits.

    Rows run in chunks whose logits fit ``chunk_bytes`` (headloss.chunks): per chunk one GEMM for
    the logits, the kernel in place on them, then ``dh_c = g_c @ W`` and ``dW += g_c.T @ h_c`` --
    the 3 GEMMs of a plain lm_head plus ~3 chunk-sized kernel passes. Deferred mode (reduction
    "none", differentiable outputs) recomputes the logits in backward: 4 GEMMs. ``out.route`` says
    which. Under ``torch.autocast`` the GEMMs run in the autocast dtype, as ``F.linear`` would.

    Args:
        hidden: [N, H] or [B, T, H] (fp32/bf16/fp16); ``weight``: [V, H], same dtype and device;
            ``bias``: optional [V]. ``targets``, ``spec``, ``shift``, ``cu_seqlens``,
            ``position_ids``, ``temperature``, ``token_weights``, ``selected_ids``, the policy inputs,
            ``num_items_in_batch``, ``validate``, ``backend``, ``route``: as in :func:`head_loss`.
        teacher_logits: [.., V] teacher logits (or ``teacher_probs``, as in :func:`head_loss`), or instead
            ``teacher_hidden`` [.., Ht] with ``teacher_weight`` [V, Ht] (and ``teacher_bias``): the
            teacher's logits computed chunk by chunk too.
        chunk_bytes: the budget of one chunk's logits (default 256 MiB; 128 MiB where memory is
            tight). Peak extra memory is about this plus dW (V x H), dh (N x H) and O(N) buffers.
        fp32_weight_grad: accumulate dW in fp32 and round once (a V x H fp32 buffer).
        compact: skip ignored rows where they are at least 1/64 of the rows (one host sync for their count;
            off under capture and compile), or :func:`headloss.scored_rows` of these targets, made earlier (the
            count copied to the host then, read here without a host sync; headloss.scored). False computes
            every row.
        group: a column-parallel lm_head: ``weight`` (and ``bias``, a teacher's weight or logits) are
            this rank's vocabulary rows, ``hidden`` and the targets replicated; dW / db are this
            rank's rows; one all_gather of statistics per chunk. A DTensor weight sharded on dim 0
            needs none.
        hidden_grad: with ``group``, ``"reduced"`` (default) sums dh over the group; ``"partial"``
            leaves each rank its columns' share for a layer that reduces it (Megatron's sequence
            parallelism, verl's ``linear_cross_entropy``).
        weight_grad: ``"return"`` (default) hands dW to autograd; ``"main_grad"`` follows Megatron's
            gradient accumulation fusion: dW is added into ``weight.main_grad`` (which Megatron's DDP
            gives each parameter; fp32 or the weight's dtype) and autograd gets Megatron's dummy with
            ``weight.grad_added_to_main_grad`` set (None where the weight has no such flag). In deferred
            mode on the kernels' path each chunk adds into ``main_grad`` directly (no V x H dW buffer);
            where dW is computed in forward, backward adds it times d loss (kept fp32 until then with
            ``fp32_weight_grad``: a V x H fp32 buffer between forward and backward). Eager only; a weight
            without ``main_grad`` is refused (headloss.main_grad).
    """
    if not torch.compiler.is_compiling():
        check_pending()
    call = CallInputs.of(inputs, LinearInputs, "linear_head_loss")
    backend, route = _renamed(backend, call.route)
    options = LinearOptions(validate=validate, backend=backend, route=route, group=group, chunk_bytes=chunk_bytes,
                            fp32_weight_grad=fp32_weight_grad, compact=compact, hidden_grad=hidden_grad,
                            weight_grad=weight_grad)
    plan = selecting(plan_for(spec, has_targets=targets is not None), call.selected_k)
    return run_linear(hidden, weight, targets, plan, call, options)


def _renamed(backend, route) -> tuple:
    """The plain-torch path's former name ``"reference"`` (as ``backend`` or ``route``) as ``"torch"``, with a
    FutureWarning at the caller's line."""
    if isinstance(backend, str) and backend == "reference":
        warnings.warn("backend: 'reference' is now called 'torch'", FutureWarning, stacklevel=3)
        backend = "torch"
    if isinstance(route, str) and route == "reference":
        warnings.warn("route: 'reference' is now called 'torch'", FutureWarning, stacklevel=3)
        route = "torch"
    return backend, route


class HeadLoss(torch.nn.Module):
    """Module form of :func:`head_loss`: ``HeadLoss(spec)(logits, targets, ...)``; the spec and the call
    options are fixed at construction, the per-call inputs are ``forward``'s."""

    def __init__(self, spec: SpecLike | None = None, *, inplace_grad: bool = False, validate: Validate = None,
                 backend: Backend = "auto", group: Any = None) -> None:
        super().__init__()
        self.spec = LossSpec.coerce(spec)
        self.inplace_grad = inplace_grad
        self.validate = validate
        self.backend = backend
        self.group = group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor | None = None,
                **inputs: Unpack[HeadInputs]) -> HeadLossOutput:
        """:func:`head_loss` of these inputs under the module's spec and options."""
        return head_loss(logits, targets, self.spec, inplace_grad=self.inplace_grad, validate=self.validate,
                         backend=self.backend, group=self.group, **inputs)

    def extra_repr(self) -> str:
        return f"spec={self.spec!r}"


class LinearHeadLoss(torch.nn.Module):
    """Module form of :func:`linear_head_loss`: ``LinearHeadLoss(spec)(hidden, lm_head.weight, labels, ...)``;
    the spec and the call options are fixed at construction, the per-call inputs are ``forward``'s."""

    def __init__(self, spec: SpecLike | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 fp32_weight_grad: bool = False, compact: bool = True, validate: Validate = None,
                 backend: Backend = "auto", group: Any = None, hidden_grad: str = "reduced",
                 weight_grad: str = "return") -> None:
        super().__init__()
        self.spec = LossSpec.coerce(spec)
        self.options = dict(chunk_bytes=chunk_bytes, fp32_weight_grad=fp32_weight_grad, compact=compact,
                            validate=validate, backend=backend, group=group, hidden_grad=hidden_grad,
                            weight_grad=weight_grad)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None = None, *,
                compact: ScoredRows | None = None, **inputs: Unpack[LinearInputs]) -> HeadLossOutput:
        """:func:`linear_head_loss` of these inputs under the module's spec and options (``compact``: this
        call's :func:`headloss.scored_rows`, in place of the module's setting)."""
        options = self.options if compact is None else {**self.options, "compact": compact}
        return linear_head_loss(hidden, weight, targets, self.spec, **options, **inputs)

    def extra_repr(self) -> str:
        return f"spec={self.spec!r}"
