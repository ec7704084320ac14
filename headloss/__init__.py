"""headloss: every loss and metric of an LM head from one Triton pass over the logits.

``head_loss`` on logits, ``linear_head_loss`` on hidden states x lm_head weight (and their module forms
``HeadLoss`` / ``LinearHeadLoss``); a ``LossSpec`` says what to compute (CE, z-loss, DFT, entropy,
distillation, the GRPO family, metrics, outputs); ``scored_rows`` finds a linear_head_loss call's scored
rows ahead of it (no host sync in the call); ``check_pending`` raises a device-side input error found by an
earlier call.
"""

from .api import HeadLoss, LinearHeadLoss, head_loss, linear_head_loss
from .output import HeadLossOutput
from .scored import ScoredRows, scored_rows
from .spec import DFT, CrossEntropy, Distillation, Entropy, LogitTransform, LossSpec, Policy, TokenWeights, ZLoss
from .validation import check_pending

__all__ = [
    "DFT",
    "CrossEntropy",
    "Distillation",
    "Entropy",
    "HeadLoss",
    "HeadLossOutput",
    "LinearHeadLoss",
    "LogitTransform",
    "LossSpec",
    "Policy",
    "ScoredRows",
    "TokenWeights",
    "ZLoss",
    "check_pending",
    "head_loss",
    "linear_head_loss",
    "scored_rows",
]

__version__ = "0.2.0"
