"""Where users train: Hugging Face models and Trainer (:mod:`headloss.integrations.transformers`).

Each integration imports its framework lazily; ``import headloss`` never needs them.
"""
