"""Where users train: Hugging Face models and Trainer (:mod:`headloss.integrations.transformers`),
TRL's trainers (:mod:`~headloss.integrations.trl`), verl's fused head and policy losses
(:mod:`~headloss.integrations.verl`).

Each integration imports its framework lazily; ``import headloss`` never needs them.
"""
