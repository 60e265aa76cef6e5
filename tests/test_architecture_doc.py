"""docs/architecture.md stays true of the code: short, every module named, and its layer order
followed by every import (module level and inside functions), except the upward imports it
lists with their reasons."""

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOT = REPO / "dpmf"
DOC = REPO / "docs" / "architecture.md"
MAX_LINES = 350


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name → file of every module under ``root`` (a package is named by its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def unit(module: str) -> str:
    """The layer unit of a module: the first component under ``dpmf`` (``dpmf.optim.noise`` →
    ``optim``, ``dpmf.seeds`` → ``seeds``); the package's own ``__init__`` is ``__init__``."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def imports(mods: dict[str, pathlib.Path]) -> list[tuple[str, str]]:
    """(importing module, imported module) for every import of one of ``mods`` (``from pkg import
    name`` names ``pkg.name`` when that is a module, else ``pkg``; relative imports resolved)."""
    out = []
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:  # ``import dpmf.a.b.name`` → its module
                    t = t.rpartition(".")[0]
                if t in mods and t != m:
                    out.append((m, t))
    return out


def fenced(text: str, tag: str) -> list[str]:
    """The lines of the doc's fenced block opened by ```tag, without blanks and ``#`` comments."""
    match = re.search(rf"^```{re.escape(tag)}[ \t]*\n(.*?)^```", text, re.M | re.S)
    assert match, f"docs/architecture.md has no ```{tag} block"
    lines = (line.split("#", 1)[0].strip() for line in match.group(1).splitlines())
    return [line for line in lines if line]


def layer_order(text: str) -> list[str]:
    """The units of the ```layers block, lowest first (one a line, optionally ``1. name``)."""
    return [re.sub(r"^\d+[.)]\s*", "", line).strip("`") for line in fenced(text, "layers")]


def upward_imports(text: str) -> dict[tuple[str, str], str]:
    """The ```upward-imports block: ``dpmf.a.module -> dpmf.b.module  # reason`` a line."""
    match = re.search(r"^```upward-imports[ \t]*\n(.*?)^```", text, re.M | re.S)
    assert match, "docs/architecture.md has no ```upward-imports block"
    out = {}
    for line in match.group(1).splitlines():
        entry, _, reason = line.partition("#")
        if not entry.strip():
            continue
        m, arrow, t = entry.partition("->")
        assert arrow and m.strip() and t.strip(), f"not 'module -> module  # reason': {line!r}"
        assert reason.strip(), f"an upward import needs its reason after '#': {line!r}"
        out[(m.strip(), t.strip())] = reason.strip()
    return out


def named(text: str, module: str, path: pathlib.Path, root: pathlib.Path) -> bool:
    """Whether the doc names the module: its path relative to ``dpmf/`` or its dotted name (a
    package's ``__init__.py`` also by the package's dotted name or its folder ``pkg/``)."""
    rel = path.relative_to(root).as_posix()
    patterns = [rf"(?<![\w/.])(?:dpmf/)?{re.escape(rel)}(?!\w)"]
    if module.count("."):
        patterns.append(rf"(?<![\w.]){re.escape(module)}(?![\w])")
        if path.name == "__init__.py":
            folder = rel[: -len("__init__.py")]
            patterns[-1] = rf"(?<![\w.]){re.escape(module)}(?![\w.])"
            patterns.append(rf"(?<![\w/.])(?:dpmf/)?{re.escape(folder)}(?![\w.])")
    return any(re.search(p, text) for p in patterns)


def undocumented(text: str, root: pathlib.Path) -> list[str]:
    return [str(p.relative_to(root)) for m, p in modules(root).items() if not named(text, m, p, root)]


def layer_problems(text: str, root: pathlib.Path) -> list[str]:
    """Units missing from (or unknown to) the layer order, imports of a unit listed later that
    the doc does not list as exceptions, and listed exceptions that are no upward import."""
    mods = modules(root)
    order = layer_order(text)
    allowed = upward_imports(text)
    units = {unit(m) for m in mods}
    problems = [f"unit {u!r} is not in the layer order" for u in sorted(units - set(order))]
    problems += [f"{u!r} in the layer order is no unit of dpmf" for u in order if u not in units]
    problems += [f"{u!r} listed twice in the layer order" for u in set(order) if order.count(u) > 1]
    if problems:
        return problems
    rank = {u: i for i, u in enumerate(order)}
    upward = set()
    for m, t in imports(mods):
        a, b = unit(m), unit(t)
        if a != b and rank[b] > rank[a]:
            upward.add((m, t))
            if (m, t) not in allowed:
                problems.append(f"{m} imports {t}: {b} is listed after {a} (an upward import)")
    stale = [(m, t) for m, t in allowed if (m, t) not in upward]
    problems += [f"listed exception {m} -> {t} is no upward import" for m, t in stale]
    return sorted(set(problems))


# -- the doc ------------------------------------------------------------------------------------


def test_the_doc_is_short():
    n = len(DOC.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"docs/architecture.md has {n} lines (at most {MAX_LINES})"


def test_every_module_is_named_in_the_doc():
    missing = undocumented(DOC.read_text(encoding="utf-8"), ROOT)
    assert not missing, f"modules not named in docs/architecture.md: {missing}"


def test_the_layer_order_of_the_doc_is_the_imports_order():
    problems = layer_problems(DOC.read_text(encoding="utf-8"), ROOT)
    assert not problems, "\n".join(problems)


# -- the checker, on a planted tree ---------------------------------------------------------------

FAKE_DOC = """\
The package `a/`: `a/x.py`, `dpmf.a.z`; `dpmf.b`: `b/y.py`; the facade `__init__.py`.

```layers
1. a
2. b
3. __init__
```

```upward-imports
# none
```
"""


def _plant(tmp_path) -> pathlib.Path:
    root = tmp_path / "dpmf"
    files = {
        "__init__.py": "def __getattr__(name):\n    from dpmf.b import y\n    return y\n",
        "a/__init__.py": "",
        "a/x.py": "import os\n",
        "a/z.py": "from . import x\n",
        "b/__init__.py": "",
        "b/y.py": "from ..a import x\nimport dpmf.a.z\n",
    }
    for rel, code in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(code)
    return root


def test_the_checker_accepts_a_consistent_tree(tmp_path):
    root = _plant(tmp_path)
    assert sorted(imports(modules(root))) == [
        ("dpmf", "dpmf.b.y"),
        ("dpmf.a.z", "dpmf.a.x"),
        ("dpmf.b.y", "dpmf.a.x"),
        ("dpmf.b.y", "dpmf.a.z"),
    ]
    assert undocumented(FAKE_DOC, root) == []
    assert layer_problems(FAKE_DOC, root) == []


def test_the_checker_finds_an_undocumented_module(tmp_path):
    root = _plant(tmp_path)
    (root / "b" / "new.py").write_text("")
    (root / "c").mkdir()
    (root / "c" / "__init__.py").write_text("")
    assert undocumented(FAKE_DOC, root) == ["b/new.py", "c/__init__.py"]
    assert layer_problems(FAKE_DOC, root) == ["unit 'c' is not in the layer order"]
    # a mention of a longer name does not count: ``x.py`` is not ``a/x.py``, ``dpmf.b.yy`` not
    # ``dpmf.b.y``, ``dpmf.a.z`` does not name the package ``dpmf.a``
    assert undocumented("`x.py`, `dpmf.b.yy`, `dpmf.a.z`, `__init__.py`", root) == [
        "a/__init__.py",
        "a/x.py",
        "b/__init__.py",
        "b/new.py",
        "b/y.py",
        "c/__init__.py",
    ]


def test_the_checker_finds_an_upward_import_inside_a_function(tmp_path):
    root = _plant(tmp_path)
    (root / "a" / "x.py").write_text("def f():\n    from dpmf.b.y import g\n    return g\n")
    upward = "dpmf.a.x imports dpmf.b.y: b is listed after a (an upward import)"
    assert layer_problems(FAKE_DOC, root) == [upward]
    listed = FAKE_DOC.replace("# none", "dpmf.a.x -> dpmf.b.y  # the reason")
    assert layer_problems(listed, root) == []
    # an exception without a reason is refused; one the code no longer has is reported
    unexplained = FAKE_DOC.replace("# none", "dpmf.a.x -> dpmf.b.y")
    try:
        layer_problems(unexplained, root)
    except AssertionError as err:
        assert "reason" in str(err)
    else:
        raise AssertionError("an exception without its reason was accepted")
    (root / "a" / "x.py").write_text("")
    assert layer_problems(listed, root) == ["listed exception dpmf.a.x -> dpmf.b.y is no upward import"]


def test_the_checker_finds_a_reordered_layer(tmp_path):
    root = _plant(tmp_path)
    swapped = FAKE_DOC.replace("1. a\n2. b", "1. b\n2. a")
    assert layer_problems(swapped, root) == [
        "dpmf.b.y imports dpmf.a.x: a is listed after b (an upward import)",
        "dpmf.b.y imports dpmf.a.z: a is listed after b (an upward import)",
    ]
