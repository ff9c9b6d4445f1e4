"""The suite's rule on time, checked over every test file (the rule: tests/conftest.py).

A wall-clock upper bound in a test is a hang limit of at least ``MIN_HANG_S``, never a
speed: a deadline ``clock() + X``, an elapsed time compared from above (``clock() - t <
X``) and the timeout of a wait (``join``, ``wait``, ``communicate``, ``result``, ``get``)
take X a literal of at least 60 s, a name ending in ``HANG_S``, or a wait helper's
``timeout_s`` / ``limit_s`` parameter, whose default and every literal passed for it are
held to the same. Lower bounds (not before a timeout) are behaviour, and the load only
makes them truer: allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MIN_HANG_S = 60
CLOCKS = {("time", "monotonic"), ("time", "time"), ("time", "perf_counter")}
WAITS = {"join", "wait", "communicate", "result", "get"}
HELPER_LIMITS = ("timeout_s", "limit_s")  # a test helper's hang limit, set by its callers


def is_clock(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and (node.func.value.id, node.func.attr) in CLOCKS
    )


def is_hang_limit(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value >= MIN_HANG_S
    if isinstance(node, ast.Name):
        return node.id.endswith("HANG_S") or node.id in HELPER_LIMITS
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("HANG_S")
    return True  # a parameter or an expression: its callers' literals are checked


def is_elapsed(node: ast.AST) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and is_clock(node.left)


def helpers_with_limits(tree: ast.AST) -> set[str]:
    """The test helpers that set a deadline from their ``timeout_s`` / ``limit_s``."""
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any(
            isinstance(inner, ast.BinOp)
            and isinstance(inner.op, ast.Add)
            and is_clock(inner.left)
            and isinstance(inner.right, ast.Name)
            and inner.right.id in HELPER_LIMITS
            for inner in ast.walk(node)
        )
    }


def violations(source: str) -> list[tuple[int, str]]:
    found = []
    tree = ast.parse(source)
    helpers = helpers_with_limits(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in helpers:
            args = node.args.args[len(node.args.args) - len(node.args.defaults) :]
            for arg, default in zip(args, node.args.defaults, strict=True):
                if arg.arg in HELPER_LIMITS and not is_hang_limit(default):
                    found.append((node.lineno, f"{node.name}({arg.arg}={ast.unparse(default)})"))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and is_clock(node.left):
            if not is_hang_limit(node.right):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators, strict=True):
                if (
                    isinstance(op, ast.Lt | ast.LtE)
                    and is_elapsed(left)
                    and not is_hang_limit(right)
                ):
                    found.append((node.lineno, ast.unparse(node)))
                if (
                    isinstance(op, ast.Gt | ast.GtE)
                    and is_elapsed(right)
                    and not is_hang_limit(left)
                ):
                    found.append((node.lineno, ast.unparse(node)))
                left = right
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            limits = ("timeout",) if name in WAITS else HELPER_LIMITS if name in helpers else ()
            for kw in node.keywords:
                if kw.arg in limits and not is_hang_limit(kw.value):
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_checker_finds_each_kind_of_speed_bound() -> None:
    bad = """
deadline = time.monotonic() + 5
assert time.monotonic() - start < 10
assert 3 > time.time() - t0
proc.wait(timeout=30)
def settle(limit_s=10):
    deadline = time.monotonic() + limit_s
settle(limit_s=5)
"""
    assert sorted(line for line, _ in violations(bad)) == [2, 3, 4, 5, 6, 8]
    good = """
deadline = time.monotonic() + HANG_S
deadline = time.monotonic() + 300
assert time.monotonic() - stopped_at >= STALL_S
proc.wait(timeout=60)
tool = Limits(timeout_s=0.5)
def settle(limit_s=HANG_S):
    deadline = time.monotonic() + limit_s
settle(limit_s=600)
"""
    assert violations(good) == []


def test_no_test_bounds_a_duration_by_a_speed() -> None:
    found = [
        f"{path.relative_to(TESTS)}:{line}: {text}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, text in violations(path.read_text())
    ]
    assert not found, "wall-clock bounds below a hang limit:\n" + "\n".join(found)
