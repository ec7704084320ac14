"""The package's structure limits, read from the code (ast), so that a change that breaks one fails here:

* outside kernels/ (Triton launch signatures), api.py and cli.py (the public doors) and integrations/
  (signatures that mirror upstream's), no function takes more than 8 parameters and none returns a
  literal tuple of more than 4 -- torch.library ops, their fakes and cache keys excepted (flat by
  necessity), as in the project's shape check;
* no module outside kernels/ holds more than 450 lines;
* no class name is defined twice in the package;
* no module but routes.py asks which route runs: nothing compares a route's (or its policy term's, or
  its chunk loop's) name, and nothing tests a policy term or chunk loop by its class.

The few places that exceed a limit today are listed in ALLOWED with the reason; an entry that no longer
exceeds it fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import headloss
from headloss.linear_policy import LOOPS
from headloss.routes import ROUTES

PACKAGE = pathlib.Path(headloss.__file__).parent
PARAMETERS, TUPLE, LINES = 8, 4, 450

ALLOWED = {
    # the body of two torch.library ops (in-graph and beside it), whose schema is flat
    "11 parameters: linear_ops.py _forward_op": "a torch.library op's schema",
    "returns a 8-tuple: linear_ops.py _forward_op": "a torch.library op's outputs",
}


def _is_op(fn: ast.FunctionDef) -> bool:
    decorators = " ".join(ast.unparse(d) for d in fn.decorator_list)
    return ("kernel_op" in decorators or "custom_op" in decorators or "register_fake" in decorators
            or fn.name.startswith("_fake") or fn.name.endswith(("_fake", "_key")))  # (a cache key: flat)


def _violations() -> tuple[set[str], dict[str, list[str]]]:
    found, classes = set(), collections.defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name].append(name)
        if name.startswith("kernels/"):
            continue
        if len(text.splitlines()) > LINES:
            found.add(f"module over {LINES} lines: {name}")
        if name in ("api.py", "cli.py") or name.startswith("integrations/"):
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_op(fn):
                continue
            args = fn.args
            params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
            if len(params) > PARAMETERS:
                found.add(f"{len(params)} parameters: {name} {fn.name}")
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) > TUPLE:
                    found.add(f"returns a {len(node.value.elts)}-tuple: {name} {fn.name}")
    return found, {k: v for k, v in classes.items() if len(v) > 1}


def test_functions_and_modules_keep_to_the_limits():
    found, _ = _violations()
    new = sorted(found - set(ALLOWED))
    assert not new, "over a structure limit (tests/test_structure.py says which):\n" + "\n".join(new)
    stale = sorted(set(ALLOWED) - found)
    assert not stale, "within the limits now: drop from ALLOWED:\n" + "\n".join(stale)


def test_every_class_name_is_defined_once():
    _, twice = _violations()
    assert not twice, twice


STRATEGIES = {"PolicyTerm", "EpiloguePolicy", "KernelsPolicy", "KernelsInHeadPolicy", "TorchPolicy", "ChunkLoop",
              "SequenceLoop", "CovarianceLoop", "EntropyGuessLoop"}
PLAIN = {"torch", "fused", "deferred"}  # route names that are also a backend's or a plan mode's
ROUTE_NAMES = ({name for name in ROUTES if name not in PLAIN}
               | {name.split(":", 1)[1] for name in ROUTES if ":" in name} | set(LOOPS)) - PLAIN - {"rows"}
ASKED_NAMES = {"route", "chosen", "loop"}  # route.name, loop.name
ASKED_ATTRS = {"term", "loop"}  # chosen.term.name, run.loop.name


def _asks_a_route(node: ast.AST) -> bool:
    """A comparison with a route's name (a string of the table, or ``<route | loop | term>.name``), or an
    isinstance test of a policy term or chunk loop class."""
    if isinstance(node, ast.Compare):
        for side in (node.left, *node.comparators):
            if isinstance(side, ast.Constant) and side.value in ROUTE_NAMES:
                return True
            if isinstance(side, ast.Attribute) and side.attr == "name":
                base = side.value
                if isinstance(base, ast.Attribute) and base.attr in ASKED_ATTRS:
                    return True
                if isinstance(base, ast.Name) and base.id in ASKED_NAMES:
                    return True
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) == 2:
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        return any(getattr(k, "id", getattr(k, "attr", "")) in STRATEGIES for k in kinds)
    return False


def test_nothing_outside_routes_asks_which_route_runs():
    """A route's choices run through the objects it carries (route.term, route.loop): no module compares
    route names or tests a strategy's class (routes.py builds the table, and cli.py prints it)."""
    asked = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in ("routes.py", "cli.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _asks_a_route(node):
                asked.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not asked, "\n".join(asked)


def test_the_route_check_finds_what_it_looks_for():
    """The check above fails on the forms it forbids (so it cannot pass by missing them)."""
    for source in ('route.name == "deferred+kernels"', 'chosen.loop.name in ("covariance",)',
                   "isinstance(run.loop, SequenceLoop)", 'kind == "entropy-guess"'):
        assert any(_asks_a_route(node) for node in ast.walk(ast.parse(source))), source
    for source in ('backend == "torch"', "plan.mode == 'fused'", "isinstance(t, torch.Tensor)"):
        assert not any(_asks_a_route(node) for node in ast.walk(ast.parse(source))), source


def test_the_limits_check_finds_what_it_looks_for(tmp_path, monkeypatch):
    """A wide function, a long tuple return and a long module are found (so the limits test can fail)."""
    package = tmp_path / "pkg"
    (package / "kernels").mkdir(parents=True)
    (package / "wide.py").write_text("def f(a, b, c, d, e, f, g, h, i):\n    return (a, b, c, d, e)\n")
    (package / "long.py").write_text("x = 1\n" * (LINES + 1))
    (package / "kernels" / "k.py").write_text("def k(a, b, c, d, e, f, g, h, i):\n    return (a, b, c, d, e)\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", package)
    found, _ = _violations()
    assert found == {"9 parameters: wide.py f", "returns a 5-tuple: wide.py f", f"module over {LINES} lines: long.py"}
