"""The modules of serve/ import each other without a cycle, counting imports inside functions too
(a cycle hidden in a function is still two modules that cannot be understood, or tested, apart)."""
from __future__ import annotations

import ast
from pathlib import Path

SERVE = Path(__file__).resolve().parents[1] / "serve"


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(path: Path) -> set[str]:
    """The serve modules ``path`` imports at run time, anywhere in the file."""
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "deltafleet.serve":
                out |= {a.name for a in node.names}
            elif node.module.startswith("deltafleet.serve."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("deltafleet.serve.")}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes, or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"a"}}) == ["a", "a"]


def test_serve_modules_import_each_other_without_a_cycle():
    graph = {p.stem: _imports(p) - {p.stem} for p in SERVE.glob("*.py")}
    assert len(graph) > 10 and graph["engine"] >= {"scheduler", "request"}
    assert _cycle(graph) is None, f"import cycle in serve/: {' -> '.join(_cycle(graph))}"


def test_the_leaf_modules_import_no_other_serve_module():
    """Requests, sampling, detokenizing, the delta cache, a variant's deltas, the KV block pool, paged
    attention's RoPE-and-cache-write kernel, the compiled-kernel helper, the host-to-device copies and
    tool calls are leaves: anything may import them, they import nothing of serve/ (sampling uses the
    helper and the copies, paged attention the kernel, themselves leaves)."""
    for leaf in ("request", "detokenize", "cache", "delta", "kv", "rope_cache", "fuse", "transfer", "tools"):
        assert _imports(SERVE / f"{leaf}.py") == set(), leaf
    assert _imports(SERVE / "sampling.py") == {"fuse", "transfer"}
    assert _imports(SERVE / "attention.py") == {"rope_cache"}
    # structured output: its errors are the request's, a tool call's format is tools'
    assert _imports(SERVE / "grammar.py") == {"request", "tools"}
    assert "engine" not in _imports(SERVE / "scheduler.py")
