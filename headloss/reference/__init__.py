"""Plain-torch reference: the test oracle (run it in float64) and the CPU path when the Triton
interpreter is off. Same inputs and same output type as :func:`headloss.head_loss`.

It shares nothing with the kernels or with headloss.policy but the spec and its logit transform in
torch (headloss.transform, a leaf the library's torch paths use too; the kernels have their own), and
the output type, the metrics' order and the input checks' messages, so that both paths keep the same
promises: every term is written from its definition, every policy objective from its source (TRL, verl).
term is written from its definition, every policy objective from its source (TRL, verl).
"""

from ..transform import transformed_logits
from .head import reference_head_loss

__all__ = ["reference_head_loss", "transformed_logits"]
