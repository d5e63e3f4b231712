"""The runtime's wings import downwards only (issue 36; docs/DESIGN.md "Layers"):
- no import cycle anywhere in zerokern/, counting the imports inside functions too;
- no zerokern import inside a function under zerokern/zero/ (nor an importlib.import_module or
  __import__ call there), but for the few in FUNCTION_LEVEL, each with its reason: an import
  moved into a function to shorten a chain hides the layering instead of fixing it (issue 48);
- the longest chain of imports inside zerokern/zero/, those inside functions counted, is at most
  6 modules;
- nothing under zerokern/zero/ imports zerokern/optim/ or zerokern/integrations/;
- within zero/, core/ imports no other wing and comm/ imports only core/;
- docs/DESIGN.md's table names every mutable module global of zero/ with its owner.
The imports are read from the source (ast), so the check needs neither torch nor the extension.

`zerokern/__init__.py` is a lazy facade (PEP 562: its names load on first use) and every module
imports through it, so edges into and out of the package root are not counted; imports under
`if TYPE_CHECKING:` are annotations only and not counted either."""

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "zerokern"
MAX_CHAIN = 6

# (module, what it imports inside a function) -> why it may. Only an optional dependency or the
# lazy package facade has a reason; a chain that would be too long has none (fix the layering).
FUNCTION_LEVEL = {
    ("zerokern.zero", "importlib.import_module"): "the lazy facade (PEP 562 __getattr__): zerokern.zero's public "
                                                  "names load on first use, so importing one wing loads no other",
}


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in ROOT.rglob("*.py")}


def _targets(module: str, is_package: bool, node) -> list:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
    out = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
    return [t for t in out if t in MODULES]


def _imports(module: str, top_only: bool) -> set:
    path = MODULES[module]
    found = set()

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if top or not top_only:
                    found.update(_targets(module, path.name == "__init__.py", child))
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            else:
                visit(child, top)

    visit(ast.parse(path.read_text()), True)
    found.discard(module)
    found.discard("zerokern")  # the lazy facade (see the docstring)
    return set() if module == "zerokern" else found


def _graph(top_only: bool) -> dict:
    return {m: _imports(m, top_only) for m in MODULES}


def _cycle(graph: dict):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d, stack + [d])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def _longest_chain(graph: dict, prefix: str) -> list:
    inside = {m: {d for d in ds if d.startswith(prefix)} for m, ds in graph.items() if m.startswith(prefix)}

    @functools.lru_cache(maxsize=None)
    def longest(m):
        return max(([m] + longest(d) for d in inside[m]), key=len, default=[m])

    return max((longest(m) for m in inside), key=len)


def test_no_import_cycle():
    cycle = _cycle(_graph(top_only=False))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _function_level(module: str) -> list:
    """(line, what) for each zerokern import, importlib.import_module or __import__ call inside a
    function (or lambda) of `module`; imports under `if TYPE_CHECKING:` are not run, so not counted."""
    path = MODULES[module]
    found = []

    def visit(node, inside):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(module, path.name == "__init__.py", child)
                if isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "zerokern":
                    targets = targets or [child.module]
                found.extend((child.lineno, t) for t in sorted(set(targets)))
            elif inside and isinstance(child, ast.Call):
                f = ast.unparse(child.func)
                if f in ("importlib.import_module", "import_module", "__import__"):
                    found.append((child.lineno, "importlib.import_module" if f != "__import__" else f))
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def test_zero_has_no_function_level_imports():
    found = [(m, line, what) for m in sorted(MODULES) if m.startswith("zerokern.zero")
             for line, what in _function_level(m)]
    bad = [f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {what} inside a function"
           for m, line, what in found if (m, what) not in FUNCTION_LEVEL]
    assert not bad, "import it at the top, and fix the layering if that makes a chain or a cycle:\n" + "\n".join(bad)
    stale = [key for key in FUNCTION_LEVEL if key not in {(m, what) for m, _, what in found}]
    assert not stale, f"allowed but no longer there (drop them from FUNCTION_LEVEL): {stale}"


def test_zero_imports_stack_at_most_six_deep():
    chain = _longest_chain(_graph(top_only=False), "zerokern.zero")
    assert len(chain) <= MAX_CHAIN, f"{len(chain)} modules: " + " -> ".join(chain)


def test_zero_imports_no_optimizer_or_integration():
    graph = _graph(top_only=False)
    bad = [f"{m} imports {d}" for m, ds in sorted(graph.items()) if m.startswith("zerokern.zero")
           for d in sorted(ds) if d.startswith(("zerokern.optim", "zerokern.integrations"))]
    assert not bad, "\n".join(bad)


def test_wings_point_down():
    graph = _graph(top_only=False)
    allowed = {"zerokern.zero.core": ("zerokern.zero.core",),
               "zerokern.zero.comm": ("zerokern.zero.core", "zerokern.zero.comm")}
    bad = [f"{m} imports {d}" for m, ds in sorted(graph.items()) for wing, ok in allowed.items()
           if m.startswith(wing + ".") for d in sorted(ds) if d.startswith("zerokern.zero") and not d.startswith(ok)]
    assert not bad, "\n".join(bad)


def test_the_checks_find_what_they_look_for():
    """Not vacuous: a cycle and a long chain in a made-up graph are found."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    chain = _longest_chain({"z.a": {"z.b"}, "z.b": {"z.c", "x"}, "z.c": set(), "x": set()}, "z")
    assert chain == ["z.a", "z.b", "z.c"]
    graph = _graph(top_only=True)
    assert {"zerokern.zero.agreement", "zerokern.zero.unit"} <= graph["zerokern.zero.engine"]  # real imports


def test_the_function_level_scan_finds_what_it_looks_for(tmp_path, monkeypatch):
    """Not vacuous: an import inside a function (relative, absolute, in a lambda, by importlib) is
    found, one at the top or under TYPE_CHECKING is not."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom .core import errors\nif TYPE_CHECKING:\n"
                   "    from .unit import FlatParams\n\n\ndef f():\n    from .comm.factory import comm_for\n"
                   "    import zerokern.zero.core.layout\n    import os\n    return lambda: __import__('x')\n\n\n"
                   "class C:\n    def g(self):\n        from ..kernels import wire_ops\n"
                   "        return importlib.import_module('zerokern.zero.unit')\n")
    monkeypatch.setitem(MODULES, "zerokern.zero.m", src)
    assert _function_level("zerokern.zero.m") == [
        (8, "zerokern.zero.comm.factory"), (9, "zerokern.zero.core.layout"), (11, "__import__"),
        (16, "zerokern.kernels.wire_ops"), (17, "importlib.import_module")]
    assert "zerokern.zero.comm.factory" in _imports("zerokern.zero.m", top_only=False)  # and the chain sees it


def test_grad_buckets_never_reach_their_owner():
    """A grad bucket keeps buffers and collectives only (issue 36): its modules import core/ and
    each other, nothing that owns a bucket (the grad path, the unit, the schedule), and no method
    calls an attribute the constructor was handed (a callback into the owner)."""
    graph = _graph(top_only=False)
    buckets = ("zerokern.zero.grads.bucket", "zerokern.zero.grads.released")
    bad = [f"{m} imports {d}" for m in buckets for d in sorted(graph[m])
           if d.startswith("zerokern.zero") and not d.startswith(("zerokern.zero.core",) + buckets)]
    for m in buckets:
        tree = ast.parse(MODULES[m].read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            args = {a.arg for a in init.args.args + init.args.kwonlyargs} if init else set()
            handed = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
                      if isinstance(t, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in args} \
                if init else set()
            for call in (n for n in ast.walk(cls) if isinstance(n, ast.Call)):
                f = call.func
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" \
                        and f.attr in handed:
                    bad.append(f"{m}.{cls.name} calls self.{f.attr}(), handed to its constructor")
    assert not bad, "\n".join(bad)


# Module globals of zero/ that are never written after import: lookup tables (the facade's names too).
CONSTANT_TABLES = {"__all__", "_PUBLIC", "_BITS", "_DTYPES", "_DTYPE", "_ALLOWED", "_VALUE_PROPERTIES",
                   "_FULL_SHAPE_METHODS", "BITS", "_RAM_FILESYSTEMS"}
_MUTABLE_CALLS = {"dict", "list", "set", "WeakKeyDictionary", "WeakIdKeyDictionary", "WeakValueDictionary", "WeakSet",
                  "defaultdict", "OrderedDict", "deque", "Event", "Lock", "RLock", "local", "count"}


def _mutable_globals(module: str) -> list:
    """The module-level names of `module` bound to a container, a lock or a counter, or rebound
    by a `global` statement."""
    tree = ast.parse(MODULES[module].read_text())
    rebound = {n for g in ast.walk(tree) if isinstance(g, ast.Global) for n in g.names}
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        v = node.value
        mutable = isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(v, ast.Call) and ast.unparse(v.func).split(".")[-1] in _MUTABLE_CALLS)
        for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(t, ast.Name) and (t.id in rebound or (mutable and t.id not in CONSTANT_TABLES)):
                out.append(t.id)
    return out


def test_design_lists_every_mutable_module_global():
    """docs/DESIGN.md's table of module globals names each one left in zero/ with its owner (the
    module, on the same row), so a new registry is seen and owned (issue 48)."""
    rows = [line for line in (ROOT.parent / "docs" / "DESIGN.md").read_text().splitlines() if line.startswith("| `")]
    missing = []
    for m in sorted(MODULES):
        if not m.startswith("zerokern.zero."):
            continue
        owner = str(MODULES[m].relative_to(ROOT / "zero"))
        for name in _mutable_globals(m):
            cells = [r.split("|") for r in rows if f"`{name}`" in r]
            if not any(len(c) > 2 and owner in c[2] for c in cells):
                missing.append(f"{owner}: {name}")
    assert not missing, "mutable module globals not in docs/DESIGN.md's table with their owner: " + ", ".join(missing)


def test_the_globals_scan_finds_what_it_looks_for(tmp_path, monkeypatch):
    src = tmp_path / "g.py"
    src.write_text("import weakref, itertools\nA = {}\nB = weakref.WeakKeyDictionary()\nC = 3\nD = (1, 2)\n"
                   "E = None\n_DTYPES = {'x': 1}\n\n\ndef f():\n    global E\n    E = 1\n")
    monkeypatch.setitem(MODULES, "zerokern.zero.g", src)
    assert _mutable_globals("zerokern.zero.g") == ["A", "B", "E"]
