"""Where users train: Hugging Face models and Trainer (:mod:`headloss.integrations.transformers`),
TRL's trainers (:mod:`~headloss.integrations.trl`, its distillation trainers
:mod:`~headloss.integrations.trl_distill`), verl's fused head, policy and distillation losses
(:mod:`~headloss.integrations.verl`), Megatron-core's GPTModel (:mod:`~headloss.integrations.megatron`).

Each integration imports its framework lazily; ``import headloss`` never needs them.
"""
