"""headloss: every loss and metric of an LM head from one Triton pass over the logits."""

from .api import HeadLoss, head_loss
from .output import HeadLossOutput
from .plan import KernelPlan, compile_plan
from .reference import reference_head_loss
from .spec import CrossEntropy, Entropy, LogitTransform, LossSpec, ZLoss

__all__ = [
    "CrossEntropy",
    "Entropy",
    "HeadLoss",
    "HeadLossOutput",
    "KernelPlan",
    "LogitTransform",
    "LossSpec",
    "ZLoss",
    "compile_plan",
    "head_loss",
    "reference_head_loss",
]

__version__ = "0.1.0"
