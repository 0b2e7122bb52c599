"""The code's shape (issue 54): no import circle inside ``kvoff/`` (function-level imports
included), ``import kvoff`` loads no ``kvoff.tools`` module and never exits, the scheduler does
not import the worker, and no source file in ``kvoff/``, ``cpp/`` or ``cuda/`` passes 1,400
lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from import_graph import import_graph, source_lines

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 1400


def test_no_import_circle_inside_kvoff() -> None:
    graph = import_graph(ROOT)
    assert graph.circles == (), f"import circles: {graph.circles}"


def test_the_graph_sees_a_circle_and_a_function_level_import(tmp_path: Path) -> None:
    """The check above can fail: a circle closed by an import inside a function is found."""
    pkg = tmp_path / "kvoff"
    (pkg / "tools").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "tools" / "a.py").write_text("from kvoff.tools import b\n")
    (pkg / "tools" / "b.py").write_text("def f():\n    from kvoff.tools.a import x\n")
    (pkg / "c.py").write_text("from . import specs\nfrom .tools import a\n")
    (pkg / "specs.py").write_text("")
    (pkg / "d.py").write_text("import kvoff.c\n")
    graph = import_graph(tmp_path)
    assert graph.circles == (("kvoff.tools.a", "kvoff.tools.b"),)
    assert graph.edges["kvoff.c"] == {"kvoff.specs", "kvoff.tools.a"}
    assert graph.floor["kvoff.specs"] == 0
    assert graph.floor["kvoff.tools.a"] == graph.floor["kvoff.tools.b"] == 0
    assert graph.floor["kvoff.c"] == 1
    assert graph.floor["kvoff.d"] == 2


def test_scheduler_does_not_import_the_worker() -> None:
    """The scheduler process needs only the job records, not the worker (torch, the copy ops)."""
    graph = import_graph(ROOT)
    assert "kvoff.worker" not in graph.edges["kvoff.scheduler"]


def test_import_kvoff_loads_no_tool() -> None:
    code = (
        "import sys, kvoff\nprint(sorted(m for m in sys.modules if m.startswith('kvoff.tools')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def _exits_at_import(tree: ast.Module) -> list[int]:
    """Lines of ``raise SystemExit`` / ``sys.exit(...)`` / ``exit(...)`` that run when the module
    is imported: outside function bodies and outside ``if __name__ == "__main__":``."""

    def is_main_guard(node: ast.stmt) -> bool:
        return (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
        )

    found: list[int] = []
    todo: list[ast.AST] = [n for n in tree.body if not is_main_guard(n)]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id == "SystemExit":
                found.append(node.lineno)
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("sys.exit", "exit", "quit", "os._exit"):
                found.append(node.lineno)
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_importing_any_kvoff_module_never_exits_the_process() -> None:
    """No module exits while it is imported (a mismatched build raises ImportError instead).
    ``__main__.py`` is the exception by definition: ``python -m kvoff`` runs it to exit."""
    offenders = {}
    for path in sorted((ROOT / "kvoff").rglob("*.py")):
        if path.name == "__main__.py":
            continue
        lines = _exits_at_import(ast.parse(path.read_text()))
        if lines:
            offenders[str(path.relative_to(ROOT))] = lines
    assert offenders == {}


def test_the_exit_check_sees_an_exit_at_import() -> None:
    tree = ast.parse(
        "import sys\n"
        "try:\n    import x\nexcept ImportError:\n    raise SystemExit(1)\n"
        "if True:\n    sys.exit(2)\n"
        "def main():\n    sys.exit(3)\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )
    assert sorted(_exits_at_import(tree)) == [5, 7]


def test_no_source_file_over_the_limit() -> None:
    lines = source_lines(ROOT)
    assert lines, "no source files found"
    too_long = {p: n for p, n in lines.items() if n > MAX_LINES}
    assert too_long == {}, f"split these (one job per file): {too_long}"
