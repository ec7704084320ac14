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

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..plan import KernelPlan
from ..policy import POLICY_ROW_FIELDS
from .blocks import LN2, gradient_pass, jsd_sums, online_stats, row_coefficients, target_logit, zero_row
from .policy import policy_token


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
    teacher_ptr,  # (N, V) teacher logits addressed through (t_stride_b, t_stride_t), HAS_TEACHER
    dstats_ptr,  # (N, 4) fp32: lse_s2, lse_t2, divergence, jsd_s (base-2 lse's), HAS_TEACHER
    t_entropy_ptr,  # (N,) fp32 teacher entropy at T_d, HAS_TEACHER
    t_pred_ptr,  # (N,) int64 teacher argmax, HAS_TEACHER
    old_ptr,  # (N,) fp32 rollout log-probs, HAS_OLD
    ref_ptr,  # (N,) fp32 reference log-probs, KL_EST > 0
    adv_ptr,  # (N,) fp32 advantages, HAS_POLICY
    iw_ptr,  # (N,) fp32 rollout importance weights, HAS_IW
    pw_ptr,  # (N,) fp32 policy aggregation weights (0 at masked rows), HAS_POLICY
    pol_loss_ptr,  # (N,) fp32 w * per-token policy loss, HAS_POLICY
    ratio_ptr,  # (N,) fp32 importance ratio, HAS_POLICY
    kl_ptr,  # (N,) fp32 per-token KL estimate, KL_EST > 0
    # sizes
    V,
    T,
    # strides
    stride_b,
    stride_t,
    grad_stride_b,
    grad_stride_t,
    t_stride_b,
    t_stride_t,
    # scalars
    ignore_index,
    w_ce,
    smoothing,
    w_z,
    w_entropy,
    logit_scale,
    softcap,
    inv_temperature,
    w_distill,
    inv_distill_temp,
    jsd_beta,
    eps_low,
    eps_high,
    pol_delta,
    dual_c,
    kl_beta,
    entropy_coef,
    # meta
    BLOCK_V: tl.constexpr,
    HAS_POLICY: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_IW: tl.constexpr,
    KL_EST: tl.constexpr,
    KL_IS_CORR: tl.constexpr,
    HAS_TEACHER: tl.constexpr,
    DISTILL_KIND: tl.constexpr,
    OWN_TEMP: tl.constexpr,
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
    t_row_ptr = teacher_ptr + (row // T) * t_stride_b + (row % T) * t_stride_t
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
        m2, d, sum_x2, sum_ex2, arg, mt2, dt, sum_t, sum_ts, ms2, ds, sum_st, t_arg = online_stats(
            row_ptr, t_row_ptr, V, logit_scale, softcap, inv_temperature, inv_distill_temp,
            BLOCK_V, HAS_SOFTCAP, HAS_SMOOTHING, ENTROPY_IN_PASS_1, HAS_ARGMAX,
            HAS_TEACHER, DISTILL_KIND, OWN_TEMP,
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
        lse_s2 = lse2
        lse_t2 = tl.zeros([], tl.float32)
        divergence = tl.zeros([], tl.float32)
        jsd_s = tl.zeros([], tl.float32)
        if HAS_TEACHER:
            # --- 2b. distillation: divergence between student and teacher at T_d
            lse_t2 = mt2 + tl.log2(dt)
            lse_s2 = ms2 + tl.log2(ds)
            # lse_t2 - lse_s2 from the maxima and the ratio of the sums: no cancellation of two
            # O(|x|) normalisers when the teacher is close to the student
            t_minus_s = (mt2 - ms2) + tl.log2(dt / ds)
            if DISTILL_KIND == 0:
                divergence = LN2 * (sum_ts / dt - t_minus_s)
            elif DISTILL_KIND == 1:
                divergence = LN2 * (sum_st / ds + t_minus_s)
            else:
                divergence, jsd_s = jsd_sums(
                    row_ptr, t_row_ptr, V, lse_s2, lse_t2, t_minus_s, jsd_beta, logit_scale, softcap,
                    inv_temperature, inv_distill_temp, BLOCK_V, HAS_SOFTCAP, OWN_TEMP,
                )
            token_loss += w_distill * divergence
            tl.store(dstats_ptr + row * 4, lse_s2)
            tl.store(dstats_ptr + row * 4 + 1, lse_t2)
            tl.store(dstats_ptr + row * 4 + 2, divergence)
            tl.store(dstats_ptr + row * 4 + 3, jsd_s)
            tl.store(t_entropy_ptr + row, LN2 * (lse_t2 - sum_t / dt))
            tl.store(t_pred_ptr + row, t_arg.to(tl.int64))
        tl.store(lse_ptr + row, lse)
        tl.store(token_loss_ptr + row, token_loss)
        d_logp = tl.zeros([], tl.float32)
        d_entropy = tl.zeros([], tl.float32)
        if HAS_POLICY:
            # --- 2c. token-level policy objective on this row's log p(target)
            logp = (x2_y - lse2) * LN2
            old = logp
            if HAS_OLD:
                old = tl.load(old_ptr + row)
            ref = logp
            if KL_EST != 0:
                ref = tl.load(ref_ptr + row)
            iw = tl.full([], 1.0, tl.float32)
            if HAS_IW:
                iw = tl.load(iw_ptr + row)
            w = tl.load(pw_ptr + row)
            per_token, d_per_token, ratio, kl = policy_token(
                logp, old, ref, tl.load(adv_ptr + row), iw, eps_low, eps_high, pol_delta, dual_c, kl_beta,
                KL_EST, KL_IS_CORR,
            )
            policy_loss = w * per_token
            d_logp = w * d_per_token
            if HAS_ENTROPY_GRAD:  # verl's entropy bonus, aggregated like the loss
                policy_loss -= entropy_coef * w * entropy
                d_entropy = -entropy_coef * w
            tl.store(pol_loss_ptr + row, policy_loss)
            tl.store(ratio_ptr + row, ratio)
            if KL_EST != 0:
                tl.store(kl_ptr + row, kl)
        # --- 3. gradient pass (fused mode)
        if FUSED_GRAD:
            u = tl.load(grad_scale_ptr)
            zero = tl.zeros([], tl.float32)
            A, B, C, D = row_coefficients(
                u, d_logp, d_entropy, zero, lse, entropy, V, w_ce, smoothing, w_z, w_entropy,
                HAS_CE, HAS_Z, HAS_ENTROPY_GRAD,
            )
            sum_px2 = gradient_pass(
                row_ptr, t_row_ptr, grad_row_ptr, V, y, x2_y, slope_y, lse, A, B, C, D,
                logit_scale, softcap, inv_temperature,
                lse_s2, lse_t2, divergence, jsd_s, u * w_distill * inv_distill_temp, jsd_beta, inv_distill_temp,
                BLOCK_V, HAS_SOFTCAP, HAS_ENTROPY_GRAD, HAS_SMOOTHING, ENTROPY_IN_PASS_3,
                HAS_TEACHER, DISTILL_KIND, OWN_TEMP,
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
        if HAS_TEACHER:
            for k in tl.static_range(4):
                tl.store(dstats_ptr + row * 4 + k, 0.0)
            tl.store(t_entropy_ptr + row, 0.0)
            tl.store(t_pred_ptr + row, -1)
        if HAS_POLICY:
            tl.store(pol_loss_ptr + row, 0.0)
            tl.store(ratio_ptr + row, 1.0)
            if KL_EST != 0:
                tl.store(kl_ptr + row, 0.0)
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
    teacher_ptr,  # (N, V) teacher logits, HAS_TEACHER
    dstats_ptr,  # (N, 4) fp32 saved by the forward, HAS_TEACHER
    # sizes
    V,
    T,
    # strides
    stride_b,
    stride_t,
    grad_stride_b,
    grad_stride_t,
    t_stride_b,
    t_stride_t,
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
    w_distill,
    inv_distill_temp,
    jsd_beta,
    eps_low,  # the policy's scalars: unused here (its objective runs in torch in deferred mode)
    eps_high,
    pol_delta,
    dual_c,
    kl_beta,
    entropy_coef,
    # meta
    BLOCK_V: tl.constexpr,
    HAS_TEACHER: tl.constexpr,
    DISTILL_KIND: tl.constexpr,
    OWN_TEMP: tl.constexpr,
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
    t_row_ptr = teacher_ptr + (row // T) * t_stride_b + (row % T) * t_stride_t
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
        lse_s2 = zero
        lse_t2 = zero
        divergence = zero
        jsd_s = zero
        if HAS_TEACHER:
            lse_s2 = tl.load(dstats_ptr + row * 4)
            lse_t2 = tl.load(dstats_ptr + row * 4 + 1)
            divergence = tl.load(dstats_ptr + row * 4 + 2)
            jsd_s = tl.load(dstats_ptr + row * 4 + 3)
        gradient_pass(
            row_ptr, t_row_ptr, grad_row_ptr, V, y, x2_y, slope_y, lse, A, B, C, D,
            logit_scale, softcap, inv_temperature,
            lse_s2, lse_t2, divergence, jsd_s, u * w_distill * inv_distill_temp, jsd_beta, inv_distill_temp,
            BLOCK_V, HAS_SOFTCAP, HAS_ENTROPY_GRAD, HAS_SMOOTHING, False,
            HAS_TEACHER, DISTILL_KIND, OWN_TEMP,
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


def launch_config(vocab: int, teacher: bool = False, rows: int | None = None) -> LaunchConfig:
    """Block and warps for a row of ``vocab`` logits, in a launch of ``rows`` rows.

    2048 columns x 4 warps (16 per thread) was fastest on an H200 at V=128256 for every spec
    (benchmarks/profile_head.py --ablate, bench_head.py --tune): small enough per-thread state
    for high occupancy, which this latency-bound loop needs. With a teacher the per-lane state
    doubles, and 1024 x 4 was fastest (2996 vs 3216 us, profile_head.py --terms).
    A launch of fewer than 1024 rows (the fused lm_head's chunks) has too few programs to fill
    the GPU with 4 warps each: 4096 x 8 (the same 16 per thread) ran 256/320/512-row chunks at
    2.39/2.05/1.77 ms per 8192 rows against 2.97/2.96/2.10 (benchmarks/profile_linear.py).
    HEADLOSS_BLOCK_V / HEADLOSS_NUM_WARPS override it (used by those sweeps).
    """
    block = min(triton.next_power_of_2(max(vocab, 16)), 1024 if teacher else 2048)
    warps = 4 if block >= 1024 else (2 if block >= 256 else 1)
    if not teacher and rows is not None and rows < 1024 and vocab >= 16384:
        block, warps = 4096, 8
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
    dstats: torch.Tensor | None = None  # (N, 4): lse_s2, lse_t2, divergence, jsd_s
    t_entropy: torch.Tensor | None = None
    t_pred: torch.Tensor | None = None
    policy_loss: torch.Tensor | None = None  # w * per-token policy loss (fused token-level policy)
    ratio: torch.Tensor | None = None
    kl: torch.Tensor | None = None

    DIFFERENTIABLE = ("token_loss", "lse", "entropy", "logp")

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
            dstats=torch.empty(rows, 4, **f32) if flags.HAS_TEACHER else None,
            t_entropy=torch.empty(rows, **f32) if flags.HAS_TEACHER else None,
            t_pred=torch.empty(rows, dtype=torch.int64, device=device) if flags.HAS_TEACHER else None,
            policy_loss=torch.empty(rows, **f32) if flags.HAS_POLICY else None,
            ratio=torch.empty(rows, **f32) if flags.HAS_POLICY else None,
            kl=torch.empty(rows, **f32) if flags.KL_EST else None,
        )

    def rows(self, start: int, stop: int) -> RowStats:
        """Views of rows [start, stop) of every buffer (for a chunk of a longer batch)."""
        return RowStats(*(t[start:stop] if t is not None else None for t in self.fields()))

    def fields(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def constants(self) -> list[torch.Tensor]:
        """The buffers that carry no gradient (for ctx.mark_non_differentiable)."""
        return [
            getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name not in self.DIFFERENTIABLE and getattr(self, f.name) is not None
        ]


def row_geometry(logits: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, T, stride_b, stride_t) of a [N, V] or [B, T, V] tensor whose last stride is 1."""
    if logits.dim() == 2:
        return logits.shape[0], max(logits.shape[0], 1), 0, logits.stride(0)
    batch, seq = logits.shape[0], logits.shape[1]
    return batch * seq, max(seq, 1), logits.stride(0), logits.stride(1)


def _teacher_args(teacher: torch.Tensor | None, placeholder: torch.Tensor) -> tuple:
    if teacher is None:
        return placeholder, 0, 0
    _, _, t_stride_b, t_stride_t = row_geometry(teacher)
    return teacher, t_stride_b, t_stride_t


def run_forward(
    plan: KernelPlan,
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    teacher: torch.Tensor | None,
    grad: torch.Tensor | None,
    grad_scale: torch.Tensor,
    out: RowStats | None = None,
    policy: object | None = None,
) -> RowStats:
    """Launch the forward kernel; writes ``grad`` too when the plan is fused and grad is given.

    Per-row results go to ``out`` (contiguous views, e.g. a chunk of longer buffers) or to new
    buffers. ``policy`` (headloss.policy.PolicyInputs) carries the per-row policy inputs when the
    plan has HAS_POLICY.
    """
    rows, seq, stride_b, stride_t = row_geometry(logits)
    vocab = logits.shape[-1]
    flags = plan.flags
    stats = out if out is not None else RowStats.empty(rows, plan, logits.device)
    if rows == 0:
        return stats
    fused = flags.FUSED_GRAD and grad is not None
    _, _, grad_stride_b, grad_stride_t = row_geometry(grad) if fused else (0, 0, 0, 0)
    cfg = launch_config(vocab, flags.HAS_TEACHER, rows)
    placeholder = stats.token_loss
    teacher, t_stride_b, t_stride_t = _teacher_args(teacher, placeholder)
    opt = lambda t: t if t is not None else placeholder  # noqa: E731
    head_forward_kernel[(rows,)](
        logits, opt(targets), grad if fused else placeholder, grad_scale,
        stats.token_loss, stats.lse, opt(stats.ce), opt(stats.entropy), opt(stats.logp), opt(stats.pred),
        teacher, opt(stats.dstats), opt(stats.t_entropy), opt(stats.t_pred),
        *(opt(getattr(policy, name, None)) for name in POLICY_ROW_FIELDS),
        opt(stats.policy_loss), opt(stats.ratio), opt(stats.kl),
        vocab, seq,
        stride_b, stride_t, grad_stride_b, grad_stride_t, t_stride_b, t_stride_t,
        *plan.scalars.as_args(),
        BLOCK_V=cfg.block_v,
        num_warps=cfg.num_warps,
        **{**flags.as_kwargs(), "FUSED_GRAD": fused},
    )
    return stats


def run_backward(
    plan: KernelPlan,
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    teacher: torch.Tensor | None,
    grad: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    dstats: torch.Tensor | None,
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
    cfg = launch_config(vocab, flags.HAS_TEACHER, rows)
    teacher, t_stride_b, t_stride_t = _teacher_args(teacher, lse)
    opt = lambda t: t if t is not None else lse  # noqa: E731
    head_backward_kernel[(rows,)](
        logits, opt(targets), grad, lse, opt(entropy),
        d_token, opt(d_logp), opt(d_entropy), opt(d_lse),
        teacher, opt(dstats),
        vocab, seq,
        stride_b, stride_t, grad_stride_b, grad_stride_t, t_stride_b, t_stride_t,
        0 if d_token.numel() == 1 else 1,
        *plan.scalars.as_args(),
        BLOCK_V=cfg.block_v,
        HAS_TEACHER=flags.HAS_TEACHER,
        DISTILL_KIND=flags.DISTILL_KIND,
        OWN_TEMP=flags.OWN_TEMP,
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
