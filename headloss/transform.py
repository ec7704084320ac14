"""The logit transform in torch: x = softcap(logit_scale * z) / temperature (spec.LogitTransform).

A leaf (torch and the spec only), shared by the plain-torch reference and by the library's torch
paths; the kernels apply the same transform in Triton (kernels/primitives.py).
"""

from __future__ import annotations

import torch

from .spec import LossSpec


def transformed_logits(logits: torch.Tensor, spec: LossSpec, dtype: torch.dtype,
                       temperature: torch.Tensor | None = None) -> torch.Tensor:
    """softcap(logit_scale * z) / temperature, computed in ``dtype``; ``temperature``: one per row (the
    rows of ``logits``, any shape with their count), with spec.LogitTransform.per_row_temperature."""
    t = spec.transform
    x = logits.to(dtype) * t.logit_scale
    if t.softcap is not None:
        x = t.softcap * torch.tanh(x / t.softcap)
    if temperature is not None:
        return x / temperature.to(dtype).reshape(*x.shape[:-1], 1)
    return x / t.temperature
