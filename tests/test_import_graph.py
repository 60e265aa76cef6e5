"""The package has one-way dependencies: no import circle among dpmf's modules (imports inside
functions included), the packages import only the layers below them (edges into a package's
``__init__`` included), and numpy-only layers never import torch at module level."""

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "dpmf"

# The layers, lowest first (docs/architecture.md): a package may import its own layer and the
# ones before it. ``_validation``, ``_io``, ``_memory``, ``_lazy`` and ``seeds`` are below every
# layer; the ``dpmf`` facade (``__init__``, ``pick``, ``plots``, ``__main__``) is above them all.
LAYERS = (
    "workloads",
    "mechanisms",
    "accountants",
    "plan",
    "optim",
    "distributed",
    "step",
    "train",
    "federated",
    "audit",
    "cli",
)
BASE = ("_validation", "_io", "_memory", "_lazy", "seeds", "plots")
# Top-level modules that belong to a layer: ``dpmf.pick`` re-exports ``dpmf.plan.pick``,
# ``python -m dpmf`` is the command line.
FACADES = {"pick": "plan", "__main__": "cli"}
# Upward imports allowed because they run only inside a function, each with its reason (none:
# the plan is numbers only, and ``dpmf.step`` builds the torch parts from it).
LAZY_UPWARD: set = set()


def _modules(root=ROOT):
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(mods, m, path):
    """(target module, inside a function?) for every import of module ``m`` naming a module of
    ``mods`` (``from pkg import name`` names ``pkg.name`` when that is a module, else ``pkg``)."""
    package = m if path.name == "__init__.py" else m.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top_level = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
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
            if t in mods and t != m:
                out.append((t, id(node) not in top_level))
    return out


def _edges(mods):
    """Module edges, without edges into a package ``__init__`` (a module importing its own
    package's re-exports would otherwise look like a circle through the ``__init__``)."""
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        for t, _ in _imports(mods, m, path):
            if mods[t].name != "__init__.py":
                edges[m].add(t)
    return edges


def _layer(module: str) -> str:
    """The package of a module: ``dpmf.plan.schemes`` → ``plan``; ``dpmf._validation`` →
    itself; ``dpmf.pick`` → ``plan`` (``FACADES``); ``dpmf`` (its ``__init__``) → ``dpmf``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "dpmf"
    sub = parts[1]
    if sub in LAYERS or sub in BASE:
        return sub
    return FACADES.get(sub, "dpmf")


def _rank(layer: str) -> int:
    if layer in BASE:
        return -1
    if layer == "dpmf":
        return len(LAYERS)
    return LAYERS.index(layer)


def _package_edges(mods):
    """{(importing package, imported package): [(module, target, lazy), …]} over every import,
    edges into ``__init__`` included."""
    out = {}
    for m, path in mods.items():
        for t, lazy in _imports(mods, m, path):
            a, b = _layer(m), _layer(t)
            if a != b:
                out.setdefault((a, b), []).append((m, t, lazy))
    return out


def _layer_violations(mods):
    """The imports of a package from a layer above it (minus ``LAZY_UPWARD`` inside functions)."""
    bad = []
    for (a, b), uses in sorted(_package_edges(mods).items()):
        if _rank(b) <= _rank(a):
            continue
        for m, t, lazy in uses:
            if not (lazy and (m, t) in LAZY_UPWARD):
                bad.append(f"{m} imports {t} ({a} → {b}{', inside a function' if lazy else ''})")
    return bad


def _package_cycles(mods):
    graph = {}
    for a, b in _package_edges(mods):
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    return _cycles(graph)


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


def test_packages_import_only_the_layers_below_them():
    assert _layer_violations(_modules()) == []


def test_no_package_circle_even_through_init_and_inside_functions():
    mods = _modules()
    edges = _package_edges(mods)
    allowed = {(a, b) for (a, b), uses in edges.items() if all((m, t) in LAZY_UPWARD for m, t, _ in uses)}
    graph = {}
    for a, b in set(edges) - allowed:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    assert _cycles(graph) == []


def _write_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_package_circle_and_upward_import_are_found(tmp_path):
    # accountants/__init__ re-exports a function of plan (the circle accountants ↔ plan, only
    # visible through an __init__), and plan imports torch-side optim inside a function
    pkg = tmp_path / "dpmf"
    _write_tree(
        pkg,
        {
            "__init__.py": "",
            "accountants/__init__.py": "from dpmf.accountants.api import account\n",
            "accountants/api.py": "def account():\n    from dpmf.plan.plan import Plan\n",
            "accountants/events.py": "X = 1\n",
            "plan/__init__.py": "from dpmf.plan.plan import Plan\n",
            "plan/plan.py": (
                "from dpmf.accountants import events\n"
                "class Plan:\n"
                "    def noise(self):\n"
                "        from dpmf.optim import noise\n"
            ),
            "optim/__init__.py": "",
            "optim/noise.py": "import dpmf.plan\n",
        },
    )
    mods = _modules(pkg)
    assert _cycles(_edges(mods)) == []  # the module graph alone misses it
    assert _package_cycles(mods) == [["accountants", "optim", "plan"]]
    found = _layer_violations(mods)
    assert "dpmf.accountants.api imports dpmf.plan.plan (accountants → plan, inside a function)" in found
    assert "dpmf.optim.noise imports dpmf.plan (optim → plan)" not in found  # downward: fine
    assert "dpmf.plan.plan imports dpmf.optim.noise (plan → optim, inside a function)" in found
    _write_tree(pkg, {"plan/plan.py": "from dpmf.optim import noise\n"})
    assert "dpmf.plan.plan imports dpmf.optim.noise (plan → optim)" in _layer_violations(_modules(pkg))


def test_the_train_config_module_imports_no_torch_module():
    """``dpmf/train/config.py``'s own imports, followed through the modules they load at module
    level, reach no torch module (the ``__init__`` files of the packages are not followed)."""
    mods = _modules()
    seen, todo = set(), ["dpmf.train.config"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        tree = ast.parse(mods[m].read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                names += [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                assert not (n == "torch" or n.startswith("torch.")), f"{m} imports {n} (reached from config)"
                if n in mods and mods[n].name != "__init__.py":
                    todo.append(n)


def test_importing_the_numpy_layers_and_the_accounting_entry_points_loads_no_torch():
    code = (
        "import sys, dpmf, dpmf.workloads, dpmf.mechanisms, dpmf.accountants, dpmf.plan, dpmf.pick\n"
        "dpmf.account, dpmf.calibrate, dpmf.max_steps, dpmf.PrivatePlan\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_numpy_layers_do_not_import_torch_or_the_torch_layers():
    # anywhere in the module: the plan is numbers only (dpmf.step builds its torch parts)
    for sub in ("workloads", "mechanisms", "accountants", "plan"):
        for path in (ROOT / sub).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                assert not any(n == "torch" or n.startswith("torch.") for n in names), path
                torch_layers = ("dpmf.optim", "dpmf.distributed", "dpmf.step", "dpmf.train")
                assert not any(n.startswith(torch_layers) for n in names), path


def test_scheme_names_are_written_only_in_the_scheme_registry_and_the_cli():
    from dpmf.plan.schemes import SCHEMES

    names = set(SCHEMES)
    for path in ROOT.rglob("*.py"):
        # no module of cli/ spells one either: its flags take scheme_names() and PICK_SCHEMES
        if path.relative_to(ROOT).as_posix() in ("plan/schemes.py",):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in names, f"{path}:{node.lineno} spells the scheme {node.value!r}"


def test_no_submodule_of_dpmf_optim_is_named_as_a_name_it_exports():
    # the import system binds a submodule on its package when it is imported: a submodule named
    # as one of the package's exports would replace that export by the module
    import dpmf.optim

    homes = dpmf.optim._HOMES
    assert not [k for k, v in homes.items() if v.rsplit(".", 1)[1] == k]
    code = (
        "import dpmf.optim.orthogonalization\n"
        "from dpmf.optim import newton_schulz\n"
        "import dpmf.optim\n"
        "print(callable(newton_schulz), dpmf.optim.newton_schulz is newton_schulz)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["True", "True"]


# numerical algorithms kept whole: an optimizer's loop with its line search and stopping rules
WHOLE_ALGORITHMS = {
    ("dpmf/mechanisms/dense.py", "optimize_dense"),
    ("dpmf/mechanisms/blt.py", "optimize_blt"),
    ("dpmf/mechanisms/blt.py", "_objective"),
}


def long_functions(root: pathlib.Path, limit: int = 100) -> list[tuple[str, str, int]]:
    """(path, name, lines) of every function under ``root`` longer than ``limit`` lines,
    docstring included."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append((path.relative_to(root.parent).as_posix(), node.name, lines))
    return found


def test_no_function_is_longer_than_100_lines_but_the_whole_numerical_algorithms():
    long = [(p, n, k) for p, n, k in long_functions(ROOT) if (p, n) not in WHOLE_ALGORITHMS]
    assert not long, f"functions over 100 lines: {long}"


def test_the_length_finder_counts_a_planted_long_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n" + "    x = 1\n" * 100 + "\n\ndef g():\n    return 1\n")
    assert long_functions(pkg) == [("pkg/m.py", "f", 101)]
