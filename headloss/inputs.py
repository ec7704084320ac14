"""Every per-call check and flattening, for the logits and the hidden-state entry points alike.

Checks that need only shapes, dtypes and devices run on the host, before anything is launched,
and raise naming the argument. Checks of device *values* (targets in range, num_items_in_batch
positive) run on the device in the call's first kernel and never make the host wait by default:

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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

from .kernels.head import VERDICT, Geometry, row_strides
from .plan import KernelPlan, compile_plan
from .policy import policy_inputs
from .spec import FIELD_NAMES, LossSpec

Backend = Literal["auto", "triton", "reference"]
SpecLike = LossSpec | dict[str, Any] | str | Path
Validate = bool | Literal["sync"] | None

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


# --- spec, backend, validation mode ------------------------------------------------------------


def _frozen(value: Any) -> Any:
    """A spec given as data, with every number made a Python constant (so torch.compile
    specialises on it instead of tracing it symbolically) and dicts made hashable."""
    if isinstance(value, dict):
        return tuple((str(k), _frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ("__list__", *(_frozen(v) for v in value))
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, tuple) and value and value[0] == "__list__":
        return [_thawed(v) for v in value[1:]]
    if isinstance(value, tuple):
        return {k: _thawed(v) for k, v in value}
    return value


@torch.compiler.assume_constant_result
def _plan_of_data(frozen: Any, has_targets: bool) -> KernelPlan:
    data = _thawed(frozen)
    spec = LossSpec.from_file(data) if isinstance(data, str) else LossSpec.model_validate(data)
    return compile_plan(spec, has_targets=has_targets)


def _spec_data(model: Any) -> Any:
    """A LossSpec as plain data through attribute reads only (which torch.compile can trace and
    guard on), without pydantic's serializer (which it cannot trace)."""
    names = FIELD_NAMES.get(type(model))
    if names is not None:
        return {name: _spec_data(getattr(model, name)) for name in names}
    if isinstance(model, tuple):
        return list(model)
    return model


def as_spec(spec: SpecLike | None) -> LossSpec:
    """Accept a LossSpec, a dict, or a YAML/JSON path (None: mean cross-entropy)."""
    return LossSpec() if spec is None else LossSpec.coerce(spec)


_DEFAULT_SPEC = LossSpec()
_PLANS_BY_ID: dict[tuple[int, bool], tuple[LossSpec, KernelPlan]] = {}
_PLANS_BY_DATA: dict[tuple[str, bool], KernelPlan] = {}


def plan_for(spec: SpecLike | None, has_targets: bool) -> KernelPlan:
    """The cached plan of a spec given in any form; a spec object seen before costs a dict lookup
    (no pydantic hashing or validation per call). Under torch.compile the spec is read once, at
    trace time, and the plan is a constant of the graph (a dict or a path never breaks it)."""
    if spec is None:
        spec = _DEFAULT_SPEC
    if isinstance(spec, LossSpec):
        if torch.compiler.is_compiling():
            return _plan_of_data(_frozen(_spec_data(spec)), has_targets)
        hit = _PLANS_BY_ID.get((id(spec), has_targets))
        if hit is not None and hit[0] is spec:
            return hit[1]
        plan = compile_plan(spec, has_targets=has_targets)
        if len(_PLANS_BY_ID) > 1024:
            _PLANS_BY_ID.clear()
        _PLANS_BY_ID[(id(spec), has_targets)] = (spec, plan)  # holds spec: its id is not reused meanwhile
        return plan
    if isinstance(spec, (dict, str, Path)):
        if torch.compiler.is_compiling():
            return _plan_of_data(_frozen(spec), has_targets)
        key = (repr(spec) if isinstance(spec, dict) else f"path:{spec}", has_targets)
        plan = _PLANS_BY_DATA.get(key) if isinstance(spec, dict) else None  # a file may change: read it again
        if plan is None:
            plan = compile_plan(LossSpec.coerce(spec), has_targets=has_targets)
            if isinstance(spec, dict):
                _PLANS_BY_DATA[key] = plan
        return plan
    raise TypeError(f"spec: expected LossSpec, dict or a path, got {type(spec).__name__}")


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, name: str = "logits") -> str:
    """'triton' or 'reference' for tensors on ``device`` of ``dtype``."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "reference":
        return backend
    on_kernel_device = device.type == "cuda" or _INTERPRETER
    if backend == "triton" and not on_kernel_device:
        raise ValueError("backend: 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    if not on_kernel_device:
        return "reference"
    if dtype not in KERNEL_DTYPES:
        if backend == "triton":
            raise TypeError(f"{name}: the Triton kernel takes float32, bfloat16 or float16, got {dtype}")
        return "reference"
    return "triton"


def validation_mode(validate: Validate) -> Literal["async", "sync", "off"]:
    """validate=None reads HEADLOSS_VALIDATE: 0 (off), sync, or anything else (on, asynchronous)."""
    if validate is None:
        env = os.environ.get("HEADLOSS_VALIDATE", "1").strip().lower()
        return "off" if env in ("0", "false", "off") else ("sync" if env == "sync" else "async")
    if validate == "sync":
        return "sync"
    if isinstance(validate, bool):
        return "async" if validate else "off"
    raise ValueError(f"validate: expected True, False or 'sync', got {validate!r}")


# --- tensors ----------------------------------------------------------------------------------


def check_logits(logits: Any) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating dtype (float32, bfloat16, float16), got {logits.dtype}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected [N, V] or [B, T, V], got shape {tuple(logits.shape)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits: the vocabulary dimension V is 0")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        raise ValueError(
            f"logits: the vocabulary dimension must have stride 1, got strides {logits.stride()}; "
            "pass logits.contiguous()"
        )


def check_targets(targets: Any, token_shape: tuple[int, ...], spec: LossSpec, device: torch.device,
                  shift: bool, source: str = "logits") -> None:
    """targets: an integer tensor shaped like the rows (or, with shift, one of the two conventions).
    A spec that needs targets has already failed without them, when its plan was made."""
    if targets is None:
        if shift:
            raise ValueError("targets: shift=True needs targets")
        return
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets: expected a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype not in INT_DTYPES:
        raise TypeError(f"targets: expected an integer dtype, got {targets.dtype}")
    if targets.device != device:
        raise ValueError(f"targets: on {targets.device}, {source} on {device}")
    if shift:
        if len(token_shape) != 2 or targets.dim() != 2:
            raise ValueError(
                f"shift: needs {source} [B, T, ...] and targets [B, T] or [B, T - 1]; got {source} rows "
                f"{tuple(token_shape)} and targets {tuple(targets.shape)}"
            )
        batch, seq = token_shape
        if targets.shape[0] != batch or targets.shape[1] not in (seq, seq - 1):
            raise ValueError(
                f"targets: shape {tuple(targets.shape)} fits neither shift convention for {source} rows "
                f"{tuple(token_shape)}: labels [B, T] = {(batch, seq)} (row t scores labels[:, t + 1]) or "
                f"completion ids [B, T - 1] = {(batch, seq - 1)} (row t scores ids[:, t])"
            )
    elif tuple(targets.shape) != tuple(token_shape):
        raise ValueError(
            f"targets: shape {tuple(targets.shape)} does not match {source} rows {tuple(token_shape)} "
            f"(expected {tuple(token_shape)}; shift=True scores next-token labels)"
        )


def check_teacher(logits_shape: tuple[int, ...], device: torch.device, teacher_logits: Any, spec: LossSpec,
                  kernel: bool) -> None:
    """teacher_logits must come with a distillation term, and look like the student's logits."""
    if spec.distillation is None:
        if teacher_logits is not None:
            raise ValueError("teacher_logits: given, but the spec has no distillation term")
        return
    if teacher_logits is None:
        raise ValueError("teacher_logits: required by distillation but not given")
    if not isinstance(teacher_logits, torch.Tensor) or not teacher_logits.is_floating_point():
        got = getattr(teacher_logits, "dtype", type(teacher_logits).__name__)
        raise TypeError(f"teacher_logits: expected a floating-point tensor, got {got}")
    if tuple(teacher_logits.shape) != tuple(logits_shape):
        raise ValueError(
            f"teacher_logits: shape {tuple(teacher_logits.shape)} does not match logits {tuple(logits_shape)}"
        )
    if teacher_logits.device != device:
        raise ValueError(f"teacher_logits: on {teacher_logits.device}, logits on {device}")
    if teacher_logits.stride(-1) != 1 and teacher_logits.shape[-1] > 1:
        raise ValueError("teacher_logits: the vocabulary dimension must have stride 1; pass .contiguous()")
    if kernel and teacher_logits.dtype not in KERNEL_DTYPES:
        raise TypeError(f"teacher_logits: the kernel takes float32, bfloat16 or float16, got {teacher_logits.dtype}")


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


def flat_targets(targets: torch.Tensor | None) -> torch.Tensor | None:
    """Targets as the kernels read them: a dense int32/int64 vector (narrow ints cannot hold
    ignore_index=-100: uint8 wraps it to 156)."""
    if targets is None:
        return None
    if targets.dtype not in (torch.int64, torch.int32):
        targets = targets.long()
    return targets.reshape(-1).contiguous()


# --- the logits entry point ------------------------------------------------------------------------


@dataclass
class HeadCall:
    """One head_loss call, checked and flattened: what the engine launches on."""

    logits: torch.Tensor  # [N, V] or [B, T, V], as given (strided rows allowed)
    targets: torch.Tensor | None  # flat [B * K (+ shift)] dense ints
    teacher: torch.Tensor | None  # like logits
    policy: Any  # headloss.policy.PolicyInputs or None
    norm: Normaliser
    geo: Geometry  # gradient strides for a fresh contiguous buffer (engine swaps them in place)
    token_shape: tuple[int, ...]  # shape of the per-token outputs: the targets' (or the rows')
    validate: str  # async, sync, off
    targets_shape: tuple[int, ...]  # for error messages


def geometry(logits_shape: tuple[int, ...], logits_strides: tuple[int, int], slots_per_seq: int, shift: int,
             teacher: torch.Tensor | None, ignore_index: int, norm: Normaliser) -> Geometry:
    """Sizes and strides of a [N, V] (one sequence) or [B, T, V] launch; the gradient buffer is a
    fresh contiguous tensor of the logits' shape."""
    vocab = logits_shape[-1]
    if len(logits_shape) == 2:
        batch, seq = 1, logits_shape[0]
    else:
        batch, seq = logits_shape[0], logits_shape[1]
    t_b, t_t = row_strides(teacher)
    return Geometry(
        n_rows=batch * seq, n_out=batch * slots_per_seq, V=vocab, T=seq, K=slots_per_seq,
        shift=shift, stride_b=logits_strides[0], stride_t=logits_strides[1],
        g_stride_b=seq * vocab if len(logits_shape) == 3 else 0, g_stride_t=vocab,
        t_stride_b=t_b, t_stride_t=t_t, ignore_index=ignore_index, norm=norm.value,
    )


def head_call(logits: Any, targets: Any, spec: LossSpec, *, kernel: bool, teacher_logits: Any, policy_given: dict,
              num_items_in_batch: Any, shift: bool, validate: Validate, policy_in_kernel: bool = False,
              policy_deferred_kernel: bool = False) -> HeadCall:
    """Check every input of head_loss and flatten it for the kernels; errors name the argument.
    ``policy_in_kernel`` / ``policy_deferred_kernel``: see policy.policy_inputs' ``in_kernel`` /
    ``deferred_kernel``."""
    check_logits(logits)
    token_rows = tuple(logits.shape[:-1])
    check_targets(targets, token_rows, spec, logits.device, shift)
    check_teacher(tuple(logits.shape), logits.device, teacher_logits, spec, kernel)
    norm = normaliser(num_items_in_batch, spec, logits.device)
    mode = validation_mode(validate)
    if shift:
        token_shape = tuple(targets.shape)
        shift_by = 1 if targets.shape[1] == logits.shape[1] else 0
    else:
        token_shape = token_rows
        shift_by = 0
    if spec.policy is not None and shift_by:
        # per-token policy inputs are row-aligned [B, T]: give the kernels row-aligned targets
        targets = pad_shifted(targets, logits.shape[1], spec.ignore_index)
        shift_by = 0
    policy, targets = policy_inputs(spec.policy, token_shape, targets, spec.ignore_index, norm.as_torch(),
                                    mode, policy_given, in_kernel=policy_in_kernel,
                                    deferred_kernel=policy_deferred_kernel)
    teacher = teacher_logits.detach() if teacher_logits is not None else None
    slots = token_shape[-1] if len(token_shape) == 2 else (token_shape[0] if token_shape else 0)
    geo = geometry(tuple(logits.shape), row_strides(logits), slots, shift_by, teacher, spec.ignore_index, norm)
    return HeadCall(
        logits=logits, targets=flat_targets(targets), teacher=teacher, policy=policy, norm=norm, geo=geo,
        token_shape=token_shape, validate=mode,
        targets_shape=tuple(targets.shape) if isinstance(targets, torch.Tensor) else (),
    )


# --- device-side verdicts -----------------------------------------------------------------------


class CheckContext(NamedTuple):
    """What a verdict's error message needs to know about the call that produced it."""

    token_shape: tuple[int, ...]
    vocab: int
    ignore_index: int
    norm: Normaliser


class ErrorBoard:
    """Verdict slots in host memory that the prepare kernel writes through unified addressing, and
    only when something is bad: no copy, no event and no wait per call. A ring of SLOTS slots (a
    call takes the next one) plus a ``dirty`` word set after any slot is written, so checking is one
    host memory read. Calls captured in a CUDA graph get slots of their own (replays write there)."""

    SLOTS = 256

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        # rows padded to 16 bytes: every slot has the alignment Triton specialises the kernels on
        width = VERDICT + (-VERDICT) % 2
        self.table = torch.zeros(self.SLOTS + 1, width, dtype=torch.int64, pin_memory=pinned)
        self.host = self.table.numpy()  # reads and writes of host memory without a torch op
        self.rows = list(self.table[:, :VERDICT].unbind(0))
        self.dirty = self.rows[self.SLOTS][:1]
        self.contexts: list[CheckContext | None] = [None] * self.SLOTS
        self.order = [0] * self.SLOTS
        self.calls = 0
        self.captured: list[tuple[torch.Tensor, CheckContext]] = []

    def take(self, context: CheckContext) -> tuple[torch.Tensor, torch.Tensor]:
        """A cleared slot for one call (and the dirty word)."""
        if self.pinned and torch.cuda.is_current_stream_capturing():
            slot = torch.zeros(VERDICT, dtype=torch.int64, pin_memory=self.pinned)
            self.captured.append((slot, context))
            return slot, self.dirty
        i = self.calls % self.SLOTS
        self.calls += 1
        self.host[i, 0] = 0  # the flag: the kernel writes every other field before it sets the flag
        self.contexts[i] = context
        self.order[i] = self.calls
        return self.rows[i], self.dirty

    def raise_slot(self, slot: torch.Tensor, deferred: bool) -> None:
        """Raise the error of one slot (if its verdict is set), then clear it."""
        values = slot.numpy()
        if not values[0]:
            return
        context = self._context_of(slot)
        found = [int(v) for v in values[1:]]
        values[:] = 0
        raise_if_bad(found, context.token_shape, context.vocab, context.ignore_index, context.norm, deferred)

    def check(self) -> None:
        """Raise the earliest error any call has written so far (a host memory read when none)."""
        if not self.host[self.SLOTS, 0]:
            return
        self.host[self.SLOTS, 0] = 0
        written = [i for i in range(self.SLOTS) if self.host[i, 0]]
        for i in sorted(written, key=self.order.__getitem__):
            self.raise_slot(self.rows[i], deferred=True)
        for slot, _ in self.captured:
            self.raise_slot(slot, deferred=True)

    def _context_of(self, slot: torch.Tensor) -> CheckContext:
        for i, row in enumerate(self.rows[: self.SLOTS]):
            if row.data_ptr() == slot.data_ptr():
                return self.contexts[i]
        return next(context for captured, context in self.captured if captured.data_ptr() == slot.data_ptr())


_BOARDS: dict[bool, ErrorBoard] = {}


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


def raise_if_bad(values: list[int], targets_shape: tuple[int, ...], vocab: int, ignore_index: int,
                 norm: Normaliser, deferred: bool = False) -> None:
    """values = [first bad target index or -1, its value, bad num_items flag, bad sequence id flag]."""
    where, value, bad_items, bad_ids = values
    later = (" (found on the device after that call returned: validate='sync' raises inside the call, "
             "validate=False skips the check)") if deferred else ""
    if where >= 0:
        position = tuple(int(i) for i in torch.unravel_index(torch.tensor(where), targets_shape)) \
            if targets_shape else (where,)
        raise ValueError(
            f"targets: value {value} at position {position} is outside [0, {vocab}) and is not "
            f"ignore_index={ignore_index}{later}"
        )
    if bad_items:
        got = norm.tensor.item() if norm.tensor is not None else norm.value
        raise ValueError(f"num_items_in_batch: expected a positive finite number, got {got}{later}")
    if bad_ids:
        raise ValueError(f"sequence_ids: values must lie in [0, {math.prod(targets_shape)}){later}")


def pad_shifted(targets: torch.Tensor, rows_per_seq: int, ignore_index: int) -> torch.Tensor:
    """Row-aligned targets [B, T] of a shifted call: labels [B, T] -> labels[:, 1:] + one ignored;
    completion ids [B, T - 1] -> ids + one ignored."""
    shift = 1 if targets.shape[1] == rows_per_seq else 0
    return F.pad(targets[:, shift:], (0, 1), value=ignore_index)
