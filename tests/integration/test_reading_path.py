"""``benchmarks.reading_path``: how a path of calls is counted (modules opened, returns)."""

from __future__ import annotations

from benchmarks.reading_path import counts, visits


def test_each_function_is_read_once_at_its_first_call():
    calls = [("backend.py", "chunkce_backend"), ("graph/find.py", "find_sites"), ("graph/nodes.py", "function_of"),
             ("graph/find.py", "_read"), ("graph/nodes.py", "function_of"), ("graph/find.py", "find_sites"),
             ("graph/plan.py", "plan_sites"), ("graph/plan.py", "_one")]
    # function_of and find_sites again are not read again; plan's two functions are one visit
    assert visits(calls) == ["backend.py", "graph/find.py", "graph/nodes.py", "graph/find.py", "graph/plan.py"]
    assert counts(calls) == (4, 1, ["backend.py", "graph/find.py", "graph/nodes.py", "graph/plan.py"])


def test_a_path_that_never_comes_back_has_no_returns():
    calls = [("a.py", "f"), ("a.py", "g"), ("b.py", "h"), ("c.py", "i")]
    assert counts(calls) == (3, 0, ["a.py", "b.py", "c.py"])
