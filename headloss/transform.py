"""The logit transform in torch: x = softcap(logit_scale * z) / temperature (spec.LogitTransform).

A leaf (torch and the spec only), shared by the plain-torch reference and by the library's torch
paths; the kernels apply the same transform in Triton (kernels/primitives.py).
"""

from __future__ import annotations

import torch

from .spec import LossSpec


def transformed_logits(logits: torch.Tensor, spec: LossSpec, dtype: torch.dtype) -> torch.Tensor:
    """softcap(logit_scale * z) / temperature, computed in ``dtype``."""
    t = spec.transform
    x = logits.to(dtype) * t.logit_scale
    if t.softcap is not None:
        x = t.softcap * torch.tanh(x / t.softcap)
    return x / t.temperature
