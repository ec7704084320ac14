"""Weight-gradient accumulation of one chunk of the fused lm_head: ``dW (+)= g^T @ h`` and
``db += sum_rows g``, in one pass over the chunk's logits gradient ``g``.

cuBLAS runs this shape (M = V = 128256, N = H = 4096, K = C = a few hundred rows, C read and
written because of the accumulation) far below its memory bound: 0.82 ms per 256-row chunk on
an H200, where the 2.1 GB read-modify-write of a bf16 dW takes 0.49 ms
(benchmarks/profile_linear.py). Each program here owns one [BLOCK_V, BLOCK_H] tile of dW:
it reduces over the chunk's rows in fp32, adds the tile's old value, and writes it once.
Programs walk H fastest, so the H-tiles of one V-slab run together and read that slab of g
from L2; the chunk's h is a few MB and stays in L2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def wgrad_kernel(
    g_ptr,  # (C, V) logits gradient of the chunk, row stride stride_g
    h_ptr,  # (C, H) hidden rows of the chunk, row stride stride_h
    dw_ptr,  # (V, H) weight gradient, row stride stride_dw; bf16/fp16/fp32
    db_ptr,  # (V,) fp32 bias gradient, HAS_BIAS
    C,
    V,
    H,
    stride_g,
    stride_h,
    stride_dw,
    ACCUMULATE: tl.constexpr,  # add into dW's current value (else overwrite)
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter's half-precision dot is wrong)
    HAS_BIAS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_h = tl.cdiv(H, BLOCK_H)
    pid_v = pid // tiles_h
    pid_h = pid % tiles_h
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    mask_v = offs_v < V
    mask_h = offs_h < H
    acc = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
    bias = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, C, BLOCK_C):
        rows = start + offs_c
        mask_c = rows < C
        # g^T tile [BLOCK_V, BLOCK_C]: V is the contiguous axis of g
        a = tl.load(g_ptr + rows[None, :].to(tl.int64) * stride_g + offs_v[:, None],
                    mask=mask_c[None, :] & mask_v[:, None], other=0.0)
        b = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + offs_h[None, :],
                    mask=mask_c[:, None] & mask_h[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            if pid_h == 0:
                bias += tl.sum(a.to(tl.float32), axis=1)
    tile = dw_ptr + offs_v[:, None].to(tl.int64) * stride_dw + offs_h[None, :]
    mask = mask_v[:, None] & mask_h[None, :]
    if ACCUMULATE:
        acc += tl.load(tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(tile, acc.to(dw_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        if pid_h == 0:
            old = tl.load(db_ptr + offs_v, mask=mask_v, other=0.0)
            tl.store(db_ptr + offs_v, old + bias, mask=mask_v)


@dataclass(frozen=True)
class WgradConfig:
    block_v: int = 128
    block_h: int = 128
    block_c: int = 64
    num_warps: int = 4
    num_stages: int = 3


def wgrad_config() -> WgradConfig:
    """Tile shape; HEADLOSS_WGRAD="BV,BH,BC,warps,stages" overrides it (used by the sweep in
    benchmarks/profile_linear.py)."""
    env = os.environ.get("HEADLOSS_WGRAD")
    if env:
        return WgradConfig(*(int(x) for x in env.split(",")))
    return WgradConfig()


def weight_grad_(
    dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor, db: torch.Tensor | None = None, accumulate: bool = True
) -> None:
    """dw (+)= g.T @ h and db += g.sum(0), in place. g [C, V], h [C, H], dw [V, H], db fp32 [V]."""
    rows, vocab = g.shape
    width = h.shape[1]
    assert dw.shape == (vocab, width) and h.shape[0] == rows
    assert g.stride(1) == 1 and h.stride(1) == 1 and dw.stride(1) == 1
    assert db is None or (db.dtype == torch.float32 and db.is_contiguous())
    if rows == 0:
        if not accumulate:
            dw.zero_()
        return
    cfg = wgrad_config()
    grid = (triton.cdiv(vocab, cfg.block_v) * triton.cdiv(width, cfg.block_h),)
    wgrad_kernel[grid](
        g, h, dw, db if db is not None else dw, rows, vocab, width, g.stride(0), h.stride(0), dw.stride(0),
        ACCUMULATE=accumulate, UPCAST=not g.is_cuda, HAS_BIAS=db is not None,
        BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
