"""The fused lm_head's weight-gradient GEMM: ``dW = beta dW + g.T @ h`` of one chunk.

Every chunk after the first adds its share into dW, and cuBLAS's ``addmm`` reads dW back after its main
loop: at the lm_head's chunk sizes that read costs 10-20% of the GEMM. quack-kernels' persistent Hopper
GEMM (CuTe-DSL, an optional dependency: ``pip install quack-kernels``) loads dW in its epilogue while the
next tile's main loop runs. :data:`DW_GEMM` says which one runs (docs/performance.md has the measurements).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch

from . import bounded, env

DW_GEMM_IMPLS = env.DW_GEMM_IMPLS

DW_GEMM = {"impl": env.DW_GEMM}
"""The GEMM of the accumulations (``impl``; HEADLOSS_DW_GEMM at import, settable at run time):

* ``auto`` (default): quack-kernels' where it runs (:func:`quack_runs`: the package importable, a
  Hopper GPU, 16-bit inputs laid out for its TMA loads, a chunk of at least :data:`QUACK_MIN_ROWS` rows,
  no CUDA graph being captured), cuBLAS's ``addmm`` elsewhere, and from the first quack call that raises
  on (a warning, QUACK_FAILED);
* ``cublas``: always ``addmm``;
* ``quack``: quack-kernels' for every accumulation of a CUDA chunk whose operands it takes, at any row
  count and on any GPU quack supports (an ImportError naming this setting where the package is missing).

The first chunk's GEMM writes dW without reading it (beta 0) and stays cuBLAS's."""

QUACK_MIN_ROWS = 640
"""``auto``: chunks of fewer rows accumulate with cuBLAS. At 256 rows quack's GEMM (its pinned config)
ran 1.24 ms against addmm's 0.99 at V 151936 (1.05 against 0.91 at V 128256), at 512 rows 1.25 against
1.24 (1.06 against 0.98); from 640 rows at V 151936 and 768 at 128256 it ran faster (H 4096, one H200,
docs/performance.md)."""

QUACK_CONFIG = dict(tile_m=128, tile_n=192, pingpong=True, cluster_m=2, cluster_n=1, swap_ab=True,
                    is_dynamic_persistent=False, device_capacity=9)
"""quack's GEMM config for the accumulations on Hopper: the config its autotuner picked at 768 x 151936
and 1024 x 128256 (H 4096), and the fastest of eleven configs summed over chunks of 256-1536 rows of
both vocabularies (0.88x addmm's time; quack's untuned default 0.95x). Pinned, so that no call pays the
autotuner (37 s and 5.5 GiB of copies of its operands, dW among them, at the first 768-row chunk of V
151936). Chosen on an H200; the other Hopper parts (H100, H20, GH200) take it unmeasured."""


def add_dw(dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor, beta: float = 1.0) -> None:
    """dw = beta dw + g.T @ h in place (dw in the weight's dtype, or fp32 while accumulating). An
    accumulation (beta 1) goes to quack-kernels' GEMM where :data:`DW_GEMM` and :func:`quack_runs` say so."""
    impl = DW_GEMM["impl"]
    if impl not in DW_GEMM_IMPLS:
        raise ValueError(f"dw_gemm.DW_GEMM['impl']: expected one of {', '.join(DW_GEMM_IMPLS)}, got {impl!r}")
    if beta == 1.0 and impl != "cublas" and quack_runs(impl, dw, g, h) and quack_add(impl, dw, g, h):
        return
    if dw.dtype == g.dtype:
        torch.addmm(dw, g.t(), h, beta=beta, out=dw)
    elif g.is_cuda:
        torch.addmm(dw, g.t(), h, beta=beta, out_dtype=torch.float32, out=dw)
    else:  # the CPU has no mixed-dtype addmm
        torch.addmm(dw, g.t().float(), h.float(), beta=beta, out=dw)


QUACK_FAILED: dict[int | None, str] = {}
"""Devices (by index) where ``auto``'s quack call raised: their accumulations go to cuBLAS from then on."""


def quack_add(impl: str, dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> bool:
    """dw += g.T @ h by quack, on g's device; with ``auto``, False where quack raised (a kernel that does not
    compile or launch on this machine: warned once, and the device recorded in QUACK_FAILED), for cuBLAS to
    take it. quack raises before its launch (quack-kernels 0.6.x), so dw is untouched then; running out of
    memory propagates whatever the setting."""
    try:
        with torch.cuda.device(g.device):
            quack_gemm_add(torch.cuda.get_device_capability(g.device)[0])(g.t(), h, dw)
        return True
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:
        if impl == "quack":
            raise
        QUACK_FAILED[g.device.index] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"headloss: quack-kernels' weight-gradient GEMM failed on {g.device} ({type(exc).__name__}: "
                      f"{exc}); its accumulations run on cuBLAS from now on (HEADLOSS_DW_GEMM=cublas says so "
                      "without trying quack)", RuntimeWarning, stacklevel=3)
        return False


def quack_runs(impl: str, dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether this accumulation goes to quack: a CUDA chunk whose operands :func:`quack_fits`; with
    ``auto`` also of at least QUACK_MIN_ROWS rows, on a Hopper GPU where quack imports and has not failed
    (QUACK_FAILED), outside a CUDA graph's capture (quack compiles a kernel at its first call: about 2 s)."""
    if not g.is_cuda or not quack_fits(dw, g, h):
        return False
    if impl == "quack":
        return True
    return (g.shape[0] >= QUACK_MIN_ROWS and not torch.cuda.is_current_stream_capturing()
            and g.device.index not in QUACK_FAILED and quack_available(g.device.index))


def quack_fits(dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> bool:
    """Operands quack's TMA loads take: g [K, V] and h [K, H] (K > 0) in bf16 or fp16, rows of unit stride
    whose row strides (no shorter than a row: no expanded rows) and addresses are 16-byte multiples; dw [V, H]
    contiguous, in their dtype or fp32."""
    if g.dtype not in (torch.bfloat16, torch.float16) or h.dtype != g.dtype or dw.dtype not in (g.dtype,
                                                                                               torch.float32):
        return False
    if g.shape[0] == 0 or not dw.is_contiguous() or g.stride(1) != 1 or h.stride(1) != 1:
        return False
    if g.stride(0) < g.shape[1] or h.stride(0) < h.shape[1]:
        return False
    return all(t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in (g, h, dw))


@bounded.memoize("dw_gemm.available", 16, "whether quack's GEMM runs on a device (by index): Hopper, quack importable")
def quack_available(index: int | None) -> bool:
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    try:
        quack_gemm_add(9)
    except ImportError:
        return False
    return True


@bounded.memoize("dw_gemm.quack", 4, "quack-kernels' accumulating GEMM by compute capability, imported once")
def quack_gemm_add(major: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """``add(A, B, out)``: out += A @ B by quack-kernels; on Hopper (``major`` 9) at :data:`QUACK_CONFIG`
    through its GEMM's config argument (quack-kernels 0.6.5), elsewhere or where that entry point is not
    found, ``gemm_add_inplace`` at quack's own default config. An ImportError naming the setting where
    quack-kernels does not import."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_add_inplace, gemm_tuned

        fixed = getattr(gemm_tuned, "fn", None)
        pinned = major == 9 and fixed is not None and {"A", "B", "out", "C", "config", "add_to_output"} <= \
            inspect.signature(fixed).parameters.keys()
        config = GemmConfig(**QUACK_CONFIG) if pinned else None
    except Exception as exc:  # (CuTe-DSL raises more than ImportError where its CUDA libraries are missing;
        # a release whose config takes other fields raises here too)
        raise ImportError(f"HEADLOSS_DW_GEMM=quack (dw_gemm.DW_GEMM): quack-kernels is not importable ({exc}); "
                          "pip install 'quack-kernels>=0.6.5,<0.7', or use 'cublas'") from exc
    if pinned:
        def add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
            # (the autotuner's wrapped GEMM, called straight: quack's custom-op layer, which bumps out's
            # version counter, is skipped; out is the loss's own dW buffer, or main_grad, outside autograd)
            fixed(A=a, B=b, out=out, C=None, alpha=1.0, beta=1.0, add_to_output=True, config=config)

        return add

    def add_default(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        gemm_add_inplace(a, b, out, tuned=False)

    return add_default
