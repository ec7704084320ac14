"""The per-row inputs of a call (the per-row temperature, the token weights; the selected ids): checked for
type, device and shape on the host, and flattened to one fp32 value per slot (K int64 ids per slot), as the
kernels read them; their values are checked on the device with the targets (kernels.head.prepare_call,
kernels.sparse.check_selected_kernel, headloss.validation)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .spec import LossSpec


def flat_temperature(value: Any, spec: LossSpec, token_shape: tuple[int, ...], device: torch.device,
                     per_sequence: tuple[int, torch.Tensor] | None = None) -> torch.Tensor | None:
    """The call's ``temperature`` (spec.LogitTransform.per_row_temperature), as :func:`flat_row_input`
    gives it; its values (positive, finite) are checked on the device with the targets."""
    return flat_row_input(value, "temperature", spec.transform.per_row_temperature,
                          "spec.transform.per_row_temperature", token_shape, device, per_sequence)


def flat_token_weights(value: Any, spec: LossSpec, token_shape: tuple[int, ...], device: torch.device,
                       per_sequence: tuple[int, torch.Tensor] | None = None) -> torch.Tensor | None:
    """The call's ``token_weights`` (spec.TokenWeights), as :func:`flat_row_input` gives it; its values
    (>= 0, finite) are checked on the device with the targets."""
    return flat_row_input(value, "token_weights", spec.token_weights is not None, "spec.token_weights",
                          token_shape, device, per_sequence)


def flat_row_input(value: Any, name: str, wanted: bool, needed_by: str, token_shape: tuple[int, ...],
                   device: torch.device, per_sequence: tuple[int, torch.Tensor] | None) -> torch.Tensor | None:
    """A per-row float input as the kernels read it: fp32, one per slot. Given like the targets (one per
    row; packed rows: [N] or [1, N]), or one per sequence: [B] for [B, T] targets, [S] for rows packed
    by cu_seqlens (``per_sequence``: S and each row's sequence). Refused, naming it, when the spec does
    not ask for it (``wanted``: ``needed_by`` is set). Detached: no gradient reaches it on either path."""
    if not wanted:
        if value is not None:
            raise ValueError(f"{name}: given, but {needed_by} is not set; set it, or drop this input")
        return None
    value = float_input(value, name, needed_by, device)
    shape, rows = tuple(value.shape), math.prod(token_shape)
    if shape == tuple(token_shape) or (len(token_shape) == 1 and shape == (1, rows)):
        flat = value.reshape(-1)
    elif len(token_shape) == 2 and shape == (token_shape[0],):
        flat = value.repeat_interleave(token_shape[1])
    elif per_sequence is not None and shape == (per_sequence[0],):
        flat = value[per_sequence[1]]
    else:
        sequences = f" or one per sequence {(token_shape[0],)}" if len(token_shape) == 2 else (
            f" or one per sequence {(per_sequence[0],)}" if per_sequence is not None else "")
        raise ValueError(f"{name}: shape {shape} fits neither one per row {tuple(token_shape)} (like the "
                         f"targets){sequences}")
    return flat.detach().to(torch.float32).contiguous()  # (an input of the loss: it takes no gradient)


def float_input(value: Any, name: str, needed_by: str, device: torch.device) -> torch.Tensor:
    """``value``, a floating-point tensor on ``device`` that ``needed_by`` requires (errors name it)."""
    if value is None:
        raise ValueError(f"{name}: required by {needed_by} but not given")
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        got = getattr(value, "dtype", type(value).__name__)
        raise TypeError(f"{name}: expected a floating-point tensor, got {got}")
    if value.device != device:
        raise ValueError(f"{name}: on {value.device}, logits on {device}")
    return value


def flat_selected_ids(value: Any, token_shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """The call's ``selected_ids`` (outputs: selected_logprobs) as the kernels read them: [n_out, K] int64,
    K per row, rows like the targets (packed rows: [N, K] or [1, N, K]); None where not given. Their values
    (-1 or an id in [0, V)) are checked on the device (kernels.sparse.check_selected_kernel); their type and K
    at the door (batch.CallInputs.selected_k, which the plan's K comes from)."""
    if value is None:
        return None
    if value.device != device:
        raise ValueError(f"selected_ids: on {value.device}, logits on {device}")
    shape, rows = tuple(value.shape), math.prod(token_shape)
    k = shape[-1]
    if not (shape[:-1] == tuple(token_shape) or (len(token_shape) == 1 and shape[:-1] == (1, rows))):
        raise ValueError(f"selected_ids: shape {shape} is not {(*token_shape, 'K')} (K ids per row, rows like "
                         "the targets)")
    return value.reshape(rows, k).to(torch.int64).contiguous()
