"""Weight-gradient accumulation of one chunk of the fused lm_head: ``dW (+)= g^T @ h``.

A persistent kernel: one program per SM walks the [BLOCK_V, BLOCK_H] tiles of dW, loads its
operands through TMA descriptors, reduces over the chunk's rows in fp32, adds the tile's old
value and writes it once. Programs walk H fastest, so the H-tiles of one V-slab run together and
share that slab of g through L2; the chunk's h is a few MB and stays in L2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def wgrad_kernel(
    g_desc,  # (C, V) logits gradient of the chunk, block [BLOCK_C, BLOCK_V]
    h_desc,  # (C, H) hidden rows of the chunk, block [BLOCK_C, BLOCK_H]
    dw_desc,  # (V, H) weight gradient, block [BLOCK_V, BLOCK_H]
    C,
    V,
    H,
    ACCUMULATE: tl.constexpr,  # add into dW's current value (else overwrite)
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter's half-precision dot is wrong)
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NUM_SMS: tl.constexpr,
):
    tiles_h = tl.cdiv(H, BLOCK_H)
    tiles = tl.cdiv(V, BLOCK_V) * tiles_h
    k_tiles = tl.cdiv(C, BLOCK_C)
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):
        off_v = (tile // tiles_h) * BLOCK_V
        off_h = (tile % tiles_h) * BLOCK_H
        acc = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
        for k in range(k_tiles):
            a = g_desc.load([k * BLOCK_C, off_v])  # rows past C are read as 0
            b = h_desc.load([k * BLOCK_C, off_h])
            if UPCAST:
                acc = tl.dot(a.to(tl.float32).T, b.to(tl.float32), acc)
            else:
                acc = tl.dot(a.T, b, acc)
        if ACCUMULATE:
            acc += dw_desc.load([off_v, off_h]).to(tl.float32)
        dw_desc.store([off_v, off_h], acc.to(dw_desc.dtype))


@dataclass(frozen=True)
class WgradConfig:
    block_v: int = 128
    block_h: int = 256
    block_c: int = 64
    num_warps: int = 8
    num_stages: int = 3


def wgrad_config() -> WgradConfig:
    """Tile shape; HEADLOSS_WGRAD="BV,BH,BC,warps,stages" overrides it (used by the sweep in
    benchmarks/profile_linear.py)."""
    env = os.environ.get("HEADLOSS_WGRAD")
    return WgradConfig(*(int(x) for x in env.split(","))) if env else WgradConfig()


def wgrad_supported(g: torch.Tensor, h: torch.Tensor, dw: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides, unit inner strides."""
    return all(
        t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
        for t in (g, h, dw)
    )


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def weight_grad_(dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor, accumulate: bool = True) -> None:
    """dw (+)= g.T @ h in place. g [C, V], h [C, H] (same dtype), dw [V, H] (that dtype or fp32)."""
    rows, vocab = g.shape
    width = h.shape[1]
    assert dw.shape == (vocab, width) and h.shape[0] == rows and wgrad_supported(g, h, dw)
    if rows == 0:
        if not accumulate:
            dw.zero_()
        return
    cfg = wgrad_config()
    sms = _num_sms(g.device)
    tiles = triton.cdiv(vocab, cfg.block_v) * triton.cdiv(width, cfg.block_h)
    wgrad_kernel[(min(sms, tiles),)](
        TensorDescriptor.from_tensor(g, [cfg.block_c, cfg.block_v]),
        TensorDescriptor.from_tensor(h, [cfg.block_c, cfg.block_h]),
        TensorDescriptor.from_tensor(dw, [cfg.block_v, cfg.block_h]),
        rows, vocab, width,
        ACCUMULATE=accumulate, UPCAST=not g.is_cuda,
        BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, NUM_SMS=sms,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
