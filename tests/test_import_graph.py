"""The package has one-way dependencies: no import circle among dpmf's modules (imports inside
functions included), and numpy-only layers never import torch at module level."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "dpmf"


def _modules():
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _edges(mods):
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if t in mods and t != m and mods[t].name != "__init__.py":
                    edges[m].add(t)
    return edges


def _cycles(edges):
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_dpmf_has_no_import_circle():
    assert _cycles(_edges(_modules())) == []


def test_numpy_layers_do_not_import_torch_at_module_level():
    for sub in ("workloads", "mechanisms", "accountants", "plan"):
        for path in (ROOT / sub).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in tree.body:
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                assert not any(n == "torch" or n.startswith("torch.") for n in names), path
                assert not any(n.startswith(("dpmf.optim", "dpmf.train")) for n in names), path


def test_scheme_names_are_written_only_in_the_scheme_registry_and_the_cli():
    from dpmf.plan.schemes import SCHEMES

    names = set(SCHEMES)
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).as_posix() in ("plan/schemes.py", "cli.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in names, f"{path}:{node.lineno} spells the scheme {node.value!r}"
