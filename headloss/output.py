"""The one output type of every headloss entry point."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class HeadLossOutput:
    """What a head-loss call returns; always this type, unrequested fields are ``None``.

    loss              scalar (reduction mean/sum) or per-token [N] / [B, T] (reduction none)
    metrics           detached device scalars: ``loss``, ``n_tokens`` and, when present,
                      ``ce``, ``nll`` (with label smoothing), ``z_loss`` (mean lse**2),
                      ``entropy``, ``token_accuracy``, ``distill/divergence``,
                      ``distill/teacher_entropy``, ``distill/top1_agreement`` -- means over
                      non-ignored tokens, each term unweighted -- and with a policy term TRL's
                      ``kl``, ``clip_ratio/{low_mean,low_min,high_mean,high_max,region_mean}``,
                      ``ratio/{mean,min,max}``, ``logprob/mean`` (see headloss.policy)
    predicted_tokens  int64 argmax of the transformed logits, -1 at ignored positions
    logprobs          fp32 log p(target), 0 at ignored positions
    lse               fp32 logsumexp of the transformed logits, 0 at ignored positions
    token_loss        fp32 combined per-token loss (before reduction), 0 at ignored positions
    entropy           fp32 per-token entropy, 0 at ignored positions

    Per-token tensors are shaped like the targets. They are detached unless the spec sets
    ``differentiable_outputs``.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    predicted_tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    token_loss: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def metrics_as_floats(self) -> dict[str, float]:
        """Host copies of the metrics, for logging: one device sync for all of them."""
        if not self.metrics:
            return {}
        names = list(self.metrics)
        values = torch.stack([self.metrics[n].detach().double() for n in names]).cpu().tolist()
        return dict(zip(names, values))
