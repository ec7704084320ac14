"""Every environment variable headloss reads, in one place.

=============================  =========  ===============================================================
variable                       read       effect
=============================  =========  ===============================================================
``TRITON_INTERPRET=1``         at import  Triton's interpreter: the kernels run on CPU tensors
                                          (``backend="auto"`` then picks them on the CPU too)
``HEADLOSS_VALIDATE``          per call   ``validate=None``'s meaning: ``0`` / ``false`` / ``off`` no
                                          checks, ``sync`` checks in the call, anything else the
                                          default (checked on the device, raised by a later call)
``HEADLOSS_LOG_ROUTES=1``      at import  log every call's route (logger ``headloss.routes``, level INFO,
                                          a handler to stderr added when it has none)
``HEADLOSS_COMPILE_HANDOFF=0``  at import  under torch.compile, save the fused gradient as a graph tensor
                                          (which saved-tensor hooks can copy; Inductor clones it once)
                                          instead of handing it to backward beside the graph
``HEADLOSS_FAST_LAUNCH=0``     at import  every launch through Triton's own launcher (no cached C
                                          launcher; for debugging a launch)
``HEADLOSS_BLOCK_V``,          at import  force the head kernels' vocabulary block and warps (tuning
``HEADLOSS_NUM_WARPS``                    sweeps; ``kernels.launch.LAUNCH_OVERRIDES`` is the same at run time)
``HEADLOSS_DW_GEMM``           at import  the lm_head's weight-gradient accumulation ``dW += g.T @ h`` after the
                                          first chunk: ``auto`` (default: quack-kernels' Hopper GEMM where
                                          it is installed and runs, else torch.addmm), ``cublas`` or
                                          ``quack``; ``dw_gemm.DW_GEMM`` is the same at run time
=============================  =========  ===============================================================
"""

from __future__ import annotations

import logging
import os
import sys


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() not in ("0", "false", "off", "")


def _int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
LOG_ROUTES = _flag("HEADLOSS_LOG_ROUTES", "0")
COMPILE_HANDOFF = _flag("HEADLOSS_COMPILE_HANDOFF", "1")
FAST_LAUNCH = _flag("HEADLOSS_FAST_LAUNCH", "1")
BLOCK_V = _int("HEADLOSS_BLOCK_V")
NUM_WARPS = _int("HEADLOSS_NUM_WARPS")
DW_GEMM_IMPLS = ("auto", "cublas", "quack")
DW_GEMM = os.environ.get("HEADLOSS_DW_GEMM", "auto").strip().lower() or "auto"
if DW_GEMM not in DW_GEMM_IMPLS:
    raise ValueError(f"HEADLOSS_DW_GEMM: expected 'auto', 'cublas' or 'quack', got {DW_GEMM!r}")


def validate_default() -> str:
    """``validate=None`` as HEADLOSS_VALIDATE says, read on each call: ``off``, ``sync`` or ``async``."""
    value = os.environ.get("HEADLOSS_VALIDATE", "1").strip().lower()
    return "off" if value in ("0", "false", "off") else ("sync" if value == "sync" else "async")


_ROUTE_LOG = logging.getLogger("headloss.routes")


def log_route(entry: str, source, route: str) -> None:
    """Under HEADLOSS_LOG_ROUTES=1, log a call's route (logger ``headloss.routes``, INFO; a stderr handler
    added where no handler is set): the entry point, the shape and dtype of its first tensor, the route."""
    if not LOG_ROUTES:
        return
    if not _ROUTE_LOG.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        _ROUTE_LOG.addHandler(handler)
        _ROUTE_LOG.setLevel(logging.INFO)
    _ROUTE_LOG.info("%s %s %s -> %s", entry, list(source.shape), str(source.dtype).removeprefix("torch."), route)
