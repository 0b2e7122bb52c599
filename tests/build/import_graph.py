"""kvoff's internal import graph, read from the source (every ``import`` statement, function-level
ones included): modules, edges, import circles and floors.

Also a command for the record of a restructuring: ``python3 tests/build/import_graph.py [ROOT]``
prints the floors, circles and the largest source files.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

#: Compiled modules of the package (no Python source to read): leaves of the graph.
EXTENSIONS = ("kvoff._C", "kvoff._scheduler", "kvoff._bench", "kvoff._build_info")


@dataclass(frozen=True)
class ImportGraph:
    """``edges[m]``: the kvoff modules that module ``m`` imports (package ``__init__`` modules are
    named by the package). ``circles``: strongly connected components of more than one module.
    ``floor[m]``: 0 for a module importing no kvoff module, else 1 + the highest floor it
    imports (a circle's members count as one module)."""

    modules: tuple[str, ...]
    edges: dict[str, frozenset[str]]
    circles: tuple[tuple[str, ...], ...]
    floor: dict[str, int]


def _modules(root: Path) -> dict[str, tuple[Path | None, bool]]:
    mods: dict[str, tuple[Path | None, bool]] = {}
    for path in sorted((root / "kvoff").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_package)
    for ext in EXTENSIONS:
        mods.setdefault(ext, (None, False))
    return mods


def _imports(module: str, path: Path, is_package: bool, mods: dict) -> set[str]:
    """The kvoff modules one source file imports: ``from a import b`` names module ``a.b`` when
    ``b`` is a module, else module ``a``."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            submodules = [f"{name}.{alias.name}" for alias in node.names]
            targets = submodules if all(s in mods for s in submodules) else [name, *submodules]
        else:
            continue
        for name in targets:
            target = name
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target.startswith("kvoff") and target != module:
                found.add(target)
    return found


def import_graph(root: Path) -> ImportGraph:
    """Reads every ``kvoff/**/*.py`` under the source tree ``root``."""
    mods = _modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    for module, (path, is_package) in mods.items():
        if path is not None:
            edges[module] = _imports(module, path, is_package, mods)
    # Tarjan's strongly connected components, iteratively (no recursion limit to mind).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in mods:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    components.append(component)
    component_of = {m: i for i, c in enumerate(components) for m in c}
    # Components come out of Tarjan's algorithm in reverse topological order: dependencies first.
    component_floor: list[int] = []
    for c in components:
        deps = {component_of[w] for m in c for w in edges[m]} - {component_of[c[0]]}
        component_floor.append(1 + max((component_floor[d] for d in deps), default=-1))
    return ImportGraph(
        modules=tuple(sorted(mods)),
        edges={m: frozenset(edges[m]) for m in mods},
        circles=tuple(tuple(sorted(c)) for c in components if len(c) > 1),
        floor={m: component_floor[component_of[m]] for m in mods},
    )


def source_lines(root: Path, folders: tuple[str, ...] = ("kvoff", "cpp", "cuda")) -> dict[str, int]:
    """Lines of every Python, C++ and CUDA source file under ``folders`` of ``root``."""
    suffixes = {".py", ".cpp", ".h", ".hpp", ".cu", ".cuh"}
    return {
        str(p.relative_to(root)): len(p.read_text().splitlines())
        for folder in folders
        for p in sorted((root / folder).rglob("*"))
        if p.suffix in suffixes and p.is_file()
    }


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[2])
    g = import_graph(root)
    floors = max(g.floor.values()) + 1
    print(f"{len(g.modules)} modules, {sum(map(len, g.edges.values()))} imports, {floors} floors")
    print("circles:", [list(c) for c in g.circles] or "none")
    for f in range(floors):
        print(f"floor {f}: " + ", ".join(m for m in g.modules if g.floor[m] == f))
    largest = sorted(source_lines(root).items(), key=lambda kv: -kv[1])[:12]
    print("largest files:", ", ".join(f"{p} {n}" for p, n in largest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
