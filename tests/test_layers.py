"""The runtime's wings import downwards only (issue 36; docs/DESIGN.md "Layers"):
- no import cycle anywhere in zerokern/, counting the imports inside functions too;
- the longest chain of module-level imports inside zerokern/zero/ is at most 5 modules;
- nothing under zerokern/zero/ imports zerokern/optim/ or zerokern/integrations/;
- within zero/, core/ imports no other wing and comm/ imports only core/.
The imports are read from the source (ast), so the check needs neither torch nor the extension.

`zerokern/__init__.py` is a lazy facade (PEP 562: its names load on first use) and every module
imports through it, so edges into and out of the package root are not counted; imports under
`if TYPE_CHECKING:` are annotations only and not counted either."""

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "zerokern"
MAX_CHAIN = 5


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


def test_zero_imports_stack_at_most_five_deep():
    chain = _longest_chain(_graph(top_only=True), "zerokern.zero")
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
