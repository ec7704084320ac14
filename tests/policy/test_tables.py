"""headloss.policy_tables: one row per objective, KL estimator, importance-sampling level and loss
type, and every piece that dispatches on them covers every row -- a value without its kernel piece,
its torch formula, its reference formula or its oracle test is an error, never an ``else`` that
computes something else."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import test_oracles
import torch
from conftest import make_logits, make_targets, needs_kernel
from test_oracles import ORACLE_TESTS

from headloss import LossSpec, Policy, head_loss
from headloss import policy_tables as tables
from headloss.kernels import terms
from headloss.plan import compile_plan
from headloss.policy import objectives
from headloss.reference import policy as reference_policy
from headloss.registry import objective_flags
from headloss.spec import PolicyLossType, PolicyObjective


def test_the_spec_takes_exactly_the_tables_values():
    assert set(typing.get_args(PolicyObjective)) == set(tables.OBJECTIVES)
    assert set(typing.get_args(PolicyLossType)) == set(tables.LOSS_TYPES)
    fields = Policy.model_fields
    assert set(typing.get_args(fields["kl_estimator"].annotation)) == set(tables.KL_ESTIMATORS)
    assert set(typing.get_args(fields["importance_sampling"].annotation)) == set(tables.IMPORTANCE_SAMPLING)
    with pytest.raises(ValueError, match="objective"):
        Policy(objective="ppo")


def test_every_objective_has_its_torch_and_reference_formulas_and_a_kernel_piece_when_row_local():
    for name, row in tables.OBJECTIVES.items():
        formulas = objectives.ROW_LOCAL if row.row_local else objectives.STATISTIC
        assert name in formulas, name
        assert name in reference_policy.OBJECTIVES, name
        assert (row.kernel is not None) == row.row_local, name
        if row.row_local:  # its branch in terms._objective, by its code's name
            assert getattr(terms, name.upper()).value == row.kernel
    assert set(objectives.KL_FORMULAS) == set(tables.KL_ESTIMATORS)
    assert set(objectives.SEQUENCE_RATIOS) == set(tables.IMPORTANCE_SAMPLING)


def test_every_objective_has_a_hand_written_oracle_test():
    """An oracle transcribed from the objective's source (TRL or verl), in tests/policy/test_oracles.py."""
    assert set(ORACLE_TESTS) == set(tables.OBJECTIVES)
    for name, tests in ORACLE_TESTS.items():
        assert tests, name
        for test in tests:
            assert callable(getattr(test_oracles, test, None)) and test.startswith("test_"), (name, test)


def test_a_dispatch_table_that_misses_a_value_fails_when_it_is_built():
    with pytest.raises(RuntimeError, match=r"lacks \['gmpo'\]"):
        objectives._covers({"clip": None}, ["clip", "gmpo"], "objective")


def test_asking_the_kernels_for_an_objective_they_lack_is_an_error_naming_it():
    """The deferred kernels' flags of a sequence or batch objective (a route never asks; a new caller
    that did would get this error, not another objective's numbers)."""
    with pytest.raises(ValueError, match="policy.objective: 'gmpo' needs its sequence's or the batch's values"):
        objective_flags(Policy(objective="gmpo", loss_type="grpo"))
    assert objective_flags(Policy(objective="dro", dro_beta=0.1)).OBJECTIVE == tables.OBJECTIVES["dro"].kernel


@needs_kernel
def test_a_kernel_code_without_a_branch_does_not_compile():
    """terms._objective ends in a static assert: a code no branch handles stops the kernel (the
    interpreter raises it; the compiler refuses the variant), never computes another objective."""
    from headloss.kernels.head import PolicyRows, launch_head, prepare
    from headloss.kernels.launch import Geometry
    from headloss.layouts import scratch_size

    plan = compile_plan(LossSpec(cross_entropy=None, policy=Policy()))
    unknown = plan.flags._replace(OBJECTIVE=max(tables.kernel_objectives().values()) + 1)
    broken = dataclasses.replace(plan, flags=unknown)
    logits, ids = make_logits((2, 7)), make_targets((2,), 7)
    rows = torch.empty(2, plan.cols.N)
    geo = Geometry(n_rows=2, n_out=2, V=7, T=2, K=2, shift=0, stride_b=0, stride_t=7, g_stride_b=0, g_stride_t=7,
                   t_stride_b=0, t_stride_t=0, ignore_index=-100, norm=0.0)
    scratch = prepare(ids, None, None, geo, logits.device, None)
    ones = torch.ones(2)
    with pytest.raises(Exception, match="has no kernel piece in terms._objective"):
        launch_head(broken, logits=logits, targets=ids, teacher=None, grad=None, rows=rows, pred=None,
                    policy=PolicyRows(None, None, ones, None, ones), num_items=None, scratch=scratch,
                    loss=torch.empty(()), means=torch.empty(plan.means_size), geo=geo)
    assert scratch.numel() == scratch_size(0)


def test_the_reference_runs_every_objective_of_the_tables():
    """One call per objective on the reference path (each one's values are its oracle test's)."""
    logits, ids = make_logits((2, 4, 11), seed=3), make_targets((2, 4), 11, seed=3)
    for name in tables.OBJECTIVES:
        policy = Policy(objective=name, loss_type="grpo", dro_beta=0.1, cov_ratio=0.3)
        out = head_loss(logits, ids, LossSpec(cross_entropy=None, policy=policy), backend="torch",
                        advantages=torch.tensor([1.0, -1.0]), old_logprobs=torch.full((2, 4), -2.5))
        assert torch.isfinite(out.loss), name
