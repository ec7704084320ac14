"""The student's top-k in a one-read online-softmax pass, two designs side by side (forward only).

    python -m benchmarks.bench_topk_stream --stem bench_topk_stream

A standalone kernel reads each row of bf16 logits [N=8192, V=128256] once, keeps the online
softmax's running max and per-lane sums (as the head kernel's statistics pass does) and, per variant:

- ``plain``: nothing else (the pass the top-k rides on);
- ``insertion``: a running top-k (headloss.kernels.topk.topk_block, now the rare rows' fallback: int64 keys
  in registers, a block whose largest logit is below the k-th skipped, the others' keys above it entered one
  at a time);
- ``compaction cap=C``: an experiment: a threshold (after the first block, the k-th largest of its
  per-thread maxima; later the k-th of a merge) gates each block; the block's elements above it are
  scattered (a prefix sum gives each its slot) into a per-row buffer of C entries, and a full buffer
  is merged back to its top k by ``tl.topk``; a block with more candidates than the buffer holds takes
  the insertion path;
- ``lanes``: each lane's largest logit (two largest) and the value below kept through the pass, merged at
  the row's end, the row read again where a lane may have held more of the top k (the design the head kernel
  ships, headloss.kernels.topk, without its skip of blocks below the k largest block maxima).

Every variant's ids are checked against a stable sort first (odd shapes, exact ties, a constant row).
Writes $OUT (or ./results)/<stem>.{json,csv,png}; prints the table with each variant's ratio to plain.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.common import Row, measure, out_dir_default, pyplot, write_rows
from headloss.kernels.topk import KEY_MAX, KEY_MIN, LOW_WORD, key_of, topk_block, topk_start, value_of

LOG2E = 1.4426950408889634
N, V = 8192, 128256
BLOCK = 2048


@triton.jit
def _merge(buf, n, K: tl.constexpr, T: tl.constexpr, CAP: tl.constexpr):
    """The buffer's n entries (value bits at buf[0:CAP], ids at buf[CAP:2 CAP]) cut to their top K, written
    back at 0..K-1: (entries, the K-th key, the sorted top T keys)."""
    tl.debug_barrier()
    t = tl.arange(0, CAP)
    inside = t < n
    v = tl.load(buf + t, mask=inside, other=0).to(tl.float32, bitcast=True)
    i = tl.load(buf + CAP + t, mask=inside, other=0)
    top = tl.topk(tl.where(inside, key_of(v, i), KEY_MIN), T)
    s = tl.arange(0, T)
    keep = s < K
    tl.debug_barrier()
    tl.store(buf + s, value_of(top).to(tl.int32, bitcast=True), mask=keep)
    tl.store(buf + CAP + s, ((top & LOW_WORD) ^ LOW_WORD).to(tl.int32), mask=keep)
    return tl.minimum(n, K), tl.min(tl.where(keep, top, KEY_MAX), 0), top


@triton.jit
def _scatter(buf, pos, x2, ids, CAP: tl.constexpr, ASM: tl.constexpr):
    """buf[pos] = x2's bits and buf[CAP + pos] = ids where pos >= 0. On a GPU an inline store that makes
    its addresses itself: tl.store of a scattered pointer tensor gives the whole block a
    one-element-per-thread layout (a shared-memory conversion of every block) and 64-bit pointers."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 a; setp.ge.s32 p, $4, 0; mul.wide.s32 a, $4, 4; add.s64 a, a, $1;"
            " @p st.global.b32 [a], $2; add.s64 a, a, $5; @p st.global.b32 [a], $3; mov.u32 $0, 0; }",
            "=r,l,r,r,r,l", [buf, x2.to(tl.int32, bitcast=True), ids, pos, tl.full([], 4 * CAP, tl.int64)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(buf + pos, x2.to(tl.int32, bitcast=True), mask=pos >= 0)
        tl.store(buf + CAP + pos, ids, mask=pos >= 0)


@triton.jit
def stream_kernel(x, out_lse, out_keys, scratch, V, stride, K: tl.constexpr, T: tl.constexpr, CAP: tl.constexpr,
                  MODE: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr,
                  R: tl.constexpr = 1, MERGE: tl.constexpr = 0):
    """One row per program: its log-sum-exp and (MODE 1 insertion, 2 compaction, 3 lanes) its top-K keys,
    sorted."""
    row = tl.program_id(0)
    p = x + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK], tl.float32)
    buf = scratch + row.to(tl.int64) * 2 * CAP
    top = topk_start(K, T)
    n = tl.zeros([], tl.int32)
    thr_v = tl.full([], float("-inf"), tl.float32)
    m1 = tl.full([BLOCK], float("-inf"), tl.float32)
    m2 = m1
    m3 = m1
    i1 = tl.zeros([BLOCK], tl.int32)
    i2 = i1
    for start in range(0, V, BLOCK):
        cols = start + offs
        x2 = tl.load(p + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        bm = tl.max(x2, 0)
        m_new = tl.maximum(m, bm)
        d = d * tl.exp2(m - m_new) + tl.exp2(x2 - m_new)
        m = m_new
        if MODE == 1:
            top = topk_block(x2, cols, V, top, 0, T)
        if MODE == 2:
            first = start == 0
            if first:  # a bound from the first block: the K-th largest of G group maxima
                g = tl.topk(tl.max(tl.reshape(x2, [G, BLOCK // G]), 1), T)
                thr_v = tl.min(tl.where(tl.arange(0, T) < K, g, float("inf")), 0)
            if first | (bm > thr_v):
                mask = ((x2 > thr_v) | ((x2 == thr_v) & first)) & (cols < V)
                c = tl.sum(mask.to(tl.int32), 0)
                room = True
                if n + c > CAP:
                    n, thr, keys = _merge(buf, n, K, T, CAP)
                    thr_v = value_of(thr)
                    if n + c > CAP:  # more candidates than the buffer holds: one at a time
                        s = tl.arange(0, T)
                        keys, thr = topk_block(x2, cols, V, (tl.where(s < K, keys, KEY_MAX), thr), 0, T)
                        keys = tl.sort(tl.where(s < K, keys, KEY_MIN), descending=True)
                        tl.debug_barrier()
                        tl.store(buf + s, value_of(keys).to(tl.int32, bitcast=True), mask=s < K)
                        tl.store(buf + CAP + s, ((keys & LOW_WORD) ^ LOW_WORD).to(tl.int32), mask=s < K)
                        n = tl.sum((keys > KEY_MIN).to(tl.int32), 0)
                        thr_v = value_of(thr)
                        room = False
                if room:
                    pos = n + tl.cumsum(mask.to(tl.int32), 0) - 1
                    _scatter(buf, tl.where(mask, pos, -1), x2, cols, CAP, ASM)
                    n += c
        if MODE == 3:  # every lane's R largest (strict '>': the lower id first on ties), and its next value
            gt1 = x2 > m1
            gt2 = x2 > m2
            if R == 2:
                m3 = tl.where(gt2, m2, tl.maximum(m3, x2))
                i2 = tl.where(gt1, i1, tl.where(gt2, cols, i2))
            m2 = tl.where(gt1, m1, tl.where(gt2, x2, m2))
            m1 = tl.where(gt1, x2, m1)
            i1 = tl.where(gt1, cols, i1)
    tl.store(out_lse + row, (m + tl.log2(tl.sum(d, 0))) / 1.4426950408889634)
    s = tl.arange(0, T)
    if MODE == 3:
        tl.store(buf, 0)
        if R == 2:
            cand = tl.reshape(tl.join(key_of(m1, i1), key_of(m2, i2)), [2 * BLOCK])
            rest = tl.max(m3, 0)
        else:
            cand = key_of(m1, i1)
            rest = tl.max(m2, 0)
        if MERGE == 0:
            keys = tl.topk(cand, T)
        elif MERGE == 1:  # K rounds of the largest key, taken out
            keys = tl.full([T], KEY_MIN, tl.int64)
            for j in tl.static_range(K):
                best = tl.max(cand, 0)
                keys = tl.where(s == j, best, keys)
                cand = tl.where(cand == best, KEY_MIN, cand)
        else:  # (timing only: the pass without the merge)
            keys = tl.where(s < K, tl.max(cand, 0), KEY_MIN)
        kth = tl.min(tl.where(s < K, keys, KEY_MAX), 0)
        if rest >= value_of(kth):  # a lane may hold more of the top-k than it kept: the row again, one at a time
            top = topk_start(K, T)
            for start in range(0, V, BLOCK):
                cols = start + offs
                x2 = tl.load(p + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * 1.4426950408889634
                top = topk_block(x2, cols, V, top, 0, T)
            keys, thr = top
            keys = tl.sort(tl.where(s < K, keys, KEY_MIN), descending=True)
            tl.store(buf, 1)  # (the row took the fallback: stream_fallbacks counts them)
        tl.store(out_keys + row * T + s, tl.where(s < K, keys, KEY_MIN))
    if MODE == 1:
        keys, thr = top
        tl.store(out_keys + row * T + s, tl.sort(tl.where(s < K, keys, KEY_MIN), descending=True))
    if MODE == 2:
        n, thr, keys = _merge(buf, n, K, T, CAP)
        tl.store(out_keys + row * T + s, tl.where(s < K, keys, KEY_MIN))


def stream(x: torch.Tensor, k: int, mode: int, cap: int = 0, lanes: int = 1, warps: int = 4,
           scratch: torch.Tensor | None = None, merge: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [N], ids [N, k]) of one variant: mode 0 plain, 1 insertion, 2 compaction with a buffer of cap,
    3 each lane's top ``lanes`` (1 or 2), the lanes merged by tl.topk (``merge`` 0), K rounds of the largest
    (1) or not at all (2: timing only, not the top-k); ``scratch`` [N, 2 * cap] int32 (mode 3: column 0
    flags a fallback)."""
    n, v = x.shape
    t = max(2, triton.next_power_of_2(k))
    cap = cap or t
    lse = torch.empty(n, device=x.device, dtype=torch.float32)
    keys = torch.empty(n, t, device=x.device, dtype=torch.int64)
    if scratch is None:
        scratch = torch.empty(n, 2 * cap, device=x.device, dtype=torch.int32)
    stream_kernel[(n,)](x, lse, keys, scratch, v, x.stride(0), K=k, T=t, CAP=cap, MODE=mode, BLOCK=BLOCK,
                        G=min(BLOCK, max(t, BLOCK // 16)), ASM=int(x.is_cuda), R=lanes, MERGE=merge,
                        num_warps=warps)
    return lse, 0xFFFFFFFF - (keys[:, :k] & 0xFFFFFFFF)


def variants(k: int, timing: bool = False) -> dict[str, tuple[int, int, int, int, int]]:
    """name -> (mode, cap, lanes, warps, merge); ``timing``: also the lanes without their merge."""
    t = max(2, triton.next_power_of_2(k))
    out = {"plain": (0, 0, 1, 4, 0), "insertion": (1, 0, 1, 4, 0),
           **{f"compaction cap={c}": (2, c, 1, 4, 0) for c in (4 * t, 8 * t)}}
    lanes, warps = (1, 4) if k <= 16 else (2, 8)
    for merge, how in enumerate(("tl.topk", "k rounds", "no merge (timing only)")):
        if merge < 2 or timing:
            out[f"lanes top-{lanes}, {how}"] = (3, 0, lanes, warps, merge)
    return out


def fallbacks(x: torch.Tensor, k: int, lanes: int) -> int:
    """How many rows the lanes design ran again (a lane held more of the row's top-k than it kept)."""
    t = max(2, triton.next_power_of_2(k))
    scratch = torch.zeros(x.shape[0], 2 * t, device=x.device, dtype=torch.int32)
    stream(x, k, 3, 0, lanes, 4, scratch)
    return int(scratch[:, 0].sum())


def check(device: str) -> None:
    """Every variant's ids equal a stable sort's (ties to the lower id) on odd shapes, ties and a constant row."""
    for n, v, k, ties in ((7, 5000, 8, False), (5, 300, 64, False), (6, 130000, 64, True), (4, 9000, 1, True),
                          (3, 70000, 17, False)):
        gen = torch.Generator(device=device).manual_seed(n + v)
        x = torch.randn(n, v, device=device, generator=gen) * 3
        x = (x.round() if ties else x)
        x[0] = 1.0
        x = x.to(torch.bfloat16)
        want = torch.sort(x.float(), dim=-1, descending=True, stable=True).indices[:, :k]
        for name, (mode, cap, lanes, warps, merge) in variants(k).items():
            if mode:
                got = stream(x, k, mode, cap, lanes, warps, merge=merge)[1]
                assert torch.equal(got, want), f"{name}, N {n} V {v} k {k}: ids differ from a stable sort"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stem", default="bench_topk_stream")
    parser.add_argument("--k", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    check("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(N, V, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    rows: list[Row] = []
    for k in args.k:
        for name, (mode, cap, lanes, warps, merge) in variants(k, timing=True).items():
            note = f"{fallbacks(x, k, lanes)} of {N} rows read again" if mode == 3 and merge < 2 else ""
            measure(rows, f"top-k {k}", name, "N", N,
                    lambda mode=mode, cap=cap, k=k, lanes=lanes, warps=warps, merge=merge: stream(
                        x, k, mode, cap, lanes, warps, merge=merge),
                    config={"N": N, "V": V, "k": k, "block": BLOCK, "cap": cap, "lanes": lanes, "warps": warps,
                            "merge": merge}, note=note)
    out = out_dir_default()
    js, cs = write_rows(rows, out, args.stem)
    plain = {r.case: r.p50 for r in rows if r.metric == "time" and r.provider == "plain"}
    print(f"\n{'case':<10}{'variant':<24}{'p50 ms':>9}{'x plain':>9}")
    for r in rows:
        if r.metric == "time" and r.p50:
            print(f"{r.case:<10}{r.provider:<24}{r.p50:>9.3f}{r.p50 / plain[r.case]:>9.2f}  {r.note}")
    plt = pyplot()
    cases = list(plain)
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 3.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        times = [r for r in rows if r.case == case and r.metric == "time" and r.p50]
        ax.barh([r.provider for r in times], [r.p50 for r in times], color="tab:blue")
        ax.set_xlabel("forward ms (median)")
        ax.set_title(f"{case}: one read of bf16 [{N}, {V}]")
    fig.tight_layout()
    fig.savefig(out / f"{args.stem}.png", dpi=110)
    print(f"\nwrote {js}, {cs}")


if __name__ == "__main__":
    main()
