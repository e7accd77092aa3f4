"""Layering: the runtime never imports training or evaluation code, and training never imports evals.

The runtime packages — ``specserve/`` (but its CLI entry point ``specserve/cli.py``, which may route to
anything), ``drafters/``, ``verify/``, ``grammar/`` and ``server/`` — import neither
``specserve.training`` nor ``specserve.evals``; ``training/`` does not import ``specserve.evals``.
Every import counts, the ones inside functions too (a lazy import is still an edge).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ("specserve", "drafters", "verify", "grammar", "server")
EXEMPT = {"specserve/cli.py"}  # the command line: it dispatches to training and evals
# Folder -> the installed package its modules live in (pyproject's package-dir).
PACKAGE = {"specserve": "specserve", "drafters": "specserve.drafters", "verify": "specserve.verify",
           "grammar": "specserve.grammar", "server": "specserve.server", "training": "specserve.training",
           "evals": "specserve.evals"}
FORBIDDEN = {folder: ("specserve.training", "specserve.evals") for folder in RUNTIME}
FORBIDDEN["training"] = ("specserve.evals",)


def _module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGE[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in ``path``, at any depth; relative imports
    resolved against the file's package, ``from X import y`` also yielding ``X.y`` (y may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_of(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.lineno, node.args[0].value))
    return found


def _hits(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations() -> list[str]:
    out = []
    for folder, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in EXEMPT:
                continue
            seen = set()
            for line, name in imports(path):
                if _hits(name, forbidden) and line not in seen:
                    seen.add(line)
                    out.append(f"{rel}:{line} imports {name}")
    return out


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "drafters"
    pkg.mkdir()
    (pkg / "x.py").write_text("import os\n\ndef f():\n    from specserve.training.tokenizer import a\n"
                              "    from ..evals import suite\n    import specserve.evals.common\n")
    names = [name for _, name in imports(pkg / "x.py", tmp_path)]
    assert "specserve.training.tokenizer" in names and "specserve.evals.suite" in names
    assert "specserve.evals.common" in names


def test_runtime_imports_neither_training_nor_evals_and_training_not_evals():
    bad = violations()
    print("\n".join(bad))
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


# Loading produces weights, the model consumes them, backends plug into the model: none of these modules may
# reach back into another through imports (the lazy ones count).
LOADING_AND_MODEL = ("specserve.model", "specserve.checkpoint", "specserve.config", "specserve.loading",
                     "specserve.cuda_graphs", "specserve.kernels", "specserve.tensor_parallel", "specserve.sharding",
                     "specserve.forward_output", "specserve.attention")


def _group(module: str) -> str | None:
    """The entry of LOADING_AND_MODEL a module belongs to (a package's modules are one node), or None."""
    return next((g for g in LOADING_AND_MODEL if module == g or module.startswith(g + ".")), None)


def import_cycle() -> list[str] | None:
    """A cycle in the import graph of LOADING_AND_MODEL (as a list of nodes), or None."""
    edges: dict[str, set[str]] = {g: set() for g in LOADING_AND_MODEL}
    for path in sorted((ROOT / "specserve").rglob("*.py")):
        source = _group(_module_of(path, ROOT))
        if source is None:
            continue
        for _, name in imports(path, ROOT):
            target = _group(name)
            if target is not None and target != source:
                edges[source].add(target)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for node in LOADING_AND_MODEL:
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_loading_the_model_and_its_backends_import_no_cycle():
    cycle = import_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
