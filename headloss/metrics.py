"""Step metrics from many head-loss calls, kept on the device until someone logs them.

A training step is often several micro-batches (gradient accumulation) on several data-parallel
ranks. Each call's metrics are means over *its* tokens, and with ``num_items_in_batch`` its
``loss`` is a share of the step's loss, not a mean. :class:`MetricsAccumulator` turns them into
the step's values:

* token means (``ce``, ``z_loss``, ``entropy``, ``token_accuracy``, ``kl``, ``clip_ratio/*_mean``,
  ...) are weighted by each call's ``n_tokens``, so uneven micro-batches count per token;
* ``loss`` is the summed loss over the summed tokens (with ``num_items_in_batch`` given to
  :meth:`update`, the call's loss times it; without, its mean times its tokens);
* names ending in ``min`` / ``max`` are the smallest / largest over calls and ranks (calls without
  tokens are left out);
* ``n_tokens`` is the total.

:meth:`compute` lists them in headloss.plan.METRIC_ORDER (a call's own order), renamed and prefixed.

:meth:`update` adds a call with 3 small device ops (3 more per kind of min / max metric, and one compare)
and no host sync; :meth:`compute` reduces across the process group with one ``all_gather`` and reads
everything with one host sync.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .plan import in_metric_order

TRL_NAMES: dict[str, str] = {"token_accuracy": "mean_token_accuracy", "n_tokens": "num_tokens"}
"""headloss metric names -> TRL's, where they differ (the policy metrics already use TRL's names)."""

_SPECIAL = ("loss", "n_tokens")


def _kind(name: str) -> str:
    if name.endswith("min"):
        return "min"
    if name.endswith("max"):
        return "max"
    return "mean"


def _scalar(value: torch.Tensor) -> torch.Tensor:
    """A one-element metric as a 0-d tensor (headloss's are already)."""
    return value if value.dim() == 0 else value.reshape(())


def _denominator(num_items, reduction: str, device) -> torch.Tensor | float | None:
    """What a call's loss is multiplied by before it is summed: None (its own tokens), 1.0 (a summed loss), a
    number, or a one-element tensor on ``device`` (a CPU tensor read as a number: no copy that would wait)."""
    if reduction == "sum":
        return 1.0
    if num_items is None:
        return None
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"num_items_in_batch: expected a number or a one-element tensor, got shape "
                             f"{tuple(num_items.shape)}")
        if num_items.device != device and num_items.device.type == "cpu":
            return float(num_items)
        return _scalar(num_items.detach()).to(device)
    if isinstance(num_items, bool) or not hasattr(num_items, "__float__"):  # (a number, numpy's included)
        raise TypeError(f"num_items_in_batch: expected a number or a one-element tensor, got "
                        f"{type(num_items).__name__}")
    return float(num_items)


class MetricsAccumulator:
    """Token-weighted step metrics across calls (micro-batches) and data-parallel ranks.

    Args:
        names: rename metrics when computing (e.g. :data:`TRL_NAMES`); others keep their name.
        group: a ``torch.distributed`` process group to reduce over at :meth:`compute` (default:
            the world when ``torch.distributed`` is initialised, else no reduction). ``False``:
            never reduce.
        prefix: prepended to every computed name (e.g. ``"train/"``).

    Use::

        acc = MetricsAccumulator()
        for batch in micro_batches:
            out = headloss.head_loss(logits, labels, spec, num_items_in_batch=n)
            out.loss.backward()
            acc.update(out, num_items_in_batch=n)
        if step % log_every == 0:
            log(acc.compute())   # one collective, one sync; resets
    """

    def __init__(self, names: Mapping[str, str] | None = None, group=None, prefix: str = "") -> None:
        self.names = dict(names or {})
        self.group = group
        self.prefix = prefix
        self.reset()

    def reset(self) -> None:
        self._keys: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None = None
        self._loss_sum: torch.Tensor | None = None  # [1] fp64
        self._weighted: torch.Tensor | None = None  # [tokens, token-weighted means...] fp64
        self._mins: torch.Tensor | None = None
        self._maxs: torch.Tensor | None = None
        self._ones: dict = {}  # a constant 1 by (dtype, device)
        self.calls = 0

    def _start(self, n_means: int, n_mins: int, n_maxs: int, device) -> None:
        """The running values, on the first call's device: separate tensors of one dimension (a compiled
        update loses its in-place add into a view kept across calls, and into a 0-d fp64 tensor of an fp32
        value: torch 2.13's aot_eager), ordinary ones even where the first call runs under inference mode."""
        f64 = dict(dtype=torch.float64, device=device)
        with torch.inference_mode(False):
            self._loss_sum = torch.zeros(1, **f64)
            self._weighted = torch.zeros(1 + n_means, **f64)
            self._mins = torch.full((n_mins,), float("inf"), **f64) if n_mins else None
            self._maxs = torch.full((n_maxs,), float("-inf"), **f64) if n_maxs else None

    def _one(self, like: torch.Tensor) -> torch.Tensor:
        """A constant 1 of ``like``'s dtype and device (stacked with a call's means: one dtype, one kernel)."""
        key = (like.dtype, like.device)
        one = self._ones.get(key)
        if one is None:
            with torch.inference_mode(False):
                one = self._ones[key] = torch.ones((), dtype=like.dtype, device=like.device)
        return one

    def update(self, out, num_items_in_batch: int | float | torch.Tensor | None = None,
               reduction: str = "mean") -> None:
        """Add one call's metrics (a HeadLossOutput, or its ``metrics`` dict).

        ``num_items_in_batch``: what the call divided its summed loss by (None: its own tokens).
        ``reduction``: the spec's; with ``"sum"`` the loss is already a sum.
        """
        metrics = out.metrics if hasattr(out, "metrics") else out
        if not isinstance(metrics, Mapping):
            raise TypeError(f"out: expected a HeadLossOutput or its metrics dict, got {type(out).__name__}")
        if "n_tokens" not in metrics or "loss" not in metrics:
            raise ValueError("out: expected headloss metrics with 'loss' and 'n_tokens'")
        bad = [name for name, value in metrics.items() if not isinstance(value, torch.Tensor) or value.numel() != 1]
        if bad:
            raise ValueError(f"out: metric {bad[0]!r} is not a one-element tensor (a headloss call's metrics are)")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
        keys = tuple(sorted(n for n in metrics if n not in _SPECIAL))
        means = tuple(n for n in keys if _kind(n) == "mean")
        mins = tuple(n for n in keys if _kind(n) == "min")
        maxs = tuple(n for n in keys if _kind(n) == "max")
        if self._keys is not None and self._keys != (means, mins, maxs):
            raise ValueError(
                f"out: metrics {sorted(keys)} differ from the earlier calls' "
                f"{sorted(self._keys[0] + self._keys[1] + self._keys[2])}; call compute() or reset() between specs"
            )
        tokens, loss = _scalar(metrics["n_tokens"]), _scalar(metrics["loss"])
        denom = _denominator(num_items_in_batch, reduction, loss.device)  # (checked before any state changes)
        self._keys = (means, mins, maxs)
        with torch.no_grad():  # (the values are read, never differentiated)
            if self._weighted is None:
                self._start(len(means), len(mins), len(maxs), loss.device)
            # [1, means...] (one stack in the metrics' dtype) times the call's tokens, added in fp64: [tokens,
            # token-weighted means...]; then the loss times its weight
            values = [_scalar(metrics[n]) for n in means]
            self._weighted.addcmul_(torch.stack([self._one(values[0] if values else loss), *values]), tokens)
            if denom is None:
                self._loss_sum.addcmul_(loss, tokens)
            elif isinstance(denom, torch.Tensor):
                self._loss_sum.addcmul_(loss, denom)
            else:
                self._loss_sum.add_(loss, alpha=denom)
            if mins or maxs:
                has = tokens > 0  # a call without tokens leaves the min / max as they were
                for names, state, empty, pick in ((mins, self._mins, float("inf"), torch.minimum),
                                                   (maxs, self._maxs, float("-inf"), torch.maximum)):
                    if names:
                        picked = torch.where(has, torch.stack([_scalar(metrics[n]) for n in names]), empty)
                        pick(state, picked, out=state)
        self.calls += 1

    def _group(self):
        if self.group is False:
            return None
        if not (dist.is_available() and dist.is_initialized()):
            if self.group is not None:
                raise RuntimeError("group: given, but torch.distributed is not initialised")
            return None
        return self.group if self.group is not None else dist.group.WORLD

    def compute(self, reset: bool = True) -> dict[str, float]:
        """The step's metrics as floats: one all_gather over the group and one host sync. Every rank
        of the group must call it; a rank without calls takes part in the collective, contributes
        nothing and gets ``{}``. Metrics with no token anywhere are NaN."""
        group = self._group()
        if self._keys is None and group is None:
            if reset:
                self.reset()
            return {}
        means, mins, maxs = self._keys if self._keys is not None else ((), (), ())
        packed = self._packed(means, mins, maxs)
        if group is not None:
            packed = self._all_gather(packed, group, means, mins, maxs)
        values = packed.tolist()
        if reset:
            self.reset()
        if not values:
            return {}
        loss_sum, tokens = values[0], values[1]
        out: dict[str, float] = {}
        nan = float("nan")
        out["loss"] = loss_sum / tokens if tokens > 0 else nan
        out["n_tokens"] = tokens
        offset = 2
        for i, name in enumerate(means):
            out[name] = values[offset + i] / tokens if tokens > 0 else nan
        offset += len(means)
        for i, name in enumerate(mins):
            v = values[offset + i]
            out[name] = v if v != float("inf") else nan
        offset += len(mins)
        for i, name in enumerate(maxs):
            v = values[offset + i]
            out[name] = v if v != float("-inf") else nan
        return {self.prefix + self.names.get(k, k): v for k, v in in_metric_order(out).items()}

    def _packed(self, means, mins, maxs) -> torch.Tensor:
        if self._weighted is None:
            return torch.zeros(0, dtype=torch.float64)
        parts = [self._loss_sum, self._weighted]
        if mins:
            parts.append(self._mins)
        if maxs:
            parts.append(self._maxs)
        return torch.cat(parts)

    def _all_gather(self, packed: torch.Tensor, group, means, mins, maxs) -> torch.Tensor:
        """One collective of a fixed-size row per rank ([width, values..., padding]: every rank sends
        the same size whatever it holds, so a mismatch is an error here, never a hang), then the
        reduction locally. A rank without calls sends width 0 and counts for nothing."""
        world = dist.get_world_size(group)
        backend = dist.get_backend(group)
        device = torch.device("cpu")
        if backend == "nccl":  # the accumulated tensors' GPU (this rank's), else the current one
            device = packed.device if packed.device.type == "cuda" else \
                torch.device("cuda", torch.cuda.current_device())
        width = packed.numel()
        if width + 2 > _ROW:
            raise ValueError(f"MetricsAccumulator: {width} values exceed the {_ROW - 2} one row holds")
        names = zlib.crc32("\0".join(means + ("|",) + mins + ("|",) + maxs).encode()) if width else 0
        row = torch.zeros(_ROW, dtype=torch.float64, device=device)
        row[0] = width
        row[1] = names
        row[2: 2 + width] = packed.to(device)
        parts = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(parts, row, group=group)
        gathered = torch.stack(parts)
        held = gathered[gathered[:, 0] > 0]
        if held.shape[0] == 0:
            return torch.zeros(0, dtype=torch.float64)
        if len(set(held[:, 0].tolist())) > 1 or len(set(held[:, 1].tolist())) > 1 or (
                width and float(names) != float(held[0, 1])):
            raise RuntimeError(
                "MetricsAccumulator.compute: ranks hold different metric sets (each rank must "
                "accumulate calls of the same spec, or none)"
            )
        if width == 0:  # no calls here: the names are unknown on this rank, which returns {}
            return torch.zeros(0, dtype=torch.float64)
        body = held[:, 2: 2 + width]
        n_sum = 2 + len(means)
        parts = [body[:, :n_sum].sum(0)]
        if mins:
            parts.append(body[:, n_sum: n_sum + len(mins)].min(0).values)
        if maxs:
            parts.append(body[:, n_sum + len(mins):].max(0).values)
        return torch.cat(parts)


_ROW = 128
"""Values one rank's row of the collective holds (sums, mins, maxs), plus its width."""
