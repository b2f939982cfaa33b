"""File-level import graph of one package's sources, for ``tools/check_dag.py``.

- :func:`import_circles`: the strongly connected components (more than one file) of the graph whose nodes are the
  package's module files and whose edges are its imports of its own modules (absolute and relative, at module level
  or inside functions). Edges into a package's ``__init__`` are ignored: importing a name that an ``__init__``
  re-exports is not a dependency on the module that defines it, and every submodule import runs the ``__init__``
  of its parents anyway, so counting those edges would make every package a circle.
- :func:`function_level_imports`: the imports of first-party packages (the workspace's import names) made inside a
  function body instead of at module top.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file for every ``.py`` under ``package_dir`` (its name is the top-level import name;
    ``pkg/sub/__init__.py`` is the module ``pkg.sub``)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Every dotted name ``node`` (in ``module``) may import as a module: ``from a.b import c`` gives ``a.b`` and
    ``a.b.c``; relative imports are resolved against ``module`` (``is_package``: ``module`` is an ``__init__``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """``(import node, inside a function)`` for every import statement of ``tree``."""
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function |= {id(n) for n in ast.walk(node) if n is not node}
    return [(n, id(n) in in_function) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def import_edges(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``files`` it imports (no edges into ``__init__`` modules, no self edges)."""
    targets = {m for m, path in files.items() if path.name != "__init__.py"}
    edges = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges[module] = {
            name
            for node, _ in _imports(tree)
            for name in imported_names(module, is_package, node)
            if name in targets and name != module
        }
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (each sorted; sorted by first node), by Tarjan's
    algorithm without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            child = next((s for s in successors if s not in index or s in on_stack), None)
            if child is not None:
                if child in index:
                    low[node] = min(low[node], index[child])
                else:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def import_circles(package_dir: Path) -> list[list[str]]:
    """The file-level import circles of the package whose top-level directory is ``package_dir``."""
    return strongly_connected(import_edges(module_files(package_dir)))


def function_level_imports(path: Path, first_party: set[str]) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every import of a ``first_party`` package made inside a function of ``path``
    (a relative import always counts: it names the package's own modules)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node, in_function in _imports(tree):
        if not in_function:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "." * node.level + (node.module or "")))
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        found += [(node.lineno, name) for name in names if name.split(".")[0] in first_party]
    return sorted(found)
