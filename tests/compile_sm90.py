"""Compile the head kernels for sm_90 (Hopper) on a machine without a GPU.

Run as a script with TRITON_INTERPRET unset (tests/test_compile_sm90.py does): Triton's real
front end and backend, down to PTX, for each variant; prints {variant: ptx} as JSON.
"""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from headloss.kernels import head

HOPPER = GPUTarget("cuda", 90, 32)
INT_ARGS = ("V", "T", "ignore_index", "d_token_stride")
NO_TEACHER = dict(HAS_TEACHER=False, DISTILL_KIND=0, OWN_TEMP=False)
NO_POLICY = dict(HAS_POLICY=False, HAS_OLD=False, HAS_IW=False, KL_EST=0, KL_IS_CORR=False)


def _signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        elif name in INT_ARGS or "stride" in name:
            sig[name] = "i64" if "stride" in name else "i32"
        else:
            sig[name] = "fp32"
    return sig


def _compile(fn, pointers: dict[str, str], constexprs: dict) -> str:
    src = ASTSource(fn, _signature(fn, pointers, constexprs), constexprs=constexprs)
    return triton.compile(src, target=HOPPER, options={"num_warps": 4}).asm["ptx"]


FORWARD_FLAGS = dict(
    HAS_TARGETS=True, HAS_CE=True, HAS_SMOOTHING=True, HAS_Z=True, HAS_ENTROPY=True,
    HAS_ENTROPY_GRAD=True, HAS_ARGMAX=True, STORE_LOGP=True, HAS_SOFTCAP=True, FUSED_GRAD=True,
    **NO_TEACHER, **NO_POLICY,
)
CE_ONLY = {name: name in ("HAS_TARGETS", "HAS_CE", "STORE_LOGP", "FUSED_GRAD") for name in FORWARD_FLAGS}
CE_ONLY.update(DISTILL_KIND=0, KL_EST=0)


def _forward_ptx(flags: dict, dtype: str = "bf16") -> str:
    pointers = dict(
        logits_ptr=dtype, targets_ptr="i64", grad_ptr=dtype, grad_scale_ptr="fp32", token_loss_ptr="fp32",
        lse_ptr="fp32", ce_ptr="fp32", entropy_ptr="fp32", logp_ptr="fp32", pred_ptr="i64",
        teacher_ptr=dtype, dstats_ptr="fp32", t_entropy_ptr="fp32", t_pred_ptr="i64",
        old_ptr="fp32", ref_ptr="fp32", adv_ptr="fp32", iw_ptr="fp32", pw_ptr="fp32", pol_loss_ptr="fp32",
        ratio_ptr="fp32", kl_ptr="fp32",
    )
    return _compile(head.head_forward_kernel, pointers, dict(flags, BLOCK_V=2048))


BACKWARD_POINTERS = dict(
    logits_ptr="bf16", targets_ptr="i64", grad_ptr="bf16", lse_ptr="fp32", entropy_ptr="fp32",
    d_token_ptr="fp32", d_logp_ptr="fp32", d_entropy_ptr="fp32", d_lse_ptr="fp32",
    teacher_ptr="bf16", dstats_ptr="fp32",
)
BACKWARD_FLAGS = dict(
    BLOCK_V=2048, HAS_TARGETS=True, HAS_CE=True, HAS_SMOOTHING=True, HAS_Z=True, HAS_ENTROPY_GRAD=True,
    HAS_SOFTCAP=True, HAS_D_LOGP=True, HAS_D_ENTROPY=True, HAS_D_LSE=True,
    HAS_TEACHER=True, DISTILL_KIND=2, OWN_TEMP=True,
)


def variants() -> dict[str, str]:
    """name -> PTX of each variant the tests look at."""
    no_targets = dict(FORWARD_FLAGS, HAS_TARGETS=False, HAS_CE=False, STORE_LOGP=False, FUSED_GRAD=False)
    return {
        "forward-all-bf16": _forward_ptx(FORWARD_FLAGS, "bf16"),
        "forward-all-fp16": _forward_ptx(FORWARD_FLAGS, "fp16"),
        "forward-all-fp32": _forward_ptx(FORWARD_FLAGS, "fp32"),
        "forward-no-targets-no-grad": _forward_ptx(no_targets),
        "forward-ce-only": _forward_ptx(CE_ONLY),
        **{
            f"forward-distill-{kind}": _forward_ptx(
                dict(FORWARD_FLAGS, HAS_TEACHER=True, DISTILL_KIND=k, OWN_TEMP=True)
            )
            for k, kind in enumerate(("forward_kl", "reverse_kl", "jsd"))
        },
        "forward-policy": _forward_ptx(
            dict(FORWARD_FLAGS, HAS_POLICY=True, HAS_OLD=True, HAS_IW=True, KL_EST=3, KL_IS_CORR=True)
        ),
        "backward-all": _compile(head.head_backward_kernel, BACKWARD_POINTERS, BACKWARD_FLAGS),
        "scale": _compile(head.scale_grad_kernel, dict(grad_ptr="bf16", scale_ptr="fp32"), dict(BLOCK_V=2048)),
    }


if __name__ == "__main__":
    json.dump(variants(), sys.stdout)
