"""The import structure the docs promise: no import cycles; lower layers never import upper ones.

Reads the source with `ast` (imports inside functions count too: a lazy import is still a
dependency), so nothing is imported here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "bridgecache": ROOT / "bridgecache",
    "bridgecache.kernels": ROOT / "kernels",
    "tokenalign": ROOT / "tokenalign",
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module we ship (packages by their __init__)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The shipped modules that module `name` imports (`from a import b` counts a.b if a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a package counts as what its __init__ imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_through_others():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_kernels_and_tokenalign_never_import_bridgecache():
    for name, imported in _graph().items():
        if name.startswith(("bridgecache.kernels", "tokenalign")):
            upper = {
                m for m in imported if m.startswith("bridgecache") and not m.startswith("bridgecache.kernels")
            }
            assert not upper, f"{name} imports {sorted(upper)}"


def test_the_graph_sees_lazy_imports():
    graph = _graph()
    assert "bridgecache.fitting.fit" in graph["bridgecache.fitting"]  # a package re-export
    assert "bridgecache.evaluation.builtin" in graph["bridgecache.evaluation.data"]
    assert "bridgecache.models.zoo" in graph["bridgecache.cli.evaluate"]  # imported inside a function


# Floors, lowest first: a package imports only packages on lower floors (and itself); the
# function-level imports count. Leaf modules of bridgecache/ sit on the ground floor.
FLOORS = [
    (
        "bridgecache.kernels",
        "tokenalign",
        "bridgecache.compat",
        "bridgecache.files",
        "bridgecache.text",
        "bridgecache.untrusted",
        "bridgecache._moved",
        "bridgecache._checkout",
    ),
    ("bridgecache.checks",),  # the boundary (untrusted.shown in its messages); every floor above uses it
    ("bridgecache.models",),
    ("bridgecache.kv", "bridgecache.bridge"),
    ("bridgecache.runtime",),
    ("bridgecache.fitting", "bridgecache.evaluation"),
    ("bridgecache.integrations",),
    ("bridgecache.cli",),
]


def _floor_of(module: str) -> tuple[int, str] | None:
    """(floor, package) of a module, or None for the top-level `bridgecache` (the public API)."""
    best = None
    for level, packages in enumerate(FLOORS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and (
                best is None or len(package) > len(best[1])
            ):
                best = (level, package)
    return best


def test_every_module_lives_on_a_floor():
    homeless = [m for m in _modules() if m != "bridgecache" and _floor_of(m) is None]
    assert not homeless, f"modules on no floor: {homeless}"


def test_packages_import_only_lower_floors():
    wrong = []
    for name, imported in _graph().items():
        here = _floor_of(name)
        if here is None:
            continue
        for other in imported:
            there = _floor_of(other)
            if there is None or (there[1] != here[1] and there[0] >= here[0]):
                wrong.append(f"{name} -> {other}")
    assert not wrong, "imports against the floors:\n" + "\n".join(sorted(wrong))


def test_no_library_module_grows_past_450_lines():
    long = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert not {n: c for n, c in long.items() if c > 450}, sorted(long.items(), key=lambda x: -x[1])[:5]


# Module-level mutable state allowed in the packages we ship, each with its reason (issue 61: an
# engine owns state; the memos in models/ were outside this list). Constant tables are listed too:
# the scan cannot tell a table nobody writes from a memo.
_TABLE = "a constant table"
MODULE_STATE = {
    # runtime/: an engine owns its state; these are the only exceptions
    "bridgecache.runtime.engine._ENGINES": "module-level handoff()'s engines (2 kept; clear_engines())",
    "bridgecache.runtime.engine._ENGINES_LOCK": "guards _ENGINES",
    "bridgecache.runtime.selection.words._WORD_BYTES": f"{_TABLE}: which bytes are word characters",
    "bridgecache.runtime.selection.rules._NAMED": f"{_TABLE}: rule names -> classes",
    "bridgecache.runtime.cache._BRIDGED_LAYER_TYPES": f"{_TABLE}: transformers' layer classes -> ours",
    "bridgecache.runtime.interop.attention._MASK": "a ContextVar: our forward's mask, per thread and task, "
    "set for that forward only (interop.attention.attending)",
    # memos of a model, config or tokenizer: weak (freed with the object) or checked against it
    "bridgecache.models.fingerprint._MEMO": "weak per model: its fingerprint until weights_version moves",
    "bridgecache.models.spec._FINGERPRINTS": "weak per tokenizer: its vocabulary fingerprint, size checked",
    "bridgecache.models.layout._WINDOWS": "per live config (weak reference + signature): its layers' windows",
    "bridgecache.models.layout._MODULES_CHECKED": "per live model (weak key): its attention modules passed",
    "tokenalign.vocab._cache": "weak per tokenizer: its byte vocabulary",
    "bridgecache.compat._keyword_for": "functools.cache of a forward signature: its cache keyword",
    "bridgecache.models.code.module_pairing": "functools.cache of a module name's rotary pairing",
    "bridgecache.models.code.attention_code": "functools.cache of an attention class's source facts",
    "bridgecache.models.code.rope_on_sliding_only": "functools.cache of a model type's source facts",
    "bridgecache.models.code.modeling_module": "functools.cache of a model type's modeling module name",
    "bridgecache.models.spec._config_from_spec": "lru_cache (64) of a spec's config; copies handed out",
    "bridgecache.text._all_documents": "functools.cache of the text Python ships, per domain",
    # kernels: launch configurations and index tensors resolved once per shape and device
    "bridgecache.kernels._dispatch._JITTED": "one triton.jit per helper function",
    "bridgecache.kernels._dispatch._OFFSETS_CACHE": "index tensors per (shape, device)",
    "bridgecache.kernels._dispatch._SCOPED": "a ContextVar: the backend use_backend() sets for a block",
    "bridgecache.kernels._dispatch.sm_count": "functools.cache: a device's SM count",
    "bridgecache.kernels._dispatch.triton_available": "functools.cache: whether Triton imports",
    "bridgecache.kernels.affine._RESOLVED": "launch configuration per shape",
    "bridgecache.kernels.attention._RESOLVED": "launch configuration per shape",
    "bridgecache.kernels.persistent._RESOLVED": "launch configuration per shape",
    "bridgecache.kernels.stats_triton._TILES_CACHE": "tile index tensors per (shape, device)",
    "bridgecache.kernels.affine._INTERPRET_CONFIG": _TABLE,
    "bridgecache.kernels.attention._INTERPRET_CONFIG": _TABLE,
    "bridgecache.kernels.persistent._INTERPRET_CONFIG": _TABLE,
    "bridgecache.kernels.attention_launch._CONFIGS": _TABLE,
    "bridgecache.kernels.affine._gathered_affine_op": "a torch.library custom op (its decorator says cache)",
    "bridgecache.kernels.attention._column_attention_op": "a torch.library custom op",
    "bridgecache.kernels.stats._stats_op": "a torch.library custom op",
    "bridgecache.integrations.lm_eval.BridgecacheLM": "a class registered with lm-eval (its name says cache)",
    # constant tables of the other floors
    "bridgecache._moved.MOVED": _TABLE,
    "bridgecache.bridge.export._DTYPES": _TABLE,
    "bridgecache.bridge.format.LIMITS": _TABLE,
    "bridgecache.bridge.recipe.BEFORE_RECORDED": _TABLE,
    "bridgecache.bridge.recipe.CHOICES": _TABLE,
    "bridgecache.bridge.recipe.DEFAULT_K": _TABLE,
    "bridgecache.bridge.recipe.DEFAULT_WEIGHTING": _TABLE,
    "bridgecache.bridge.recipe.FLAGS": _TABLE,
    "bridgecache.cli._NAME_ERRORS": _TABLE,
    "bridgecache.evaluation.builtin.BUILTIN_FAMILIES": _TABLE,
    "bridgecache.evaluation.facts._TEMPLATES": _TABLE,
    "bridgecache.evaluation.needles.MAX_NEW_TOKENS": _TABLE,
    "bridgecache.models.gguf_weights._TORCH_BLOCKS": _TABLE,
    "bridgecache.models.layout._KIND_WHY": _TABLE,
    "bridgecache.models.spec.SPEC_LIMITS": _TABLE,
    "bridgecache.models.zoo.BUILTIN_MODELS": _TABLE,
}
_MUTABLE_CALLS = {"dict", "list", "set", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary", "Lock",
                  "RLock", "defaultdict", "zeros", "deque", "ContextVar"}  # fmt: skip


def _module_state(path: Path) -> set[str]:
    """Names a module binds at its top level to a mutable container (or decorates with a cache)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            decorators = [ast.unparse(d) for d in node.decorator_list]
            if any("cache" in d for d in decorators):
                found.add(node.name)
            continue
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
        if isinstance(value, ast.Call):
            name = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
            mutable = name in _MUTABLE_CALLS
        if mutable:
            found |= {t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"}
    return found


def test_no_package_keeps_module_level_state_beyond_the_allow_list():
    found = {f"{name}.{var}" for name, path in _modules().items() for var in _module_state(path)}
    assert found == set(MODULE_STATE), (
        f"module-level state not allow-listed: {sorted(found - set(MODULE_STATE))}; "
        f"allow-listed but gone: {sorted(set(MODULE_STATE) - found)}"
    )


def test_the_state_scan_sees_what_it_must(tmp_path):
    source = "A = {}\nB: dict = dict()\nC = threading.Lock()\nD = (1, 2)\n@lru_cache\ndef f(): pass\n"
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert _module_state(path) == {"A", "B", "C", "f"}


def test_no_test_module_imports_another():
    """Shared helpers live in conftest.py or support modules, never in another test module."""
    tests = Path(__file__).resolve().parent
    names = {p.stem for p in tests.rglob("test_*.py")}
    wrong = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "") in names:
                wrong.append(f"{path.relative_to(tests)} imports {node.module}")
            elif isinstance(node, ast.Import):
                wrong += [
                    f"{path.relative_to(tests)} imports {a.name}" for a in node.names if a.name in names
                ]
    assert not wrong, wrong


def test_only_the_lm_eval_adapter_imports_lm_eval():
    """lm-evaluation-harness stays optional: `import bridgecache` (or any other module) never needs it."""
    adapter = "bridgecache.integrations.lm_eval"
    users = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found = [node.module or ""]
            else:
                continue
            needs = any(m == "lm_eval" or m.startswith("lm_eval.") for m in found)
            if needs and not name.startswith(adapter):
                users.append(name)
    assert not users, f"modules importing lm_eval outside {adapter}: {sorted(users)}"
    assert not any(adapter in imported for imported in _graph()["bridgecache.integrations"])


# Objects the engine's plan is handed to: they read it, and nothing outside a class writes its fields
# (issue 61: the planner wrote the translator's fields, the pass and the engine the cache's). A
# field name no other class of the library uses is flagged on any receiver; a name that others use
# too (`config`, `source`, `route`) only on the names the library gives these objects.
OWNED_FIELDS = {
    "Translator": ("bridgecache.runtime.translation.translator", {"tr", "translator"}),
    "LayerGroups": ("bridgecache.runtime.translation.grouped", {"groups"}),
    "BridgedCache": ("bridgecache.runtime.cache", {"cache", "bridged"}),
    "HandoffPlan": ("bridgecache.runtime.native_work.plan", {"plan"}),
}


def _class_fields(node: ast.ClassDef) -> set[str]:
    """Names a class binds on `self` (any method), as annotated class attributes or properties."""
    fields = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            fields.add(item.target.id)
        elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(ast.unparse(d) in ("property", "cached_property") for d in item.decorator_list):
                fields.add(item.name)
            for sub in ast.walk(item):
                for target in _assigned(sub):
                    if isinstance(target.value, ast.Name) and target.value.id == "self":
                        fields.add(target.attr)
    return fields


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def _assigned(node) -> list[ast.Attribute]:
    """The attributes `node` assigns: `x.a = ...`, `x.a += ...`, `x.a: T = ...`, tuple targets,
    and `setattr(x, "a", ...)` with a constant name."""
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "setattr"
        and len(node.args) == 3
        and isinstance(node.args[1], ast.Constant)
    ):
        return [ast.Attribute(value=node.args[0], attr=node.args[1].value)]
    return [part for target in targets for part in ast.walk(target) if isinstance(part, ast.Attribute)]


def _receiver(target: ast.Attribute) -> str:
    """The name an assignment's object goes by: `cache` in `cache.x`, `translator` in `c.translator.x`."""
    value = target.value
    return value.id if isinstance(value, ast.Name) else getattr(value, "attr", "")


def _outside_writes(cls: str, owner: str, aliases: set[str], modules: dict[str, Path]) -> list[str]:
    """Writes of `cls`'s fields anywhere in `modules` except in a method of `cls` itself."""
    fields = _class_fields(_classes(modules[owner])[cls])
    shared = {
        field
        for name, path in modules.items()
        for other, node in _classes(path).items()
        if (name, other) != (owner, cls)
        for field in _class_fields(node)
    }
    wrong = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        inside = {id(sub) for sub in ast.walk(_classes(path)[cls])} if name == owner else set()
        for node in ast.walk(tree):
            for target in _assigned(node):
                if target.attr not in fields or id(node) in inside or _receiver(target) == "self":
                    continue
                if target.attr not in shared or _receiver(target) in aliases:
                    wrong.append(f"{name}:{node.lineno} {ast.unparse(target)}")
    return wrong


def test_no_field_of_the_plans_readers_is_assigned_outside_its_own_class():
    modules = _modules()
    wrong = []
    for cls, (owner, aliases) in OWNED_FIELDS.items():
        assert _class_fields(_classes(modules[owner])[cls]), f"{cls} in {owner}: the scan lost its fields"
        wrong += _outside_writes(cls, owner, aliases, modules)
    assert not wrong, "fields written from outside their class:\n" + "\n".join(wrong)


def test_the_field_scan_sees_what_it_must(tmp_path):
    owner, other = tmp_path / "owner.py", tmp_path / "other.py"
    owner.write_text(
        "class Owner:\n"
        "    def __init__(self):\n        self.rows = 1\n        self.config = None\n"
        "    @property\n    def plan(self):\n        return 1\n"
        "def outside(owner, args):\n"
        "    owner.rows += 1\n    setattr(owner, 'plan', 3)\n    owner.free = 4\n"
    )
    other.write_text(
        "class Args:\n    def __init__(self):\n        self.config = 1\n"
        "def f(args, cache):\n    args.config = 2\n    cache.config = 3\n    cache.x.rows = 4\n"
    )
    modules = {"owner": owner, "other": other}
    assert _class_fields(_classes(owner)["Owner"]) == {"rows", "config", "plan"}
    wrong = _outside_writes("Owner", "owner", {"cache"}, modules)
    assert sorted(w.split(" ")[1] for w in wrong) == [
        "cache.config",
        "cache.x.rows",
        "owner.plan",
        "owner.rows",
    ]


def test_one_definition_of_changed_weights():
    """`Tensor._version` (a write in place) is read in one place, `models.fingerprint.weights_version`:
    the fingerprint's memo and an engine's per-request check (runtime.identity) both use it."""
    readers = {
        name
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "_version"
    }
    assert readers == {"bridgecache.models.fingerprint"}, sorted(readers)


def _runtime_room(module: str) -> str:
    """The room of a runtime module: a top-level module is its own, a subpackage's modules share it."""
    parts = module.split(".")
    return ".".join(parts[:3])


def test_no_runtime_import_climbs_back_up():
    """Inside runtime/, rooms (each top-level module, each subpackage as one) import without cycles:
    a phase never reaches back into a later one (route.py once imported native_work/, which imports it)."""
    rooms: dict[str, set[str]] = {}
    for name, imported in _graph().items():
        if not name.startswith("bridgecache.runtime."):
            continue
        here = _runtime_room(name)
        rooms.setdefault(here, set()).update(
            _runtime_room(m)
            for m in imported
            if m.startswith("bridgecache.runtime.") and _runtime_room(m) != here
        )
    rooms = {room: {r for r in deps if r in rooms} for room, deps in rooms.items()}
    cycle = _cycle(rooms)
    assert cycle is None, " -> ".join(cycle)


def test_runtime_keeps_at_most_12_modules_at_its_top():
    top = sorted(p.stem for p in (PACKAGES["bridgecache"] / "runtime").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 12, top


def test_tests_of_runtime_mirror_its_rooms():
    """tests/runtime/ has a folder per runtime subpackage (and none for anything else)."""
    runtime = PACKAGES["bridgecache"] / "runtime"
    rooms = {p.name for p in runtime.iterdir() if (p / "__init__.py").exists()}
    tests = Path(__file__).resolve().parent / "runtime"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == rooms, (sorted(folders), sorted(rooms))
    assert all(any(tests.joinpath(room).glob("test_*.py")) for room in rooms)
