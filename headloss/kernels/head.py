"""The head kernels and their launchers.

``head_forward_kernel``  one program per row: phase 1 (stats), phase 2 (per-token values,
                         gradient coefficients), and in fused mode phase 3 (gradient).
                         Traffic per row: V reads, plus V reads + V writes when fused.
``head_backward_kernel`` deferred mode: phase 2 from saved lse/entropy and the upstream
                         per-token gradients, then phase 3. Traffic: V reads + V writes.
``scale_grad_kernel``    multiplies a precomputed gradient by d loss in backward; a no-op
                         (no traffic) when d loss == 1, decided on the device, no host sync.

Rows are addressed as ``(row // T) * stride_b + (row % T) * stride_t`` so [B, T, V] views with
any row strides (e.g. ``logits[:, :-1]``) run without a copy. Offsets are int64: N * V may
exceed 2**31. The grid is (N,) on axis 0, which holds up to 2**31 - 1 rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..plan import KernelPlan
from .blocks import LN2, gradient_pass, online_stats, row_coefficients, target_logit, zero_row


@triton.jit
def head_forward_kernel(
    # pointers
    logits_ptr,  # (N, V) addressed through (stride_b, stride_t)
    targets_ptr,  # (N,) int
    grad_ptr,  # (N, V) gradient out, may alias logits; unused unless FUSED_GRAD
    grad_scale_ptr,  # (1,) fp32: d loss / d token_loss (1 / denominator for mean)
    token_loss_ptr,  # (N,) fp32 combined per-token loss
    lse_ptr,  # (N,) fp32
    ce_ptr,  # (N,) fp32, HAS_CE
    entropy_ptr,  # (N,) fp32, HAS_ENTROPY
    logp_ptr,  # (N,) fp32, STORE_LOGP
    pred_ptr,  # (N,) int64, HAS_ARGMAX; -1 at ignored rows
    # sizes
    V,
    T,
    # strides
    stride_b,
    stride_t,
    grad_stride_b,
    grad_stride_t,
    # scalars
    ignore_index,
    w_ce,
    smoothing,
    w_z,
    w_entropy,
    logit_scale,
    softcap,
    inv_temperature,
    # meta
    BLOCK_V: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_CE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    HAS_ARGMAX: tl.constexpr,
    STORE_LOGP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FUSED_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
    grad_row_ptr = grad_ptr + (row // T) * grad_stride_b + (row % T) * grad_stride_t
    y = tl.full([], -1, tl.int64)
    valid = True
    if HAS_TARGETS:
        y = tl.load(targets_ptr + row).to(tl.int64)
        valid = y != ignore_index
    # an entropy without gradient is summed in the gradient pass when there is one
    ENTROPY_IN_PASS_1: tl.constexpr = HAS_ENTROPY and (HAS_ENTROPY_GRAD or not FUSED_GRAD)
    ENTROPY_IN_PASS_3: tl.constexpr = HAS_ENTROPY and not ENTROPY_IN_PASS_1
    if valid:
        # --- 1. stats pass
        m2, d, sum_x2, sum_ex2, arg = online_stats(
            row_ptr, V, logit_scale, softcap, inv_temperature,
            BLOCK_V, HAS_SOFTCAP, HAS_SMOOTHING, ENTROPY_IN_PASS_1, HAS_ARGMAX,
        )
        # --- 2. per-token values (natural units from here on)
        lse2 = m2 + tl.log2(d)
        lse = lse2 * LN2
        token_loss = tl.zeros([], tl.float32)
        entropy = tl.zeros([], tl.float32)
        x2_y = tl.zeros([], tl.float32)
        slope_y = tl.zeros([], tl.float32)
        if HAS_TARGETS:
            # out-of-range targets (validation off) give NaN, never an out-of-bounds read
            x2_y, slope_y = target_logit(row_ptr, y, V, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        if STORE_LOGP:
            tl.store(logp_ptr + row, (x2_y - lse2) * LN2)
        if HAS_CE:
            ce = lse - x2_y * LN2
            if HAS_SMOOTHING:
                ce = (1.0 - smoothing) * ce + smoothing * (lse - sum_x2 * LN2 / V)
            tl.store(ce_ptr + row, ce)
            token_loss += w_ce * ce
        if HAS_Z:
            token_loss += w_z * lse * lse
        if ENTROPY_IN_PASS_1:
            entropy = lse - sum_ex2 * LN2 / d
            tl.store(entropy_ptr + row, entropy)
            token_loss += w_entropy * entropy
        if HAS_ARGMAX:
            tl.store(pred_ptr + row, arg.to(tl.int64))
        tl.store(lse_ptr + row, lse)
        tl.store(token_loss_ptr + row, token_loss)
        # --- 3. gradient pass (fused mode)
        if FUSED_GRAD:
            u = tl.load(grad_scale_ptr)
            zero = tl.zeros([], tl.float32)
            A, B, C, D = row_coefficients(
                u, zero, zero, zero, lse, entropy, V, w_ce, smoothing, w_z, w_entropy,
                HAS_CE, HAS_Z, HAS_ENTROPY_GRAD,
            )
            sum_px2 = gradient_pass(
                row_ptr, grad_row_ptr, V, y, x2_y, slope_y, lse, A, B, C, D,
                logit_scale, softcap, inv_temperature,
                BLOCK_V, HAS_SOFTCAP, HAS_ENTROPY_GRAD, HAS_SMOOTHING, ENTROPY_IN_PASS_3,
            )
            if ENTROPY_IN_PASS_3:
                tl.store(entropy_ptr + row, sum_px2 * LN2)
    else:
        tl.store(token_loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if HAS_CE:
            tl.store(ce_ptr + row, 0.0)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
        if STORE_LOGP:
            tl.store(logp_ptr + row, 0.0)
        if HAS_ARGMAX:
            tl.store(pred_ptr + row, -1)
        if FUSED_GRAD:
            zero_row(grad_row_ptr, V, BLOCK_V)


@triton.jit
def head_backward_kernel(
    # pointers
    logits_ptr,  # (N, V) addressed through (stride_b, stride_t)
    targets_ptr,  # (N,) int
    grad_ptr,  # (N, V) gradient out, may alias logits
    lse_ptr,  # (N,) fp32 saved by the forward
    entropy_ptr,  # (N,) fp32 saved by the forward, HAS_ENTROPY_GRAD
    d_token_ptr,  # (N,) or (1,) fp32: d loss / d token_loss, row stride d_token_stride
    d_logp_ptr,  # (N,) fp32, HAS_D_LOGP
    d_entropy_ptr,  # (N,) fp32, HAS_D_ENTROPY
    d_lse_ptr,  # (N,) fp32, HAS_D_LSE
    # sizes
    V,
    T,
    # strides
    stride_b,
    stride_t,
    grad_stride_b,
    grad_stride_t,
    d_token_stride,
    # scalars
    ignore_index,
    w_ce,
    smoothing,
    w_z,
    w_entropy,
    logit_scale,
    softcap,
    inv_temperature,
    # meta
    BLOCK_V: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_CE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_D_LOGP: tl.constexpr,
    HAS_D_ENTROPY: tl.constexpr,
    HAS_D_LSE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
    grad_row_ptr = grad_ptr + (row // T) * grad_stride_b + (row % T) * grad_stride_t
    y = tl.full([], -1, tl.int64)
    valid = True
    if HAS_TARGETS:
        y = tl.load(targets_ptr + row).to(tl.int64)
        valid = y != ignore_index
    if valid:
        zero = tl.zeros([], tl.float32)
        u = tl.load(d_token_ptr + row * d_token_stride)
        lse = tl.load(lse_ptr + row)
        entropy = zero
        d_logp = zero
        d_entropy = zero
        d_lse = zero
        if HAS_ENTROPY_GRAD:
            entropy = tl.load(entropy_ptr + row)
        if HAS_D_LOGP:
            d_logp = tl.load(d_logp_ptr + row)
        if HAS_D_ENTROPY:
            d_entropy = tl.load(d_entropy_ptr + row)
        if HAS_D_LSE:
            d_lse = tl.load(d_lse_ptr + row)
        x2_y = tl.zeros([], tl.float32)
        slope_y = tl.zeros([], tl.float32)
        if HAS_TARGETS:
            x2_y, slope_y = target_logit(row_ptr, y, V, logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
        A, B, C, D = row_coefficients(
            u, d_logp, d_entropy, d_lse, lse, entropy, V, w_ce, smoothing, w_z, w_entropy,
            HAS_CE, HAS_Z, HAS_ENTROPY_GRAD,
        )
        gradient_pass(
            row_ptr, grad_row_ptr, V, y, x2_y, slope_y, lse, A, B, C, D,
            logit_scale, softcap, inv_temperature,
            BLOCK_V, HAS_SOFTCAP, HAS_ENTROPY_GRAD, HAS_SMOOTHING, False,
        )
    else:
        zero_row(grad_row_ptr, V, BLOCK_V)


@triton.jit
def scale_grad_kernel(
    grad_ptr,  # (N, V) addressed through (stride_b, stride_t)
    scale_ptr,  # (1,) the upstream d loss
    V,
    T,
    stride_b,
    stride_t,
    BLOCK_V: tl.constexpr,
):
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        row = tl.program_id(0).to(tl.int64)
        row_ptr = grad_ptr + (row // T) * stride_b + (row % T) * stride_t
        offs = tl.arange(0, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            g = tl.load(row_ptr + cols, mask=mask).to(tl.float32)
            tl.store(row_ptr + cols, (g * scale).to(grad_ptr.dtype.element_ty), mask=mask)


# --- launchers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    block_v: int
    num_warps: int


def launch_config(vocab: int) -> LaunchConfig:
    """Block and warps for a row of ``vocab`` logits.

    2048 columns x 4 warps (16 per thread) was fastest on an H200 at V=128256 for every spec
    (benchmarks/profile_head.py --ablate, bench_head.py --tune): small enough per-thread state
    for high occupancy, which this latency-bound loop needs. HEADLOSS_BLOCK_V /
    HEADLOSS_NUM_WARPS override it (used by those sweeps).
    """
    block = min(triton.next_power_of_2(max(vocab, 16)), 2048)
    warps = 4 if block >= 1024 else (2 if block >= 256 else 1)
    block = int(os.environ.get("HEADLOSS_BLOCK_V", block))
    warps = int(os.environ.get("HEADLOSS_NUM_WARPS", warps))
    return LaunchConfig(block_v=block, num_warps=warps)


@dataclass
class RowStats:
    """Per-row fp32/int64 buffers written by the forward kernel (None when not computed)."""

    token_loss: torch.Tensor
    lse: torch.Tensor
    ce: torch.Tensor | None
    entropy: torch.Tensor | None
    logp: torch.Tensor | None
    pred: torch.Tensor | None

    @classmethod
    def empty(cls, rows: int, plan: KernelPlan, device: torch.device) -> RowStats:
        flags = plan.flags
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            token_loss=torch.empty(rows, **f32),
            lse=torch.empty(rows, **f32),
            ce=torch.empty(rows, **f32) if flags.HAS_CE else None,
            entropy=torch.empty(rows, **f32) if flags.HAS_ENTROPY else None,
            logp=torch.empty(rows, **f32) if flags.STORE_LOGP else None,
            pred=torch.empty(rows, dtype=torch.int64, device=device) if flags.HAS_ARGMAX else None,
        )

    def rows(self, start: int, stop: int) -> RowStats:
        """Views of rows [start, stop) of every buffer (for a chunk of a longer batch)."""
        return RowStats(*(t[start:stop] if t is not None else None for t in self.fields()))

    def fields(self) -> tuple[torch.Tensor | None, ...]:
        return (self.token_loss, self.lse, self.ce, self.entropy, self.logp, self.pred)


def row_geometry(logits: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, T, stride_b, stride_t) of a [N, V] or [B, T, V] tensor whose last stride is 1."""
    if logits.dim() == 2:
        return logits.shape[0], max(logits.shape[0], 1), 0, logits.stride(0)
    batch, seq = logits.shape[0], logits.shape[1]
    return batch * seq, max(seq, 1), logits.stride(0), logits.stride(1)


def _scalar_args(plan: KernelPlan) -> tuple:
    s = plan.scalars
    return (
        s.ignore_index, s.w_ce, s.smoothing, s.w_z, s.w_entropy,
        s.logit_scale, s.softcap, s.inv_temperature,
    )


def run_forward(
    plan: KernelPlan,
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    grad: torch.Tensor | None,
    grad_scale: torch.Tensor,
    out: RowStats | None = None,
) -> RowStats:
    """Launch the forward kernel; writes ``grad`` too when the plan is fused and grad is given.

    Per-row results go to ``out`` (contiguous views, e.g. a chunk of longer buffers) or to new
    buffers.
    """
    rows, seq, stride_b, stride_t = row_geometry(logits)
    vocab = logits.shape[-1]
    flags = plan.flags
    stats = out if out is not None else RowStats.empty(rows, plan, logits.device)
    if rows == 0:
        return stats
    fused = flags.FUSED_GRAD and grad is not None
    _, _, grad_stride_b, grad_stride_t = row_geometry(grad) if fused else (0, 0, 0, 0)
    cfg = launch_config(vocab)
    placeholder = stats.token_loss
    head_forward_kernel[(rows,)](
        logits,
        targets if targets is not None else placeholder,
        grad if fused else placeholder,
        grad_scale,
        stats.token_loss,
        stats.lse,
        stats.ce if stats.ce is not None else placeholder,
        stats.entropy if stats.entropy is not None else placeholder,
        stats.logp if stats.logp is not None else placeholder,
        stats.pred if stats.pred is not None else placeholder,
        vocab, seq,
        stride_b, stride_t, grad_stride_b, grad_stride_t,
        *_scalar_args(plan),
        BLOCK_V=cfg.block_v,
        num_warps=cfg.num_warps,
        **{**flags.as_kwargs(), "FUSED_GRAD": fused},
    )
    return stats


def run_backward(
    plan: KernelPlan,
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    grad: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    d_token: torch.Tensor,
    d_logp: torch.Tensor | None,
    d_entropy: torch.Tensor | None,
    d_lse: torch.Tensor | None,
) -> None:
    """Deferred mode: write d loss / d logits into ``grad`` from saved stats and upstream grads."""
    rows, seq, stride_b, stride_t = row_geometry(logits)
    if rows == 0:
        return
    _, _, grad_stride_b, grad_stride_t = row_geometry(grad)
    vocab = logits.shape[-1]
    flags = plan.flags
    cfg = launch_config(vocab)
    head_backward_kernel[(rows,)](
        logits,
        targets if targets is not None else lse,
        grad,
        lse,
        entropy if entropy is not None else lse,
        d_token,
        d_logp if d_logp is not None else lse,
        d_entropy if d_entropy is not None else lse,
        d_lse if d_lse is not None else lse,
        vocab, seq,
        stride_b, stride_t, grad_stride_b, grad_stride_t,
        0 if d_token.numel() == 1 else 1,
        *_scalar_args(plan),
        BLOCK_V=cfg.block_v,
        HAS_TARGETS=flags.HAS_TARGETS,
        HAS_CE=flags.HAS_CE,
        HAS_SMOOTHING=flags.HAS_SMOOTHING,
        HAS_Z=flags.HAS_Z,
        HAS_ENTROPY_GRAD=flags.HAS_ENTROPY_GRAD,
        HAS_SOFTCAP=flags.HAS_SOFTCAP,
        HAS_D_LOGP=d_logp is not None,
        HAS_D_ENTROPY=d_entropy is not None,
        HAS_D_LSE=d_lse is not None,
        num_warps=cfg.num_warps,
    )


def scale_grad_(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad *= scale in place, skipped on the device when scale == 1 (no host sync)."""
    rows, seq, stride_b, stride_t = row_geometry(grad)
    if rows > 0:
        cfg = launch_config(grad.shape[-1])
        scale_grad_kernel[(rows,)](
            grad, scale.reshape(1), grad.shape[-1], seq, stride_b, stride_t,
            BLOCK_V=cfg.block_v, num_warps=cfg.num_warps,
        )
    return grad
