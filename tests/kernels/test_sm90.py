"""Every kernel variant that real calls launch compiles for sm_90 (Hopper), here, without a GPU.

The interpreter runs the kernels' Python; it does not type-check them the way the compiler does
(globals, loop-carried types, constexpr use, named-tuple arguments). tests/kernels/compile_sm90.py
intercepts the launches of real calls and runs Triton's real front end and backend down to PTX in
a subprocess without the interpreter, so a kernel that cannot compile fails in CI, not on the GPU.
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
            "sharded-distill-reverse_kl", "sharded-distill-jsd")


@pytest.fixture(scope="module")
def ptx() -> dict[str, dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SCRIPT.parent.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", VARIANTS)
def test_every_launched_kernel_compiles(ptx, name):
    kernels = ptx[name]
    assert kernels, f"{name}: no launch recorded"
    for kernel, code in kernels.items():
        assert f".entry {kernel}" in code, f"{name}: {kernel} has no entry point"


def test_each_mode_launches_the_kernels_it_should(ptx):
    # on one device the head kernel's program 0 prepares the call: no prepare launch
    assert set(ptx["ce-only"]) == {"head_kernel", "scale_grad_kernel"}
    assert set(ptx["deferred-all"]) == {"head_kernel", "head_backward_kernel"}
    assert "prepare_kernel" not in ptx["policy-token"]
    assert set(ptx["linear-fused"]) == {"prepare_kernel", "head_kernel", "finish_kernel", "scale_grad_kernel"}
    assert set(ptx["sharded-all"]) == {"prepare_kernel", "shard_stats_kernel", "merge_stats_kernel", "head_kernel",
                                       "scale_grad_kernel"}
    assert "shard_stats_kernel" in ptx["sharded-linear"]
    assert {"shard_stats_kernel", "head_backward_kernel"} <= set(ptx["sharded-deferred"])
    assert "shard_jsd_kernel" in ptx["sharded-distill-jsd"]
    # deferred mode's policy term: two launches (one per chunk of whole sequences on the lm_head, for d rows)
    for name in ("policy-gspo-batched", "linear-gspo"):
        assert {"policy_sequence_kernel", "policy_objective_finish_kernel"} <= set(ptx[name]), name


def test_unrequested_terms_are_compiled_out_of_the_ptx(ptx):
    full, ce_only = ptx["all-bf16"]["head_kernel"], ptx["ce-only"]["head_kernel"]
    # fewer global stores (no entropy / argmax / per-token outputs) and much less code
    assert ce_only.count("st.global") < full.count("st.global")
    assert len(ce_only) < 0.8 * len(full)
    # the softcap's tanh costs an extra exp2 per element in both passes
    assert full.count("ex2.approx") > ce_only.count("ex2.approx")
