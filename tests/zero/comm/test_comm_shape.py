"""comm/ keeps one mechanism per job (issue 48, item 1; STYLE.md 28): counted from the source (ast),
so the counts cannot creep back up unseen. Each count is honest about where a thing may hide:
- handles: every class in comm/ with a wait() and an is_completed() (a Protocol only declares);
- ordered workers: every class or function in comm/ that makes a threading.Thread;
- exit hooks: every atexit.register in all of zerokern/;
- registries: comm/'s module-level names bound to a mutable container (or counter, event, lock),
  or to an instance of a comm/ class whose constructor makes one; class attributes bound to a
  container; attributes set on a function at module level;
- check.py's length, and the most fields (self.x set anywhere in a class, and annotated class
  fields: a NamedTuple's) of any class in comm/.
The check needs neither torch nor the extension."""

import ast
import pathlib

ZEROKERN = pathlib.Path(__file__).resolve().parents[3] / "zerokern"
COMM = ZEROKERN / "zero" / "comm"

MAX_HANDLES, MAX_WORKERS, MAX_EXIT_HOOKS, MAX_REGISTRIES, MAX_CHECK_LINES, MAX_FIELDS = 4, 1, 1, 3, 400, 15
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "WeakKeyDictionary",
                  "WeakValueDictionary", "WeakSet", "Event", "Lock", "RLock", "local", "count", "SimpleQueue", "Queue"}


def _trees(root=COMM):
    return {p: ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))}


def _classes(trees):
    return [(p, c) for p, t in trees.items() for c in ast.walk(t) if isinstance(c, ast.ClassDef)]


def _is_protocol(cls) -> bool:
    return any(ast.unparse(b).split(".")[-1] in ("Protocol", "NamedTuple") for b in cls.bases)


def _methods(cls):
    return {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _makes_container(node) -> bool:
    return isinstance(node, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
        isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in _MUTABLE_CALLS)


def handles(trees):
    return sorted(f"{p.name}:{c.name}" for p, c in _classes(trees)
                  if not _is_protocol(c) and {"wait", "is_completed"} <= _methods(c))


def workers(trees):
    found = set()
    for p, t in trees.items():
        for owner in ast.walk(t):
            if isinstance(owner, (ast.ClassDef, ast.FunctionDef)) and any(
                    isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "Thread" for n in ast.walk(owner)):
                found.add(f"{p.name}:{owner.name}")
    # a function inside a class that makes one is the class's
    return sorted(f for f in found if not any(f != g and _inside(trees, f, g) for g in found))


def _inside(trees, inner, outer) -> bool:
    pi, ni = inner.split(":")
    po, no = outer.split(":")
    if pi != po:
        return False
    tree = next(t for p, t in trees.items() if p.name == po)
    for o in ast.walk(tree):
        if isinstance(o, (ast.ClassDef, ast.FunctionDef)) and o.name == no:
            return any(isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == ni and n is not o
                       for n in ast.walk(o))
    return False


def exit_hooks(trees):
    return sorted(f"{p.name}:{n.lineno}" for p, t in trees.items() for n in ast.walk(t)
                  if isinstance(n, ast.Call) and ast.unparse(n.func) in ("atexit.register", "register")
                  and any(isinstance(i, (ast.Import, ast.ImportFrom)) and "atexit" in ast.unparse(i) for i in t.body))


def registries(trees):
    stateful = set()  # comm/ classes whose constructor makes a container
    for _, c in _classes(trees):
        init = next((f for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        if init is not None and any(isinstance(n, ast.Assign) and _makes_container(n.value) for n in ast.walk(init)):
            stateful.add(c.name)
    out = []
    for p, t in trees.items():
        functions = {f.name for f in t.body if isinstance(f, ast.FunctionDef)}
        for node in t.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                v = node.value
                held = _makes_container(v) or (isinstance(v, ast.Call) and ast.unparse(v.func) in stateful)
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if held and isinstance(target, ast.Name):
                        out.append(f"{p.name}:{target.id}")
                    elif isinstance(target, ast.Attribute) and ast.unparse(target.value) in functions:
                        out.append(f"{p.name}:{ast.unparse(target)} (a function attribute)")
            if isinstance(node, ast.ClassDef):
                for a in node.body:
                    if isinstance(a, (ast.Assign, ast.AnnAssign)) and a.value is not None and _makes_container(a.value):
                        targets = a.targets if isinstance(a, ast.Assign) else [a.target]
                        out += [f"{p.name}:{node.name}.{ast.unparse(x)} (a class attribute)" for x in targets]
    return sorted(out)


def fields(cls) -> set:
    names = {ast.unparse(t) for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    names |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return names


def test_comm_has_at_most_four_handles_under_one_protocol():
    found = handles(_trees())
    assert len(found) <= MAX_HANDLES, f"{len(found)} handle classes (combine works.py's instead): {found}"
    works = (COMM / "works.py").read_text()
    assert "class Work(Protocol)" in works and "class Handle(Work, Protocol)" in works
    assert all(f.startswith("works.py:") for f in found), f"handles outside works.py: {found}"


def test_comm_has_one_ordered_worker_class():
    found = workers(_trees())
    assert found == ["worker.py:OrderedWorker"], f"threads made outside comm/worker.py's OrderedWorker: {found}"


def test_zerokern_has_one_exit_hook():
    found = exit_hooks(_trees(ZEROKERN))
    assert len(found) <= MAX_EXIT_HOOKS, f"atexit hooks (fold them into comm/context.py's shutdown): {found}"


def test_comm_has_at_most_three_registries():
    found = registries(_trees())
    assert len(found) <= MAX_REGISTRIES, f"module registries in comm/ (own them in comm/context.py): {found}"


def test_check_is_short_and_no_comm_class_has_more_than_fifteen_fields():
    lines = len((COMM / "check.py").read_text().splitlines())
    assert lines <= MAX_CHECK_LINES, f"comm/check.py has {lines} lines"
    wide = {f"{p.name}:{c.name}": len(fields(c)) for p, c in _classes(_trees()) if len(fields(c)) > MAX_FIELDS}
    assert not wide, f"classes with more than {MAX_FIELDS} fields: {wide}"


def test_the_counts_see_what_they_look_for(tmp_path):
    """Not vacuous: a made-up module's handle, thread, exit hook and hidden registries are found."""
    (tmp_path / "m.py").write_text(
        "import atexit, threading, itertools\nA = {}\nC = itertools.count()\n\n\ndef f():\n    pass\n\n\n"
        "f.cache = {}\natexit.register(f)\n\n\nclass Box:\n    def __init__(self):\n        self.d = {}\n\n\n"
        "B = Box()\n\n\nclass H:\n    seen = []\n\n    def wait(self):\n        self.a = self.b = 1\n\n"
        "    def is_completed(self):\n        threading.Thread(target=f)\n")
    trees = _trees(tmp_path)
    assert handles(trees) == ["m.py:H"] and workers(trees) == ["m.py:H"]
    assert exit_hooks(trees) == ["m.py:11"]
    assert registries(trees) == ["m.py:A", "m.py:B", "m.py:C", "m.py:H.seen (a class attribute)",
                                 "m.py:f.cache (a function attribute)"]
    cls = next(c for _, c in _classes(trees) if c.name == "H")
    assert fields(cls) == {"self.a", "self.b"}
