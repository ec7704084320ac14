"""The GRPO family of policy objectives: the term of a LossSpec that trains a policy (TRL, verl).

* ``tables``      one row per objective, KL estimator, importance-sampling level and loss type
* ``inputs``      the per-call inputs, checked and flattened to tokens
* ``weights``     aggregation weights (how each loss type averages), the entropy bonus's, rollout weights
* ``objectives``  every objective in torch: per token, and with its sequence and batch statistics
* ``masks``       TRL's off-policy and top-entropy masks, the device-side quantile
* ``metrics``     TRL's and verl's metric names and values

The row-local objectives also run in the kernels (kernels/terms.py for the fused epilogue,
kernels/policy.py over whole sequences); which one a call takes is its route (headloss.routes).
"""
