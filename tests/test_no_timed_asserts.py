"""Speed belongs to benchmarks, not tests: no test asserts that something took less than a bound.

A wall-clock upper bound fails whenever the machine is busy, and teaches people to rerun until green. A test may
still guard against a hang (a subprocess `timeout=`, pytest-timeout's per-test limit in pyproject.toml, or a poll
loop that gives up), far above the normal time and saying so: a poll loop's `pytest.fail`/`raise` on a clock
comparison must carry the words "hang guard". Lower bounds (`seconds > STALL_S`: it waited at least the timeout)
are behaviour, and allowed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# identifier parts that name a duration or a clock reading: took, t_elapsed, wall_s, seconds, dt, now ...
DURATION_PART = re.compile(r"took|elapsed|seconds|secs|wall|dt|duration|runtime|now", re.IGNORECASE)
CLOCKS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time", "time_ns", "process_time"}


def _is_duration_name(name: str) -> bool:
    return any(DURATION_PART.fullmatch(part) for part in name.split("_") if part)


def _is_timed(node: ast.AST) -> bool:
    """The expression reads a clock (time.monotonic(), perf_counter(), ...) or a duration-named value."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            base = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else "time"
            if name in CLOCKS and base == "time":
                return True
        elif isinstance(sub, ast.Name) and _is_duration_name(sub.id):
            return True
        elif isinstance(sub, ast.Attribute) and _is_duration_name(sub.attr):
            return True
        elif isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) \
                and isinstance(sub.slice.value, str) and _is_duration_name(sub.slice.value):
            return True
    return False


def _upper_bounds_on_time(test: ast.AST) -> bool:
    """Some comparison in `test` says a timed value is below something: `took < 60`, `60 > took`, `a < t < b`."""
    for cmp in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
        operands = [cmp.left, *cmp.comparators]
        for op, left, right in zip(cmp.ops, operands, operands[1:]):
            if isinstance(op, (ast.Lt, ast.LtE)) and _is_timed(left):
                return True
            if isinstance(op, (ast.Gt, ast.GtE)) and _is_timed(right):
                return True
    return False


def _fails(body: list[ast.stmt]) -> bool:
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, (ast.Raise, ast.Assert)):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fail":
            return True
    return False


def _says_hang_guard(body: list[ast.stmt]) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "hang guard" in n.value.lower()
               for stmt in body for n in ast.walk(stmt))


def timing_violations(source: str) -> list[int]:
    """Line numbers of assertions bounding a duration from above, and of clock checks that fail a test without
    saying they guard a hang."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert) and _upper_bounds_on_time(node.test):
            bad.append(node.lineno)
        elif isinstance(node, (ast.If, ast.While)) and _fails(node.body + node.orelse) \
                and not _says_hang_guard(node.body + node.orelse):
            if any(isinstance(n, ast.Compare) and any(map(_is_timed, [n.left, *n.comparators]))
                   for n in ast.walk(node.test)):
                bad.append(node.lineno)
    return sorted(bad)


def test_no_test_asserts_a_wall_clock_bound():
    found = {}
    for path in sorted(TESTS.glob("*.py")):
        lines = path.read_text().splitlines()
        for lineno in timing_violations(path.read_text()):
            found[f"{path.name}:{lineno}"] = lines[lineno - 1].strip()
    assert not found, ("speed belongs in benchmarks/; a hang guard is far above the normal time and says "
                       f"'hang guard': {found}")


@pytest.mark.parametrize("snippet", [
    "took = time.monotonic() - t0\nassert took < 60, f'took {took:.0f}s'",  # the old test_bench_smoke.py
    "assert time.monotonic() - t0 < 30",
    "assert proc.returncode == 130 and time.monotonic() - t0 < 5, err",
    "assert seconds < EXIT_S",
    "assert 0 < r['wall_s'] <= 2.0",
    "assert 10 > elapsed",
    "assert perf_counter() - start <= budget",
    "assert time.perf_counter_ns() - t0 < 5e9",
    "assert step_dt < 1",
    "now = time.monotonic()\nassert now <= deadline",
    "if elapsed > 30:\n    assert False, 'slow'",
    "while not done():\n    if time.monotonic() > deadline:\n        pytest.fail('too slow')",
    "while time.monotonic() < deadline:\n    if done(): break\nelse:\n    raise AssertionError('x')",
])
def test_timed_assertions_are_caught(snippet):
    assert timing_violations(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "assert seconds > STALL_S",                         # a lower bound: it waited at least the timeout
    "assert r['ms'] > 0 and r['tokens_per_s'] > 0",
    "assert 0 < res.steps < 100000",
    "proc.communicate(timeout=300)  # hang guard",
    "if time.monotonic() > deadline:\n    pytest.fail('hang guard: no output line in 600 s')",
    "assert state['step'] >= 3 and state['data_position'] == state['step']",
    "assert len(seen) == n * rounds",
])
def test_behaviour_and_hang_guards_pass(snippet):
    assert not timing_violations(snippet), snippet
