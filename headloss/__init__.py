"""headloss: every loss and metric of an LM head from one Triton pass over the logits.

``head_loss`` on logits, ``linear_head_loss`` on hidden states x lm_head weight; a ``LossSpec``
says what to compute (CE, z-loss, DFT, entropy, distillation, the GRPO family, metrics, outputs).
"""

from .api import HeadLoss, LinearHeadLoss, head_loss, linear_head_loss
from .output import HeadLossOutput
from .plan import KernelPlan, compile_plan
from .reference import reference_head_loss
from .routes import ROUTES
from .spec import DFT, CrossEntropy, Distillation, Entropy, LogitTransform, LossSpec, Policy, ZLoss
from .validation import check_pending

__all__ = [
    "DFT",
    "CrossEntropy",
    "Distillation",
    "Entropy",
    "HeadLoss",
    "HeadLossOutput",
    "KernelPlan",
    "LinearHeadLoss",
    "LogitTransform",
    "LossSpec",
    "Policy",
    "ROUTES",
    "ZLoss",
    "check_pending",
    "compile_plan",
    "head_loss",
    "linear_head_loss",
    "reference_head_loss",
]

__version__ = "0.2.0"
