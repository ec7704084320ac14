"""The rows a ``linear_head_loss`` call scores, found ahead of the call (``compact=scored_rows(...)``).

``compact=True`` skips the ignored rows of a call at the cost of one host sync: the chunk loop needs their
count on the host, and ``nonzero`` waits for every kernel queued before it, i.e. for the whole forward of the
model's body when the head comes last. The wait splits the step at the head: the GPU cannot run the body's
forward while the host issues the head and the backward, so it costs wherever the host would have been ahead.

:func:`scored_rows` does the same work early, where the targets are ready but little is queued (a training
step's start, before the body's forward): it queues the mask, the rows in order (scored rows first) and a
copy of their count into pinned host memory, with an event after it. The call later waits for that event
only, which the GPU has usually passed by then::

    rows = headloss.scored_rows(labels, shift=True)          # after the batch is on the GPU
    hidden = body(input_ids)
    out = headloss.linear_head_loss(hidden, weight, labels, shift=True, compact=rows)

The handle belongs to one targets tensor: the call refuses (naming ``compact``) other targets, targets
written in place since, another ``shift``, ``ignore_index`` or sequence length. The Hugging Face patch
(headloss.integrations.transformers) makes one at the start of each forward with labels.
"""

from __future__ import annotations

import math

import torch

from .inputs import INT_DTYPES, flat_targets, pad_shifted
from .parallel import is_dtensor

__all__ = ["ScoredRows", "scored_rows"]


class ScoredRows:
    """What :func:`scored_rows` queued for one targets tensor: read by ``linear_head_loss(compact=...)``."""

    def __init__(self, targets: torch.Tensor, shift: bool, ignore_index: int, seq_len: int | None,
                 rows: int, order: torch.Tensor, ignored: torch.Tensor, event) -> None:
        self.targets = targets
        self.version = targets._version
        self.shift = shift
        self.ignore_index = ignore_index
        self.seq_len = seq_len
        self.rows = rows
        self._order = order  # [rows] int64: the scored rows, ascending, then the ignored ones
        self._ignored = ignored  # [] int64, the ignored rows' count: pinned host memory (CUDA, filled by the copy
        # before ``event``) or a CPU tensor
        self._event = event

    def __repr__(self) -> str:
        return (f"ScoredRows(rows={self.rows}, shift={self.shift}, ignore_index={self.ignore_index}, "
                f"device={self._order.device})")

    def fits(self, targets, shift: bool, ignore_index: int, token_rows: tuple[int, ...]) -> bool:
        """Whether this handle was made for these targets (unwritten since) and this layout (:meth:`check`)."""
        try:
            self.check(targets, shift, ignore_index, token_rows)
        except ValueError:
            return False
        return True

    def check(self, targets, shift: bool, ignore_index: int, token_rows: tuple[int, ...]) -> None:
        """A ValueError naming ``compact`` where this handle was not made for the call's targets and layout."""
        if targets is not self.targets:
            raise ValueError("compact: the ScoredRows were made from another targets tensor than this call's "
                             "(headloss.scored_rows(targets, ...) with the targets passed to the call)")
        if targets._version != self.version:
            raise ValueError("compact: the targets were written in place after headloss.scored_rows read them; "
                             "make the ScoredRows after the last write")
        if shift != self.shift or ignore_index != self.ignore_index:
            raise ValueError(f"compact: the ScoredRows were made with shift={self.shift}, ignore_index="
                             f"{self.ignore_index}; the call has shift={shift}, ignore_index={ignore_index}")
        if math.prod(token_rows) != self.rows or (shift and (len(token_rows) != 2 or token_rows[1] != self.seq_len)):
            raise ValueError(f"compact: the ScoredRows cover {self.rows} rows"
                             + (f" of sequences of {self.seq_len}" if shift else "")
                             + f"; the call's hidden states have rows {tuple(token_rows)} (pass seq_len= to "
                               "headloss.scored_rows where completion ids are one shorter than the sequences)")

    def index(self) -> torch.Tensor | None:
        """The scored rows (int64, ascending), or None where every row is scored. Waits for the count's copy
        only (the event queued after it, and so after the rows' order), not for the stream. A call on another
        stream than the handle's keeps the order's memory until its kernels have read it (record_stream)."""
        if self._event is not None:
            self._event.synchronize()
            self._order.record_stream(torch.cuda.current_stream(self._order.device))
        n = self.rows - int(self._ignored)
        return None if n == self.rows else self._order[:n]


def scored_rows(targets: torch.Tensor, *, shift: bool = False, ignore_index: int = -100,
                seq_len: int | None = None) -> ScoredRows:
    """The rows a ``linear_head_loss`` call on ``targets`` scores (those whose target is not
    ``ignore_index``), queued now and read by the call given ``compact=`` the result, without a host sync.

    Args:
        targets: the integer targets the call will get (the same tensor, not written in place after this):
            [N] or [B, T] rows, or with ``shift`` labels [B, T] / completion ids [B, T - 1].
        shift, ignore_index: the call's (``ignore_index``: its spec's).
        seq_len: with ``shift``, the hidden states' T (default: the targets' own, i.e. labels [B, T]; give it
            where the targets are completion ids [B, T - 1]).
    """
    if not isinstance(targets, torch.Tensor) or targets.dtype not in INT_DTYPES:
        raise TypeError(f"targets: expected an integer torch.Tensor, got "
                        f"{targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__}")
    if is_dtensor(targets):
        raise TypeError("targets: scored_rows takes a plain tensor, got a DTensor (the call gathers DTensor "
                        "targets itself: pass compact=True)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    if shift:
        if targets.dim() != 2:
            raise ValueError(f"targets: shift=True takes [B, T] labels or [B, T - 1] completion ids, got shape "
                             f"{tuple(targets.shape)}")
        seq_len = targets.shape[1] if seq_len is None else seq_len
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or targets.shape[1] not in (seq_len, seq_len - 1):
            raise ValueError(f"seq_len: the targets' [B, T] or [B, T - 1] fits T = {seq_len!r} with targets "
                             f"{tuple(targets.shape)}")
        flat = pad_shifted(targets, seq_len, ignore_index).reshape(-1)  # (both read narrow ints as the call does)
    elif seq_len is not None:
        raise ValueError("seq_len: only with shift=True")
    else:
        flat = flat_targets(targets)
    ignored = (flat == ignore_index).to(torch.uint8)
    order = torch.sort(ignored, stable=True).indices  # the scored rows, ascending, first
    count = ignored.sum(dtype=torch.int64)  # (the scored rows: rows - this, on the host)
    event = None
    if count.is_cuda:  # the copy and the event on the targets' device's stream (not the current device's)
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        with torch.cuda.device(count.device):
            host.copy_(count, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(count.device))
        count = host
    return ScoredRows(targets, shift, ignore_index, seq_len if shift else None, flat.numel(), order, count, event)
