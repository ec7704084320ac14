"""Every kernel variant that real calls launch compiles for sm_90 (Hopper), here, without a GPU.

The interpreter runs the kernels' Python; it does not type-check them the way the compiler does
(globals, loop-carried types, constexpr use, named-tuple arguments). tests/kernels/compile_sm90.py
intercepts the launches of real calls and runs Triton's real front end and backend down to PTX in
a subprocess without the interpreter, so a kernel that cannot compile fails in CI, not on the GPU.

The fast tier compiles FAST, variants that together launch every kernel (each compiles at least
once, the head kernel with every SFT term); the slow tier every variant, one test each, and the
checks of which kernels each mode launches and what a term adds to the PTX.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_sm90.py")
VARIANTS = ("ce-only", "all-bf16", "all-fp16", "all-fp32", "entropy-metric-no-targets", "deferred-all",
            "shift-labels", "distill-forward_kl", "distill-reverse_kl", "distill-jsd", "policy-token",
            "policy-sequence", "policy-batched", "linear-policy", "linear-fused", "linear-deferred",
            "sharded-all", "sharded-deferred", "sharded-policy", "sharded-linear", "sharded-distill-forward_kl",
            "sharded-distill-reverse_kl", "sharded-distill-jsd", "policy-gspo-batched", "linear-gspo",
            "topk-renormalized-reverse_kl", "topk-rest-jsd", "topk-verl-deferred-softcap", "token-k3", "sharded-topk",
            "topk-validated", "token-validated", "sharded-topk-rest", "topk-rest-deferred", "row-temperature",
            "row-temperature-deferred", "sharded-row-temperature-jsd", "linear-row-temperature", "teacher-probs",
            "sharded-teacher-probs-jsd", "topk-probs", "token-weights", "token-weights-deferred",
            "policy-token-weights", "policy-gspo-token-weights",
            "linear-token-weights")
# every kernel tests/kernels/compile_sm90.py intercepts
KERNELS = {"prepare_kernel", "head_kernel", "head_backward_kernel", "finish_kernel", "scale_grad_kernel",
           "shard_stats_kernel", "merge_stats_kernel", "shard_jsd_kernel", "sequence_extremes_kernel",
           "extremes_finish_kernel", "policy_sequence_kernel", "policy_objective_finish_kernel",
           "check_teacher_kernel"}
# the fast tier's variants: every SFT term and transform; the lm_head's chunks with the deferred policy
# kernels; the token-level policy epilogue with the sequence extremes; the vocab-parallel JSD's kernels;
# a top-k teacher with its values checked on the device
FAST = ("all-bf16", "linear-gspo", "linear-policy", "sharded-distill-jsd", "topk-validated")
# compile_sm90.py's variants restricted to those named in argv
SUBSET = ("import json, sys; import compile_sm90 as c; "
          "c.VARIANTS = {name: c.VARIANTS[name] for name in sys.argv[1:]}; json.dump(c.variants(), sys.stdout)")


@pytest.fixture(scope="module")
def ptx(request) -> dict[str, dict[str, str]]:
    """{variant: {kernel: ptx}}, in one subprocess: FAST's variants when the session runs no other test of
    this module that takes them (the fast tier), every variant otherwise."""
    selected = [item for item in request.session.items
                if item.path == request.path and "ptx" in getattr(item, "fixturenames", ())]
    fast_only = all(item.originalname == "test_every_kernel_compiles_in_the_fast_variants" for item in selected)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join((str(SCRIPT.parent.parent.parent), str(SCRIPT.parent),
                                         env.get("PYTHONPATH", "")))
    command = [sys.executable, "-c", SUBSET, *FAST] if fast_only else [sys.executable, str(SCRIPT)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_every_kernel_compiles_in_the_fast_variants(ptx):
    compiled = set()
    for name in FAST:
        assert ptx[name], f"{name}: no launch recorded"
        for kernel, code in ptx[name].items():
            assert f".entry {kernel}" in code, f"{name}: {kernel} has no entry point"
            compiled.add(kernel)
    assert compiled == KERNELS


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_every_launched_kernel_compiles(ptx, name):
    kernels = ptx[name]
    assert kernels, f"{name}: no launch recorded"
    for kernel, code in kernels.items():
        assert f".entry {kernel}" in code, f"{name}: {kernel} has no entry point"


@pytest.mark.slow
def test_each_mode_launches_the_kernels_it_should(ptx):
    # on one device one of the head kernel's programs prepares the call: no prepare launch
    assert set(ptx["ce-only"]) == {"head_kernel", "scale_grad_kernel"}
    assert set(ptx["deferred-all"]) == {"head_kernel", "head_backward_kernel"}
    assert "prepare_kernel" not in ptx["policy-token"]
    assert set(ptx["linear-fused"]) == {"prepare_kernel", "head_kernel", "finish_kernel", "scale_grad_kernel"}
    # vocab-parallel on the logits, the student's statistics alone: the head kernel prepares and merges each row's
    assert set(ptx["sharded-all"]) == {"shard_stats_kernel", "head_kernel", "scale_grad_kernel"}
    assert "merge_stats_kernel" in ptx["sharded-topk-rest"] and "merge_stats_kernel" in ptx["sharded-linear"]
    assert "shard_stats_kernel" in ptx["sharded-linear"]
    assert {"shard_stats_kernel", "head_backward_kernel"} <= set(ptx["sharded-deferred"])
    assert "shard_jsd_kernel" in ptx["sharded-distill-jsd"]
    # deferred mode's policy term: two launches (one per chunk of whole sequences on the lm_head, for d rows)
    for name in ("policy-gspo-batched", "linear-gspo"):
        assert {"policy_sequence_kernel", "policy_objective_finish_kernel"} <= set(ptx[name]), name


@pytest.mark.slow
def test_unrequested_terms_are_compiled_out_of_the_ptx(ptx):
    full, ce_only = ptx["all-bf16"]["head_kernel"], ptx["ce-only"]["head_kernel"]
    # fewer global stores (no entropy / argmax / per-token outputs) and much less code
    assert ce_only.count("st.global") < full.count("st.global")
    assert len(ce_only) < 0.8 * len(full)
    # the softcap's tanh costs an extra exp2 per element in both passes
    assert full.count("ex2.approx") > ce_only.count("ex2.approx")


KEYED = """
import hashlib, triton
import headloss.layouts as layouts
from headloss.kernels import launch, sparse
kernel = sparse.check_teacher_kernel
own = triton.jit(kernel.fn).cache_key  # Triton's key of the same source: blind to TEACHER_KEYS.N's value
launch.keyed(kernel)
assert kernel.cache_key == hashlib.sha256((own + layouts.views_fingerprint()).encode()).hexdigest()
before = layouts.views_fingerprint()
layouts._VIEWED["TEACHER_KEYS"] = layouts._VIEWED["TEACHER_KEYS"]._replace(N=5)
assert layouts.views_fingerprint() != before
print("keyed")
"""


def test_the_layouts_positions_key_every_kernel_binary():
    """Triton keys a binary by the kernel's source and the constexpr globals read by name, not by the
    positions read through the layouts' kernel views (module attributes); kernels.launch.keyed adds
    their fingerprint to the key, so a changed position recompiles instead of reusing a cached binary
    built with the old one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", KEYED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "keyed" in done.stdout, done.stderr[-2000:]
