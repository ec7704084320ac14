"""Packed sequences: rows ``[total_tokens, ...]`` holding several sequences back to back.

Padding-free training (verl's remove-padding, HF's ``DataCollatorWithFlattening``, flash-attention's
varlen kernels) hands the head one stream of rows and the sequences' boundaries, as ``cu_seqlens``
(``[S + 1]`` row offsets: sequence s is rows ``cu_seqlens[s]:cu_seqlens[s + 1]``) or as
``position_ids`` that restart at 0 where a sequence begins. :func:`packed_rows` reads them into a
:class:`Packed` (each row's sequence and whether it is its sequence's last row) without a host
read; :func:`packed_targets` gives the row-aligned targets a padded ``[S, T]`` call would score:

* ``shift=True``: row i is scored against ``targets[i + 1]`` of its own sequence (``targets`` are
  the stream's token ids or HF labels, as for ``[B, T]``);
* ``shift=False``: row i against ``targets[i]`` (already shifted, e.g. verl's labels, rolled over
  the whole stream);

and either way a sequence's last row is never scored: its next token belongs to the next sequence.
The policy term takes the boundaries as its sequences (``sequence_ids`` are derived, a sequence of
length 0 counts as a padded row without tokens would), per-token inputs shaped like the rows, and
advantages one per row or (with ``cu_seqlens``) one per sequence.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .validation import packing_mark


class Packed(NamedTuple):
    """The sequences of packed rows, on the rows' device."""

    seq: torch.Tensor  # (N,) int64: each row's sequence, in [0, n_slots)
    last: torch.Tensor  # (N,) bool: the last row of its sequence (nothing after it to score against)
    n_slots: int  # sequences (cu_seqlens: S), or N (position_ids: their count is a device value)
    n_seq: int | torch.Tensor  # the number of sequences, a padded call's B
    max_len: int | torch.Tensor  # the longest sequence's rows, a padded call's T
    mark: torch.Tensor | None  # () int64: 0, or validation.packing_mark's value when cu_seqlens is malformed
    per_sequence: bool  # advantages may come one per sequence ([n_slots])


def packed_rows(rows: int, device: torch.device, cu_seqlens: Any = None, position_ids: Any = None) -> Packed:
    """The Packed of ``rows`` rows from ``cu_seqlens`` or ``position_ids`` (one of them; errors name
    the argument). Values are checked on the device (``bad``), never read on the host."""
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("cu_seqlens: give cu_seqlens or position_ids, not both")
    index = torch.arange(rows, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1 or \
                cu.dtype not in (torch.int32, torch.int64):
            got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"cu_seqlens: expected a 1-D int32 or int64 tensor [S + 1] of row offsets, got {got}")
        if cu.device != device:
            raise ValueError(f"cu_seqlens: on {cu.device}, the rows on {device}")
        cu = cu.long()
        n = cu.numel() - 1
        lengths = cu[1:] - cu[:-1]
        seq = torch.searchsorted(cu[1:].contiguous(), index, right=True).clamp(0, max(n - 1, 0))
        ends = (cu[1:] - 1).clamp(-1, rows)  # each sequence's last row (-1 or a row past the end: none)
        last = torch.zeros(rows + 2, dtype=torch.bool, device=device)
        last[(ends + 1).clamp(0, rows + 1)] = True
        last = last[1:rows + 1] | (index == rows - 1)
        max_len = lengths.clamp(min=0).max() if n else 0
        return Packed(seq, last, n, n, max_len, packing_mark(cu, rows), True)
    pos = position_ids
    if not isinstance(pos, torch.Tensor) or pos.dtype not in (torch.int32, torch.int64) or \
            pos.numel() != rows or (pos.dim() == 2 and pos.shape[0] != 1) or pos.dim() not in (1, 2):
        got = f"{pos.dtype} {tuple(pos.shape)}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise ValueError(f"position_ids: expected integer [{rows}] or [1, {rows}] (like the rows), got {got}")
    if pos.device != device:
        raise ValueError(f"position_ids: on {pos.device}, the rows on {device}")
    starts = (pos.reshape(-1) == 0) | (index == 0)
    seq = torch.cumsum(starts.long(), 0) - 1
    last = torch.cat([starts[1:], torch.ones(1, dtype=torch.bool, device=device)]) if rows else starts
    counts = torch.zeros(rows, dtype=torch.int64, device=device).index_add_(0, seq.clamp(min=0), torch.ones_like(seq))
    return Packed(seq.clamp(min=0), last, rows, starts.sum(), counts.max() if rows else 0, None, False)


def packed_per_sequence(shape: tuple[int, ...], sequences: int, rows: int) -> bool:
    """Advantages of packed rows shaped ``shape`` are one per sequence: [S, 1], or [S] unless S = N
    (then [N] is one per row, as it always is)."""
    return tuple(shape) == (sequences, 1) or (tuple(shape) == (sequences,) and sequences != rows)


def packed_targets(targets: Any, packed: Packed, shift: bool, ignore_index: int, validate: str) -> torch.Tensor:
    """Row-aligned targets [N] of packed rows: ``targets[i + 1]`` (``shift``) or ``targets[i]``,
    ``ignore_index`` at each sequence's last row. A malformed ``cu_seqlens`` puts its mark
    (``packed.mark``) at row 0, so that the device check of the targets reports it naming
    cu_seqlens and its first wrong offset (policy.inputs keeps it there whatever loss_mask says)."""
    rows = packed.seq.numel()
    if not isinstance(targets, torch.Tensor):
        raise ValueError("targets: packed rows (cu_seqlens / position_ids) need targets")
    if targets.numel() != rows or (targets.dim() == 2 and targets.shape[0] != 1) or targets.dim() not in (1, 2):
        raise ValueError(f"targets: expected [{rows}] or [1, {rows}] for packed rows, got {tuple(targets.shape)}")
    flat = targets.reshape(-1)
    if flat.dtype not in (torch.int64, torch.int32) and not flat.dtype.is_floating_point:
        flat = flat.long()
    if shift:
        flat = torch.cat([flat[1:], flat.new_full((1,), ignore_index)]) if rows else flat
    out = torch.where(packed.last, ignore_index, flat)
    return marked(out, packed, validate)


def marked(targets: torch.Tensor, packed: Packed, validate: str) -> torch.Tensor:
    """Row-aligned targets [N] with a malformed ``cu_seqlens``'s mark at row 0 (a new tensor; the
    targets as they are without cu_seqlens or with validation off)."""
    if packed.mark is None or not targets.numel() or validate == "off":
        return targets
    targets = targets.long()
    return torch.cat([torch.where(packed.mark != 0, packed.mark, targets[:1]), targets[1:]])


def packed_policy_inputs(given: dict, packed: Packed) -> dict:
    """The policy inputs of packed rows: ``[1, N]`` tensors as ``[N]``, ``sequence_ids`` refused (the
    boundaries give the sequences), the Packed passed on in its place."""
    if given.get("sequence_ids") is not None:
        raise ValueError("sequence_ids: packed rows take their sequences from cu_seqlens / position_ids")
    rows = packed.seq.numel()
    out = {}
    for name, value in given.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and tuple(value.shape) == (1, rows):
            value = value.reshape(-1)
        out[name] = value
    out["sequence_ids"] = packed
    return out


def packed_call(rows, targets, companions: tuple, cu_seqlens, position_ids, shift: bool, ignore_index: int,
                mode: str) -> tuple:
    """(rows [N, ...], row-aligned targets [N], companions, Packed) of a packed call: ``rows`` (logits or
    hidden states) [N, ...] or [1, N, ...]; ``companions`` (the teacher's rows) lose a leading 1 with
    them; ``mode`` is validation_mode's."""
    if isinstance(rows, torch.Tensor) and rows.dim() == 3:
        if rows.shape[0] != 1:
            raise ValueError(f"cu_seqlens: packed rows are [N, ...] or [1, N, ...], got {tuple(rows.shape)}")
        rows = rows[0]
        companions = tuple(t[0] if isinstance(t, torch.Tensor) and t.dim() == 3 else t for t in companions)
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError(f"cu_seqlens: packed rows are [N, ...] or [1, N, ...], got {getattr(rows, 'shape', rows)}")
    packed = packed_rows(rows.shape[0], rows.device, cu_seqlens, position_ids)
    return rows, packed_targets(targets, packed, shift, ignore_index, mode), companions, packed
