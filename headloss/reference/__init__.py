"""Plain-torch reference: the test oracle (run it in float64) and the CPU path when the Triton
interpreter is off. Same inputs and same output type as :func:`headloss.head_loss`.

It shares nothing with the kernels or with headloss.policy but the spec (and the output type and
the input checks' messages, so that both paths keep the same promises): every term is written from
its definition, every policy objective from its source (TRL, verl).
"""

from .head import reference_head_loss, transformed_logits

__all__ = ["reference_head_loss", "transformed_logits"]
