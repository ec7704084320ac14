"""Shared helpers: input generators, the fp64-reference comparison, tolerances.

TRITON_INTERPRET must be set before anything imports triton or headloss (headloss reads it at
import to pick the CPU backend), so it is set here, first -- on a machine without CUDA only: on a
GPU machine the kernels run compiled (tests/test_gpu.py), and the CPU tests still run the kernels
under the interpreter where they pass CPU tensors with backend="triton" only if it is set.
"""

import os

import torch  # noqa: E402  (importing torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import zlib  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from headloss import HeadLossOutput, LossSpec, env, head_loss, linear_head_loss  # noqa: E402
from headloss.kernels.primitives import fast_log1p  # noqa: E402
from headloss.reference import (
    reference_head_loss,  # noqa: E402
    transformed_logits,  # noqa: E402
)

needs_kernel = pytest.mark.skipif(
    not env.INTERPRETER,
    reason="the Triton kernel runs on CPU only under TRITON_INTERPRET=1 (set before import)",
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ("fp32", "bf16", "fp16")

# Values (loss, metrics, per-token outputs) are computed in fp32 from the stored logits, so they
# match the fp64 reference on the same stored values to fp32 accuracy whatever the input dtype.
VALUE_RTOL = 1e-5
# The gradient is stored in the logits' dtype: its error is that dtype's rounding.
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# Per-element floor for gradients that cancel to ~0 (e.g. V = 1: p - (1 - eps) - eps = 0): a few
# fp32 ulps of the O(1) terms that cancel.
GRAD_ATOL = 2e-7

FLOAT_OUTPUTS = ("logprobs", "lse", "token_loss", "entropy")
ALL_OUTPUTS = ("predicted_tokens", *FLOAT_OUTPUTS)

# every term, metric and output, all differentiable (deferred mode)
DIFFERENTIABLE_EVERYTHING = LossSpec(
    cross_entropy={"label_smoothing": 0.1},
    z_loss={"weight": 1e-2},
    entropy={"weight": -0.05},
    token_accuracy=True,
    outputs=ALL_OUTPUTS,
    differentiable_outputs=True,
)


def with_(spec: LossSpec, **changes) -> LossSpec:
    """``spec`` with some fields replaced, validated again (``model_copy`` skips validation)."""
    return LossSpec.model_validate({**dict(spec), **changes})


def seed_of(*parts) -> int:
    """A stable seed from test parameters (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode()) % 100_000


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_logits(shape, dtype=torch.float32, seed=0, scale=3.0) -> torch.Tensor:
    """Random normal logits * scale in ``dtype`` (fresh per seed, never all zero)."""
    logits = (torch.randn(*shape, generator=generator(seed), dtype=torch.float64) * scale).to(dtype)
    assert logits.numel() == 0 or logits.abs().max() > 0
    return logits


def make_targets(token_shape, vocab, seed=0, ignore_frac=0.0, ignore_index=-100) -> torch.Tensor:
    """Random ids in [0, vocab); a fraction of positions (never the first) set to ``ignore_index``."""
    gen = generator(seed + 7919)
    targets = torch.randint(0, vocab, tuple(token_shape), generator=gen)
    if ignore_frac > 0 and targets.numel() > 0:
        ignored = torch.rand(tuple(token_shape), generator=gen) < ignore_frac
        ignored.reshape(-1)[0] = False
        targets = torch.where(ignored, torch.full_like(targets, ignore_index), targets)
    return targets


def token_weights(token_shape, seed: int) -> torch.Tensor:
    """Fixed random fp64 weights per token: a non-uniform upstream gradient."""
    return torch.rand(tuple(token_shape), generator=generator(seed + 104729), dtype=torch.float64) + 0.5


def default_objective(spec: LossSpec, token_shape, seed: int = 0) -> Callable[[HeadLossOutput], torch.Tensor]:
    """A scalar to differentiate: the loss (weighted per token for reduction 'none') plus, when the
    spec makes per-token outputs differentiable, every float output times random token weights."""
    weights = {
        name: token_weights(token_shape, seed + i) for i, name in enumerate(("loss", *FLOAT_OUTPUTS))
    }

    def objective(out: HeadLossOutput) -> torch.Tensor:
        loss = out.loss
        total = (loss * weights["loss"].to(loss.dtype)).sum() if spec.reduction == "none" else loss
        if spec.differentiable_outputs:
            for name in FLOAT_OUTPUTS:
                value = getattr(out, name)
                if value is not None:
                    total = total + (value * weights[name].to(value.dtype)).sum()
            if out.selected_logprobs is not None:  # (a weight per entry: the token's, times the entry's rank)
                k = out.selected_logprobs.shape[-1]
                ranks = torch.linspace(-1.0, 1.0, k, dtype=out.selected_logprobs.dtype)
                total = total + (out.selected_logprobs * weights["logprobs"].to(ranks.dtype)[..., None] * ranks).sum()
        return total

    return objective


@dataclass
class Pair:
    """One kernel call and the fp64 reference on the same stored values, with their gradients."""

    spec: LossSpec
    out: HeadLossOutput
    ref: HeadLossOutput
    grad: torch.Tensor | None  # d objective / d leaf (kernel)
    ref_grad: torch.Tensor | None  # same for the fp64 reference
    leaf: torch.Tensor  # the kernel's leaf tensor (after the call; overwritten by inplace_grad)
    x64: torch.Tensor  # fp64 transformed logits of the input view, [rows, V]
    dtype: torch.dtype


def run_pair(
    leaf: torch.Tensor,
    targets: torch.Tensor | None,
    spec: LossSpec,
    *,
    view: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    objective: Callable[[HeadLossOutput], torch.Tensor] | None = None,
    num_items_in_batch=None,
    inplace_grad: bool = False,
    with_grad: bool = True,
    upstream: float = 1.0,
    inputs: dict[str, torch.Tensor] | None = None,
) -> Pair:
    """Run ``head_loss(view(leaf), backend="triton")`` and ``reference_head_loss`` on
    ``view(leaf.double())``; backpropagate ``upstream * objective(out)`` through both.
    ``inputs``: the terms' per-call inputs (teacher_logits, advantages, ...), upcast for the reference; a spec
    asking for the selected ids' log-probs gets 3 ids per row (-1 among them) where ``inputs`` has none, and
    a student top-k above the vocabulary is cut to it."""
    inputs = dict(inputs or {})
    vocab = view(leaf).shape[-1]
    if "selected_logprobs" in spec.outputs and "selected_ids" not in inputs:
        inputs["selected_ids"] = torch.randint(-1, vocab, (*view(leaf).shape[:-1], 3), generator=generator(5))
    if spec.student_topk is not None and spec.student_topk > vocab:
        spec = spec.model_copy(update={"student_topk": vocab})
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    dtype = leaf.dtype
    leaf64 = leaf.detach().double().requires_grad_(with_grad)
    kleaf = leaf.detach().clone().requires_grad_(with_grad)
    view_in = view(kleaf)
    token_shape = view_in.shape[:-1]
    x64 = transformed_logits(view(leaf64.detach()), spec, torch.float64).reshape(-1, view_in.shape[-1])
    objective = objective or default_objective(spec, token_shape)

    out = head_loss(
        view_in, targets, spec,
        num_items_in_batch=num_items_in_batch, inplace_grad=inplace_grad, backend="triton", **inputs,
    )
    ref = reference_head_loss(view(leaf64), targets, spec, num_items_in_batch=num_items_in_batch, **inputs64)
    grad = ref_grad = None
    if with_grad:
        (upstream * objective(out)).backward()
        ref_objective = upstream * objective(ref)
        if ref_objective.requires_grad:
            ref_objective.backward()
        grad = kleaf.grad
        # a spec with no loss term gives a reference loss that does not depend on the logits
        ref_grad = leaf64.grad if leaf64.grad is not None else torch.zeros_like(leaf64)
    return Pair(spec, out, ref, grad, ref_grad, kleaf, x64, dtype)


def teacher_inputs(spec, logits: torch.Tensor, targets: torch.Tensor | None, seed: int, k: int = 4) -> dict:
    """The teacher a spec's distillation term reads, near the student's ``logits`` [.., V]: its logits,
    its top-``k`` ids and log-probs (a few entries -1), or its log-prob at each target."""
    dist = spec.distillation
    if dist is None:
        return {}
    gen = generator(seed)
    teacher = logits.detach().float() + torch.randn(logits.shape, generator=gen)
    if dist.teacher == "logits":
        return {"teacher_logits": teacher.to(logits.dtype)}
    logprobs = torch.log_softmax(teacher, -1)
    if dist.teacher == "token":
        return {"teacher_logprobs": logprobs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]}
    top = logprobs.topk(min(k, logits.shape[-1]), dim=-1)
    ids = top.indices.clone()
    ids.view(-1, ids.shape[-1])[::3, -1] = -1
    return {"teacher_ids": ids, "teacher_logprobs": top.values}


def row_inputs(spec, token_shape, seed: int) -> dict:
    """The per-row inputs a spec asks the call for: its token weights (in [0, 2)) and its per-row
    temperatures (in [0.5, 1.5)), shaped like the targets."""
    gen = generator(seed)
    out = {}
    if spec.token_weights is not None:
        out["token_weights"] = 2 * torch.rand(token_shape, generator=gen)
    if spec.transform.per_row_temperature:
        out["temperature"] = 0.5 + torch.rand(token_shape, generator=gen)
    return out


def check_packed_row_input(entry: str, spec, name: str, per_sequence, seed: int, vocab: int, hidden: int) -> None:
    """A per-row input (``name``: temperature, token_weights) of rows packed by cu_seqlens, given one per
    sequence [S], per row [N] and [1, N] (``per_sequence(S, gen)`` draws the [S] values), equals the
    padded [S, T] call given [S]: the loss and the entropy metric, logits (``entry``) or the lm_head."""
    gen = generator(seed)
    lengths = [4, 6, 3]
    n, s, tmax = sum(lengths), len(lengths), max(lengths)
    cu = torch.tensor([0, 4, 10, 13], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(s), torch.tensor(lengths))
    pos = torch.cat([torch.arange(k) for k in lengths])
    values = per_sequence(s, gen)
    width = vocab if entry == "logits" else hidden
    rows = torch.randn(n, width, generator=gen) * (3 if entry == "logits" else 1)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.5
    ids = torch.randint(0, vocab, (n,), generator=gen)
    padded = torch.zeros(s, tmax, width)
    padded[seq, pos] = rows
    padded_ids = torch.full((s, tmax), -100)
    padded_ids[seq, pos] = ids

    def call(r, y, given, **kw):
        if entry == "logits":
            return head_loss(r, y, spec, shift=True, **{name: given}, **kw)
        return linear_head_loss(r, weight, y, spec, shift=True, chunk_bytes=4 * vocab * 4, **{name: given}, **kw)

    want = call(padded, padded_ids, values)
    for given in (values, values[seq], values[seq][None]):
        got = call(rows, ids, given, cu_seqlens=cu)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.metrics["entropy"], want.metrics["entropy"], rtol=1e-5, atol=1e-6)


def check_compiled_row_input(entry: str, spec, name: str, draw, seed: int, vocab: int, hidden: int) -> None:
    """torch.compile (fullgraph, aot_eager) of a call with per-row input ``name`` (``draw(gen)`` makes it, for
    [2, 5] targets) as a graph input: the loss and the gradient equal eager's, logits (``entry``) or the
    lm_head."""
    gen = generator(seed)
    y = torch.randint(0, vocab, (2, 5), generator=gen)
    values = draw(gen)
    if entry == "logits":
        rows = torch.randn(2, 5, vocab, generator=gen)

        def call(r, y, v):
            return head_loss(r, y, spec, **{name: v}).loss
    else:
        rows, weight = torch.randn(2, 5, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen)

        def call(r, y, v):
            return linear_head_loss(r, weight, y, spec, chunk_bytes=4 * vocab * 4, **{name: v}).loss
    eager = rows.clone().requires_grad_()
    want = call(eager, y, values)
    want.backward()
    compiled = rows.clone().requires_grad_()
    got = torch.compile(call, backend="aot_eager", fullgraph=True)(compiled, y, values)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled.grad, eager.grad)


def value_atol(x64: torch.Tensor) -> float:
    """Absolute slack of fp32 values that are differences of O(max |x|) quantities (entropy, lse - x)."""
    finite = x64[torch.isfinite(x64)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return 2e-6 * (1.0 + scale)


def assert_close_norm(actual, expected, *, rtol: float, atol: float, name: str) -> None:
    """||actual - expected|| <= rtol * ||expected|| + atol * sqrt(n) (fp64 norms)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.equal(torch.isfinite(a), torch.isfinite(e)), f"{name}: finiteness differs"
    err = float((a - e).norm())
    bound = rtol * float(e.norm()) + atol * math.sqrt(max(e.numel(), 1))
    assert err <= bound, f"{name}: ||err|| = {err:.3e} > {bound:.3e} (||ref|| = {float(e.norm()):.3e})"


def assert_matches_reference(pair: Pair, *, check_grad: bool = True) -> None:
    """Loss, every metric, every per-token output and the gradient agree with the fp64 reference."""
    spec, out, ref = pair.spec, pair.out, pair.ref
    atol = value_atol(pair.x64)
    assert out.loss.dtype == torch.float32
    assert_close_norm(out.loss, ref.loss, rtol=VALUE_RTOL, atol=atol, name="loss")

    assert set(out.metrics) == set(ref.metrics), f"metric names {sorted(out.metrics)} != {sorted(ref.metrics)}"
    for name, value in ref.metrics.items():
        got = out.metrics[name]
        assert got.requires_grad is False, f"metric {name} carries gradient"
        if name == "n_tokens":
            assert int(got) == int(value)
        elif name == "token_accuracy":
            assert abs(float(got) - float(value)) <= 1e-6, f"token_accuracy {float(got)} != {float(value)}"
        else:
            assert_close_norm(got, value, rtol=VALUE_RTOL, atol=atol, name=f"metrics[{name}]")

    for name in ("predicted_tokens", *FLOAT_OUTPUTS):
        got, want = getattr(out, name), getattr(ref, name)
        assert (got is None) == (name not in spec.outputs), f"{name}: present={got is not None}"
        assert (want is None) == (got is None)
        if got is None:
            continue
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        if name == "predicted_tokens":
            assert_predicted_tokens(got, want, pair.x64)
        else:
            assert got.dtype == torch.float32
            assert got.requires_grad == (spec.differentiable_outputs and pair.leaf.requires_grad)
            assert_close_norm(got, want, rtol=VALUE_RTOL, atol=atol, name=name)

    for name in ("selected_logprobs", "topk_logprobs"):  # [.., K] (the top-k's ids: near-ties may swap them)
        got, want = getattr(out, name), getattr(ref, name)
        assert (got is None) == (want is None) == (name not in spec.outputs), name
        if got is not None:
            assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            assert_close_norm(got, want, rtol=VALUE_RTOL, atol=atol, name=name)

    if check_grad and pair.ref_grad is not None:
        assert pair.grad is not None, "no gradient reached the logits"
        assert pair.grad.dtype == pair.dtype
        assert_close_norm(pair.grad, pair.ref_grad, rtol=GRAD_RTOL[pair.dtype], atol=GRAD_ATOL, name="grad")


def assert_predicted_tokens(got: torch.Tensor, want: torch.Tensor, x64: torch.Tensor) -> None:
    """Same ignored positions (-1); elsewhere the kernel's index holds the row maximum."""
    assert got.dtype == torch.int64
    got, want = got.reshape(-1), want.reshape(-1)
    assert torch.equal(got == -1, want == -1), "predicted_tokens: ignored positions differ"
    rows = torch.nonzero(want != -1).reshape(-1)
    if rows.numel():
        picked = x64[rows, got[rows]]
        best = x64[rows].max(dim=-1).values
        assert torch.all(picked >= best - 1e-6 * (1 + best.abs())), "predicted_tokens: not an argmax"
        exact = (got[rows] == want[rows]).double().mean()
        assert exact >= 0.99, f"predicted_tokens: only {float(exact):.2%} equal the fp64 argmax"


def assert_nontrivial(pair: Pair) -> None:
    """Guards against tests that cannot fail: the loss and the gradient are not zero."""
    assert float(pair.ref.loss.detach().abs().sum()) > 0
    assert float(pair.out.loss.detach().abs().sum()) > 0
    if pair.ref_grad is not None:
        assert float(pair.ref_grad.norm()) > 0
        assert float(pair.grad.double().norm()) > 0


def tiered(*axes, ids=None, pairs: bool = True) -> list:
    """The cross product of parametrize axes (each a list of values, or of tuples for an axis of several
    arguments) as ``pytest.param``s, all but a covering subset marked slow: the fast tier runs every
    pair of values of two axes at least once (``pairs=False``: every value of each axis once), the
    slow tier the rest of the product. The subset is greedy and deterministic."""
    import itertools

    grid = list(itertools.product(*(range(len(axis)) for axis in axes)))

    def wanted(case):
        if pairs:
            return {(a, case[a], b, case[b]) for a, b in itertools.combinations(range(len(axes)), 2)}
        return {(a, case[a]) for a in range(len(axes))}

    uncovered = set().union(*(wanted(case) for case in grid))
    fast = set()
    while uncovered:
        best = max(grid, key=lambda case: len(wanted(case) & uncovered))
        fast.add(best)
        uncovered -= wanted(best)
    params = []
    for case in grid:
        values = []
        for axis, i in zip(axes, case):
            value = axis[i]
            values.extend(value if isinstance(value, tuple) else (value,))
        name = "-".join(str(v) for v in values) if ids is None else "-".join(ids[a][i] for a, i in enumerate(case))
        params.append(pytest.param(*values, id=name, marks=() if case in fast else pytest.mark.slow))
    return params


def init_process(rank: int, world: int, port: int, backend: str = "gloo"):
    """This spawned rank's process group on the local ``port``: gloo on the CPU, or NCCL on GPU
    ``rank``. Returns the rank's device."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    return device


def spawn_ranks(fn: Callable, world: int, *args) -> dict:
    """Run ``fn(rank, world, port, *args, results)`` in ``world`` spawned processes (a free local
    port for their process group); returns ``results`` (a dict each rank writes into). A port taken
    by another process between its choice and the group's start (parallel test workers) is chosen
    again, up to three times."""
    import socket

    import torch.multiprocessing as mp

    for attempt in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with mp.Manager() as manager:
            results = manager.dict()
            try:
                mp.spawn(fn, args=(world, port, *args, results), nprocs=world, join=True)
            except mp.ProcessRaisedException as exc:
                if "EADDRINUSE" not in str(exc) or attempt == 2:
                    raise
                continue
            return dict(results)
    raise AssertionError("unreachable")


def torchrun(script: str, out_dir, timeout: int = 900) -> dict:
    """Run ``tests/<script> OUT_DIR`` on 2 processes with torch.distributed.run and return the JSON
    its rank 0 prints after ``RESULT ``; fails with the processes' stderr otherwise."""
    import json
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(tests, script)
    # the script imports its test module, which imports conftest: tests/ on the path, as pytest puts it
    python_path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", path,
                           str(out_dir)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path})
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and found, (f"exit code {done.returncode}, "
                                            f"{'after' if found else 'before'} rank 0 printed its RESULT line\n"
                                            + done.stderr[-3000:])
    return json.loads(found[0][len("RESULT "):])


def end_of_script() -> None:
    """The end of a :func:`torchrun` script: every rank done (a barrier), output flushed, then the process
    leaves without the interpreter's teardown. Left to it, the destruction of a gloo process group's
    and the trainers' threads can abort a rank after its work ("terminate called without an active
    exception", now and then under load), even after destroy_process_group."""
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_sequence_extremes(device, batch: int, length: int, strided: bool, nan: bool, empty: str, seed: int,
                            inf: bool = False) -> None:
    """policy.metrics.extremes on [B, T] rows by its two launches against its torch ops, on ``device``
    (tests/policy, tests/test_gpu.py)."""
    from headloss.policy.metrics import extremes
    from headloss.policy.tokens import PolicyTokens

    gen = torch.Generator(device).manual_seed(seed)
    n = batch * length
    mask = (torch.rand(n, generator=gen, device=device) < 0.7).float()
    if empty == "one":
        mask[:length] = 0
    elif empty == "all":
        mask.zero_()
    ratio = torch.rand(n, generator=gen, device=device) * 2 + 0.1
    if inf:  # every ratio infinite (old log-probs of -inf): the extremes are inf, not fp32's max
        ratio.fill_(math.inf)
    if nan:
        ratio[n // 2] = math.nan
    low = (torch.rand(n, generator=gen, device=device) < 0.3).float()
    high = (torch.rand(n, generator=gen, device=device) < 0.3).float()
    if strided:  # the kernel path's columns of the packed rows
        packed = torch.randn(n, 5, generator=gen, device=device)
        packed[:, 1], packed[:, 3], packed[:, 4] = low, high, ratio
        low, high, ratio = packed[:, 1], packed[:, 3], packed[:, 4]
    means = {name: torch.rand((), generator=gen, device=device)
             for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "ratio/mean")}
    inp = PolicyTokens(advantages=torch.zeros(n, device=device), old_logprobs=None, ref_logprobs=None,
                       importance_weights=None, seq=None, n_slots=batch, n_seq=batch, seq_len=length,
                       num_items_in_batch=None)
    count = mask.sum()
    kernel = extremes(means, ratio, low, high, mask, count, inp, by_kernel=True)
    ops = extremes(means, ratio, low, high, mask, count, inp, by_kernel=False)
    assert kernel.keys() == ops.keys()
    for name, value in kernel.items():
        assert value.dtype == ops[name].dtype == torch.float32, name
        assert torch.equal(value, ops[name]) or (value.isnan() and ops[name].isnan()), (name, value, ops[name])
    if empty == "all":
        assert float(kernel["ratio/min"]) == 1.0 and float(kernel["clip_ratio/low_min"]) == 0.0
    elif nan and mask[n // 2]:
        assert kernel["ratio/min"].isnan()
    elif inf:
        assert float(kernel["ratio/min"]) == math.inf


def check_policy_objective(device, policy, batch: int, length: int, vocab: int, seed: int, *, shift: bool,
                           empty: str = "none", per_token_adv: bool = False, weights: bool = False,
                           rollout: bool = False, logits_dtype=torch.float32, input_dtype=torch.float32) -> None:
    """head_loss of a deferred-mode policy term on [B, T] rows by the route ``deferred+kernels`` (the
    objective, its metrics and d loss / d rows by kernels/policy.py's two launches, inside the head's
    node, reading the inputs as given) against ``deferred+torch`` (policy.objectives), on ``device``:
    the same loss, the same metric names in the same order with the same values, the same gradient
    (tests/policy, tests/test_gpu.py). ``empty``: "one" sequence, "all" of them, or "none" without a
    counted token. The per-token inputs hold NaN at masked tokens (read by neither route) and come in
    ``input_dtype``."""
    from headloss import LossSpec, head_loss
    from headloss.plan import compile_plan

    spec = LossSpec(cross_entropy={"weight": 0.3}, policy=policy)
    if compile_plan(spec).mode != "deferred":  # a row-local objective: deferred for its outputs' gradient
        spec = LossSpec(cross_entropy={"weight": 0.3}, policy=policy, outputs=("logprobs",),
                        differentiable_outputs=True)
    gen = torch.Generator(device).manual_seed(seed)
    rows = length + 1 if shift else length
    base = (torch.randn(batch, rows, vocab, generator=gen, device=device) * 2).to(logits_dtype)
    ids = torch.randint(0, vocab, (batch, length), generator=gen, device=device)
    if not shift and length > 1:
        ids[:, -1] = -100  # an ignored target: a masked token the loss mask does not name
    with torch.no_grad():
        logp = torch.log_softmax(base[:, :length].double(), -1).gather(-1, ids.clamp(min=0)[..., None])[..., 0]
    noise = lambda: torch.randn(batch, length, generator=gen, device=device, dtype=torch.float64)  # noqa: E731
    old = (logp + 0.2 * noise()).float()
    mask = (torch.rand(batch, length, generator=gen, device=device) < 0.8).float()
    if empty == "one":
        mask[batch // 2] = 0
    elif empty == "all":
        mask.zero_()
    adv = torch.randn(batch, length, generator=gen, device=device) if per_token_adv else \
        torch.randn(batch, generator=gen, device=device)
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=(logp + 0.2 * noise()).float(), loss_mask=mask)
    if weights and policy.rollout_is is None:
        inputs["importance_weights"] = torch.rand(batch, length, generator=gen, device=device) + 0.5
    if rollout or policy.rollout_is is not None:
        inputs["rollout_logprobs"] = (old.double() + 0.1 * noise()).float()
    for name, t in list(inputs.items()):
        if name != "loss_mask":
            t = t.to(input_dtype)
            if t.shape == mask.shape:
                t = t.masked_fill(mask == 0, math.nan)
            inputs[name] = t
    results = []
    for route in ("deferred+kernels", "deferred+torch"):
        logits = base.clone().requires_grad_()
        out = head_loss(logits, ids, spec, shift=shift, route=route, **inputs)
        assert out.route == route
        out.loss.backward()
        results.append((out.loss.detach(), dict(out.metrics), logits.grad))
    check_same(results[0], results[1], logits_dtype)
    if empty == "all":
        assert float(results[0][1]["ratio/min"]) == 1.0 and float(results[0][1]["clip_ratio/low_min"]) == 0.0


def check_same(result, expected, logits_dtype) -> None:
    """(loss, metrics, gradient) of a call against another's: values to fp32 accuracy, metric names in
    the same order."""
    (loss, metrics, grad), (loss_t, metrics_t, grad_t) = result, expected
    torch.testing.assert_close(loss, loss_t, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert list(metrics) == list(metrics_t)
    for name, value in metrics.items():
        assert value.dtype == metrics_t[name].dtype, name
        torch.testing.assert_close(value, metrics_t[name], rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)
    scale = float(grad_t.abs().max()) if grad_t.numel() else 0.0
    tol = 1e-5 if logits_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad, grad_t, rtol=tol, atol=tol * max(scale, 1e-6))


def explained_and_demoed(tmp_path, capsys, spec_yaml: str) -> str:
    """``python -m headloss explain`` of a spec written as YAML (its output), after which ``demo`` runs it."""
    from headloss.cli import main

    path = tmp_path / "spec.yaml"
    path.write_text(spec_yaml)
    assert main(["explain", str(path)]) == 0
    text = capsys.readouterr().out
    assert main(["demo", str(path), "--rows", "8", "--vocab", "20"]) == 0
    return text


@triton.jit
def _fast_log1p_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, fast_log1p(x), mask=offs < n)


def fast_log1p_error(device, series_only: bool = False) -> float:
    """Largest relative error of the kernels' fast_log1p against fp64 log1p, over x from just above -1 to
    1e4: dense around 0 (the series), both sides of its 1/16 switch, over [-0.5, 1], and across the log's
    range (``series_only``: the points below the switch)."""
    tiny = torch.logspace(-9, -1, 2000, dtype=torch.float64)
    switch = 0.0625 * (1 + torch.linspace(-1e-3, 1e-3, 201, dtype=torch.float64))
    near = torch.linspace(-0.5, 1.0, 100001, dtype=torch.float64)  # 1 + x in [0.5, 2]: lg2.approx's error is absolute
    x = torch.cat([tiny, -tiny, switch, -switch, near, torch.linspace(-0.9999, 1e4, 20001, dtype=torch.float64)])
    x = x[(x.float() != 0) & ((x.abs() < 0.0625) if series_only else True)]  # (linspace passes through 0)
    x32 = x.float().to(device)
    out = torch.empty_like(x32)
    _fast_log1p_kernel[(triton.cdiv(x32.numel(), 1024),)](x32, out, x32.numel(), BLOCK=1024)
    exact = torch.log1p(x32.double().cpu())
    return float(((out.double().cpu() - exact).abs() / exact.abs()).max())
