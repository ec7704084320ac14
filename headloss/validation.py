"""Checks of values, and where the device reports what it finds.

Checks that need only shapes, dtypes and devices run on the host, before anything is launched,
and raise naming the argument (headloss.inputs). Checks of device *values* (targets in range,
num_items_in_batch positive, sequence ids in range) run on the device in the call's first kernel
and never make the host wait by default:

* ``validate=True`` (default): on CPU tensors the error is raised in the call; on CUDA the device
  writes the verdict into pinned host memory (only when something is bad) and the next headloss
  call (or ``metrics_as_floats``, or :func:`check_pending`) raises it: no copy, event or wait per
  call, and it works inside captured CUDA graphs. Rows with a bad target come out NaN, never an
  out-of-bounds read.
* ``validate="sync"``: the call waits for the verdict (after launching its kernels, so the GPU
  keeps working) and raises in the call.
* ``validate=False`` (or ``HEADLOSS_VALIDATE=0``): no check.
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import Any, Literal, NamedTuple

import torch

from . import env
from .layouts import TEACHER_KEY, TEACHER_MARK, VERDICT
from .spec import LossSpec

Validate = bool | Literal["sync"] | None

MASS_TOLERANCE = 1e-3
"""How far from 1 a row of a teacher given as probabilities may sum (kernels.head.MASS_TOLERANCE)."""

NOT_BINARY = -(2**63)
"""The effective target of a token whose ``loss_mask`` is neither 0 nor 1: out of range for every
vocabulary, so the device check that finds bad targets finds it, and its error names loss_mask."""


PACKING_MARK = -(2**62)
"""Packed rows' first row gets an effective target below this when ``cu_seqlens`` is not
0 = c_0 <= ... <= c_S = N (:func:`packing_mark`): the device check of the targets finds it (whatever
the masks say: the policy inputs keep it), and the value says which offset is wrong."""

_OFFSET_BITS, _VALUE_BITS = 18, 21  # (2 + 18 + 21 + 21 = 62 bits below PACKING_MARK)


def _field(value: torch.Tensor, bits: int) -> torch.Tensor:
    """``value`` in a field of ``bits`` bits, 0 (unknown) where it does not fit in [1, 2**bits)."""
    return torch.where((value > 0) & (value < 2**bits), value, 0)


def packing_mark(cu: torch.Tensor, rows: int) -> torch.Tensor:
    """() int64: 0 when ``cu`` (int64 [S + 1]) is 0 = c_0 <= c_1 <= ... <= c_S = ``rows``, else
    PACKING_MARK minus a payload that names the first bad offset k: what is wrong there (c_0 is not 0,
    c_k < c_(k-1), or c_S is not ``rows``), then k, c_(k-1) and c_k, each where it fits its field
    (:func:`packing_error` reads it back). Device ops, no host read."""
    index = torch.arange(cu.numel(), device=cu.device)
    prev = torch.cat([cu[:1], cu[:-1]])
    start = (index == 0) & (cu != 0)
    falls = cu < prev
    end = (index == cu.numel() - 1) & (cu != rows)
    bad = start | falls | end
    k = bad.to(torch.int64).argmax()  # the first bad offset
    at_k = index == k  # (a mask, not an index: no data-dependent shape under torch.compile)
    kind = torch.where((start & at_k).any(), 1, torch.where((falls & at_k).any(), 2, 3))
    shift = 2 ** (_VALUE_BITS - 1)
    payload = (kind << 60) | (_field(k + 1, _OFFSET_BITS) << 2 * _VALUE_BITS) \
        | (_field((prev * at_k).sum() + shift, _VALUE_BITS) << _VALUE_BITS) \
        | _field((cu * at_k).sum() + shift, _VALUE_BITS)
    return torch.where(bad.any(), PACKING_MARK - payload, 0)


def packing_error(mark: int, rows: int) -> str:
    """The message of a :func:`packing_mark`: which offset of ``cu_seqlens`` is wrong, and how."""
    payload = PACKING_MARK - mark
    kind, k = payload >> 60, ((payload >> 2 * _VALUE_BITS) & (2**_OFFSET_BITS - 1)) - 1
    shift = 2 ** (_VALUE_BITS - 1)
    prev, value = ((payload >> at) & (2**_VALUE_BITS - 1) for at in (_VALUE_BITS, 0))

    def offset(i: int, v: int) -> str:
        return f"cu_seqlens[{i}] = {v - shift}" if v else f"cu_seqlens[{i}]"

    if kind == 1:
        found = f"{offset(0, value)}, not 0"
    elif k < 0:  # (an offset index past its field)
        found = f"the first wrong offset lies past cu_seqlens[{2**_OFFSET_BITS - 2}]"
    elif kind == 2:
        found = f"{offset(k, value)} < {offset(k - 1, prev)}"
    else:
        found = f"{offset(k, value)}, the last, is not {rows}"
    return f"cu_seqlens: offsets must be non-decreasing from 0 to the row count {rows}; {found}"


VALIDATE_MODES = ("async", "sync", "off")
"""What validation_mode returns (an op carries the index)."""


def validation_mode(validate: Validate) -> Literal["async", "sync", "off"]:
    """validate=None reads HEADLOSS_VALIDATE: 0 (off), sync, or anything else (on, asynchronous)."""
    if validate is None:
        return env.validate_default()
    if validate == "sync":
        return "sync"
    if isinstance(validate, bool):
        return "async" if validate else "off"
    raise ValueError(f"validate: expected True, False or 'sync', got {validate!r}")


class Normaliser(NamedTuple):
    """num_items_in_batch as the kernels take it: a number (``value``) or a device tensor."""

    value: float = 0.0  # 0: not given
    tensor: torch.Tensor | None = None  # (1,) on the logits' device

    @property
    def given(self) -> bool:
        return self.value > 0 or self.tensor is not None

    def as_torch(self) -> float | torch.Tensor | None:
        return self.tensor if self.tensor is not None else (self.value if self.value > 0 else None)


def normaliser(num_items: Any, spec: LossSpec, device: torch.device) -> Normaliser:
    """Check num_items_in_batch: a positive finite number or a one-element tensor (its value is
    checked on the device when it lives there)."""
    if num_items is None:
        return Normaliser()
    if spec.reduction != "mean":
        raise ValueError(f"num_items_in_batch: only valid with reduction='mean', spec has reduction={spec.reduction!r}")
    value = count_value(num_items, "num_items_in_batch", device)
    return Normaliser(tensor=value) if isinstance(value, torch.Tensor) else Normaliser(value=value)


def count_value(value: Any, name: str, device: torch.device) -> float | torch.Tensor:
    """A count given as a positive finite number or a one-element real tensor: the float, or the
    tensor as (1,) where it lives on ``device`` (CUDA: its value is not read on the host, the caller
    checks it on the device or trusts it) or under torch.compile (moved there)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected one element, got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name}: expected a real number, got a {value.dtype} tensor")
        if value.device == device and device.type != "cpu":
            return value.reshape(1)
        if torch.compiler.is_compiling():
            return value.reshape(1).to(device)
        value = value.item()  # a CPU tensor: reading it costs no device wait
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected a positive number or tensor, got {value!r}")
    number = float(value)
    if not (number > 0 and number != float("inf")):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return number


class CheckContext(NamedTuple):
    """What a verdict's error message needs to know about the call that produced it (no tensors: a
    board keeps it, and a call captured in a CUDA graph must keep none of the graph's memory alive;
    a num_items_in_batch tensor's value comes back in the verdict)."""

    token_shape: tuple[int, ...]
    vocab: int
    ignore_index: int
    teacher_k: int = 0  # a top-k teacher's K (its entries' rows), -1 a per-token teacher, 0 none
    teacher_input: str = "teacher_logprobs"  # the input a bad log-prob came from (teacher_probs: their log)
    selected_k: int = 0  # the selected ids per row (outputs: selected_logprobs), 0 none

    @classmethod
    def of(cls, token_shape: tuple[int, ...], vocab: int, ignore_index: int, sparse: Any = None) -> CheckContext:
        """The context of a call whose sparse teacher is ``sparse`` (kernels.sparse.SparseRows, or None)."""
        if sparse is None:
            return cls(token_shape, vocab, ignore_index)
        return cls(token_shape, vocab, ignore_index, sparse.K if sparse.ids is not None else -1,
                   "teacher_probs" if sparse.probs is not None else "teacher_logprobs")


class ErrorBoard:
    """Verdict slots in host memory that the prepare kernel writes through unified addressing, and
    only when something is bad: no copy, no event and no wait per call. A ring of SLOTS slots (a
    call takes the next one) plus a ``dirty`` word set after any slot is written, so checking is one
    host memory read. Calls captured in a CUDA graph get slots of their own (replays write there)."""

    SLOTS = 256
    CAPTURE_RESERVE = 64

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        # rows padded to 16 bytes: every slot has the alignment Triton specialises the kernels on
        self.width = width = VERDICT.N + (-VERDICT.N) % 2
        self.table = torch.zeros(self.SLOTS + 1, width, dtype=torch.int64, pin_memory=pinned)
        self.host = self.table.numpy()  # reads and writes of host memory without a torch op
        self.rows = list(self.table[:, :VERDICT.N].unbind(0))
        self.dirty = self.rows[self.SLOTS][:1]
        self.contexts: list[CheckContext | None] = [None] * self.SLOTS
        self.order = [0] * self.SLOTS
        self.calls = 0
        self.captured: list[tuple[torch.Tensor, CheckContext]] = []
        self.spare: list[torch.Tensor] = []  # slots for captured calls, allocated before any capture
        self._reserve()

    def _reserve(self) -> None:
        """Keep slots ready for calls captured in CUDA graphs (each keeps its own: replays write there).
        They are allocated outside capture: pinned memory allocated during a capture can invalidate
        it (the host allocator queries CUDA events to reuse a cached block, which a capture forbids)."""
        if self.pinned and len(self.spare) < self.CAPTURE_RESERVE // 2:
            block = torch.zeros(self.CAPTURE_RESERVE, self.width, dtype=torch.int64, pin_memory=True)
            self.spare.extend(row[:VERDICT.N] for row in block.unbind(0))

    def take(self, context: CheckContext) -> tuple[torch.Tensor, torch.Tensor]:
        """A cleared slot for one call (and the dirty word)."""
        if self.pinned and torch.cuda.is_current_stream_capturing():
            # a reserved slot; past CAPTURE_RESERVE / 2 captures without an uncaptured call in between,
            # one allocated here (a capture that forbids it fails with CUDA's error)
            slot = self.spare.pop() if self.spare else torch.zeros(VERDICT.N, dtype=torch.int64, pin_memory=True)
            self.captured.append((slot, context))
            return slot, self.dirty
        self._reserve()
        i = self.calls % self.SLOTS
        self.calls += 1
        self.host[i, VERDICT.flag] = 0  # the kernel writes every other field before it sets the flag
        self.contexts[i] = context
        self.order[i] = self.calls
        return self.rows[i], self.dirty

    def raise_slot(self, slot: torch.Tensor, deferred: bool) -> None:
        """Raise the error of one slot (if its verdict is set), then clear it."""
        values = slot.numpy()
        if not values[VERDICT.flag]:
            return
        context = self._context_of(slot)
        found = [int(values[i]) for i in (VERDICT.where, VERDICT.value, VERDICT.bad_items, VERDICT.bad_ids)]
        items = struct.unpack("<f", struct.pack("<I", int(values[VERDICT.items]) & 0xFFFFFFFF))[0]
        teacher = int(values[VERDICT.teacher])
        hot = int(values[VERDICT.temperature])
        heavy = int(values[VERDICT.weights])
        selected = int(values[VERDICT.selected])
        values[:] = 0
        if selected:
            raise_selected(TEACHER_MARK - selected, context, deferred)
        if hot:
            raise_row_input("temperature", hot - 1, context.token_shape, deferred)
        if heavy:
            raise_row_input("token_weights", heavy - 1, context.token_shape, deferred)
        if teacher:  # (its own verdict: the target fields may be unwritten)
            raise_teacher(TEACHER_MARK - teacher, context, deferred)
        raise_if_bad(found, context.token_shape, context.vocab, context.ignore_index, Normaliser(value=items),
                     deferred)

    def check(self) -> None:
        """Raise the earliest error any call has written so far (a host memory read when none)."""
        if not self.host[self.SLOTS, VERDICT.flag]:
            return
        self.host[self.SLOTS, VERDICT.flag] = 0
        written = [i for i in range(self.SLOTS) if self.host[i, VERDICT.flag]]
        for i in sorted(written, key=self.order.__getitem__):
            self.raise_slot(self.rows[i], deferred=True)
        for slot, _ in self.captured:
            self.raise_slot(slot, deferred=True)

    def _context_of(self, slot: torch.Tensor) -> CheckContext:
        for i, row in enumerate(self.rows[: self.SLOTS]):
            if row.data_ptr() == slot.data_ptr():
                return self.contexts[i]
        return next(context for captured, context in self.captured if captured.data_ptr() == slot.data_ptr())


_BOARDS: dict[bool, ErrorBoard] = {}  # (two at most: pinned for CUDA, plain for the CPU)


def board_for(device: torch.device) -> ErrorBoard:
    """The board verdicts of ``device`` go to: pinned memory for CUDA, plain memory for the CPU."""
    pinned = device.type == "cuda"
    board = _BOARDS.get(pinned)
    if board is None:
        board = _BOARDS[pinned] = ErrorBoard(pinned)
    return board


def check_pending(wait: bool = False) -> None:
    """Raise the first error found on the device by an earlier call (targets out of range,
    num_items_in_batch not positive, sequence ids out of range). Without ``wait`` this reads host
    memory only, never making the host wait; ``wait=True`` first waits for the device."""
    if wait and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    for board in _BOARDS.values():
        board.check()


def verdict_slot(mode: str, device: torch.device, context: CheckContext) -> tuple | None:
    """(slot, dirty) for the prepare kernel, or None when validation is off."""
    if mode == "off":
        return None
    return board_for(device).take(context)


def settle(verdict: tuple | None, mode: str, device: torch.device) -> None:
    """After a call's kernels are launched: on CPU the verdict is there already, and "sync" waits
    for it; both raise in the call. Otherwise a later check (the next call) reads it."""
    if verdict is None:
        return
    if device.type == "cuda":
        if mode != "sync" or torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.current_stream(device).synchronize()
    board_for(device).raise_slot(verdict[0], deferred=False)


def _later(deferred: bool) -> str:
    """What an error found on the device after its call returned adds to its message."""
    return (" (found on the device after that call returned: validate='sync' raises inside the call, "
            "validate=False skips the check)") if deferred else ""


def _position(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index into ``shape`` of a flat position (itself when there is no shape)."""
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else (flat,)


class RowInputRule(NamedTuple):
    """What a per-row float input's values must be: the rule of the host-side check (the reference, policy_loss)
    and of the error both paths raise (the kernels' prepare step checks the same on the device)."""

    noun: str  # the value, as a device-side assert names it
    requirement: str
    ok: Any  # values -> where each one meets the requirement


ROW_INPUT_RULES = {
    "temperature": RowInputRule("a temperature", "a positive finite number",
                                lambda t: (t > 0) & torch.isfinite(t)),
    "token_weights": RowInputRule("a token weight", "a finite number >= 0", lambda w: (w >= 0) & torch.isfinite(w)),
}


def raise_row_input(name: str, first: int, token_shape: tuple[int, ...], deferred: bool = False) -> None:
    """The error of per-row input ``name``'s first value (flat index ``first``) that breaks its rule."""
    raise ValueError(f"{name}: the value at position {_position(first, token_shape)} is not "
                     f"{ROW_INPUT_RULES[name].requirement}{_later(deferred)}")


def check_row_input(name: str, values: torch.Tensor, token_shape: tuple[int, ...]) -> None:
    """Per-row input ``name``'s values (one per position of ``token_shape``) read on the host, the first
    that breaks its rule named as the kernels' verdict names it; under torch.compile a device-side assert."""
    rule = ROW_INPUT_RULES[name]
    bad = ~rule.ok(values).reshape(-1)
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"headloss: {rule.noun} that is not {rule.requirement}")
        return
    if bool(bad.any()):
        raise_row_input(name, int(bad.nonzero()[0, 0]), token_shape)


def check_selected_given(spec: LossSpec, given: bool) -> None:
    """A call gives selected ids exactly when its spec's outputs list selected_logprobs (both paths' check)."""
    asked = "selected_logprobs" in spec.outputs
    if asked and not given:
        raise ValueError("selected_ids: required by outputs: selected_logprobs but not given")
    if given and not asked:
        raise ValueError("selected_ids: given, but the spec's outputs do not list selected_logprobs")


def raise_selected(index: int, context: CheckContext, deferred: bool = False, entry_id: int | None = None) -> None:
    """The error of the selected ids' first bad entry (flat ``index`` into [n_out, K]; ``entry_id``: its id,
    where the host knows it)."""
    row, entry = divmod(index, max(context.selected_k, 1))
    shown = "" if entry_id is None else f" {entry_id}"
    raise ValueError(f"selected_ids: the id{shown} at position {_position(row, context.token_shape)}, entry {entry} "
                     f"is outside [0, {context.vocab}) (-1 marks no entry){_later(deferred)}")


def raise_teacher(key: int, context: CheckContext, deferred: bool = False, entry_id: int | None = None) -> None:
    """The error of a sparse teacher's first bad entry (kernels.sparse.check_teacher_kernel's key:
    layouts.TeacherKeys.N x its flat index + its kind); ``entry_id``: its id, where the host knows it."""
    later = _later(deferred)
    index, kind = divmod(key, TEACHER_KEY.N)
    if context.teacher_k > 0:
        row, entry = divmod(index, context.teacher_k)
        where = f"row {row}, entry {entry}"
    else:
        where = f"position {_position(index, context.token_shape)}"
    shown = "" if entry_id is None else f" {entry_id}"
    if kind == TEACHER_KEY.mass:
        raise ValueError(f"teacher_probs: the row at {where} does not sum to 1 within {MASS_TOLERANCE:g}, or holds a "
                         f"negative or NaN probability{later}")
    if kind == TEACHER_KEY.logprob and context.teacher_input == "teacher_probs":
        raise ValueError(f"teacher_probs: the value at {where} is not a probability (in [0, 1] within "
                         f"{MASS_TOLERANCE:g}, not NaN){later}")
    if kind == TEACHER_KEY.logprob:
        raise ValueError(f"teacher_logprobs: the value at {where} is not a log-probability (<= 0, not NaN){later}")
    if kind == TEACHER_KEY.repeat:
        raise ValueError(f"teacher_ids: the id{shown} at {where} repeats an earlier entry of the row (each id once "
                         f"per row; an entry with id -1 or log-prob -inf is no entry){later}")
    raise ValueError(f"teacher_ids: the id{shown} at {where} is outside [0, {context.vocab}) (-1 marks no "
                     f"entry){later}")


def raise_if_bad(values: list[int], targets_shape: tuple[int, ...], vocab: int, ignore_index: int,
                 norm: Normaliser, deferred: bool = False) -> None:
    """values = [first bad target index or -1, its value, bad num_items flag, bad sequence id flag]."""
    where, value, bad_items, bad_ids = values
    later = _later(deferred)
    if where >= 0:
        position = _position(where, targets_shape)
        if NOT_BINARY < value <= PACKING_MARK:
            raise ValueError(packing_error(value, math.prod(targets_shape)) + later)
        if value == NOT_BINARY:
            raise ValueError(f"loss_mask: the value at position {position} is neither 0 nor 1 (the mask says which "
                             f"tokens count; a token's weight goes in importance_weights){later}")
        raise ValueError(
            f"targets: value {value} at position {position} is outside [0, {vocab}) and is not "
            f"ignore_index={ignore_index}{later}"
        )
    if bad_items:
        got = norm.tensor.item() if norm.tensor is not None else norm.value
        raise ValueError(f"num_items_in_batch: expected a positive finite number, got {got}{later}")
    if bad_ids:
        raise ValueError(f"sequence_ids: values must lie in [0, {math.prod(targets_shape)}){later}")
