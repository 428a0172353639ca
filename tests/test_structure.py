"""The package's shape (issue #28): no import cycle inside ladechat/ (imports inside functions
count), no function over 80 lines, at most 7 modules at the top of ladechat/ besides its packages,
and an engine that imports nothing above it but the shared basics. Read from the source (ast),
nothing imported."""

import ast
from pathlib import Path

import ladechat

PACKAGE = Path(ladechat.__file__).parent
LONGEST = 80  # lines of one function, its signature and docstring included
TOP_MODULES = 7  # modules at the top of ladechat/ (cli, settings, conversation, errors, paths, __init__, __main__)


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = ast.parse(path.read_text(encoding="utf-8"))
    return found


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The ladechat modules a module imports, anywhere in it but under `if TYPE_CHECKING:`."""
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
               for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ladechat"):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ladechat")}
    return found


def graph() -> dict[str, set[str]]:
    trees = modules()
    return {name: imports(tree, set(trees)) - {name} for name, tree in trees.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_the_package():
    edges = graph()
    assert len(edges) > 40 and "ladechat.engine.decode" in edges["ladechat.backends.local"]
    assert cycles(edges) == []


def test_no_function_is_longer_than_80_lines():
    long = [(f"{name}.{node.name}", node.end_lineno - node.lineno + 1) for name, tree in modules().items()
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST]
    assert long == []


def test_the_top_of_the_package_holds_few_modules():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_MODULES, top


def test_the_engine_imports_nothing_above_it_but_the_shared_basics():
    """Token ids in, token ids out: the engine knows no front end, backend or settings model."""
    allowed = ("ladechat.engine", "ladechat.errors", "ladechat.paths")
    outside = {(name, dep) for name, deps in graph().items() if name.startswith("ladechat.engine")
               for dep in deps if not dep.startswith(allowed)}
    assert outside == set()


def test_only_the_entry_point_imports_the_command_line():
    """Front ends build their backends through backends/opener.py: the CLI is a leaf, not a library."""
    importers = {name for name, deps in graph().items() if "ladechat.cli" in deps}
    assert importers == {"ladechat.__main__"}


def test_the_kernels_read_no_file_and_load_nothing():
    """engine/kernels/ is the lowest room: loading imports it, never the other way."""
    upward = {(name, dep) for name, deps in graph().items() if name.startswith("ladechat.engine.kernels")
              for dep in deps if dep.startswith("ladechat") and not dep.startswith("ladechat.engine.kernels")}
    assert upward == set()


# The engine's layers, lowest first (#42): kernels, the model files and their cache, loading,
# the step's runners and what measures them, decoding. A module imports from its own layer or
# below, and from the basics every layer shares: config, threads, events, draft/, layout (a step's
# rows, positions and mask: loading's mask probe builds one), errors, paths.
LAYERS = (("ladechat.engine.kernels",), ("ladechat.engine.models", "ladechat.engine.kv"), ("ladechat.engine.load",),
          ("ladechat.engine.runner", "ladechat.engine.step_cost", "ladechat.engine.thread_probe",
           "ladechat.engine.cost_envelope"),
          ("ladechat.engine.decode",))


def layer_of(module: str) -> int | None:
    return next((i for i, names in enumerate(LAYERS) for name in names
                 if module == name or module.startswith(name + ".")), None)


def test_the_engines_layers_import_downward_only():
    upward = {(name, dep) for name, deps in graph().items() if layer_of(name) is not None
              for dep in deps if layer_of(dep) is not None and layer_of(dep) > layer_of(name)}
    assert upward == set()


def test_the_basics_import_no_layer():
    """What every layer shares imports none of them."""
    basics = ("ladechat.engine.config", "ladechat.engine.threads", "ladechat.engine.events", "ladechat.engine.draft",
              "ladechat.engine.layout")
    found = {(name, dep) for name, deps in graph().items() if name.startswith(basics)
             for dep in deps if layer_of(dep) is not None}
    assert found == set()


def test_the_command_line_builds_no_backend_itself():
    """cli.py parses the flags into one Spec (backends/spec.py) and gets every Bot from
    backends/opener.py (open_bot; serve's open_here): no RemoteBot, WarmBot or local Bot, no warm
    server found or started, no Session, in it."""
    called = {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
              for node in ast.walk(modules()["ladechat.cli"])
              if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))}
    assert {"open_bot", "open_here"} <= called
    assert called & {"Bot", "RemoteBot", "WarmBot", "ensure", "find", "Session", "Endpoint"} == set()


def test_the_bench_answers_through_the_chats_backend():
    """`ladechat bench` (bench/prompts.py) and `bench serving` decode through backends/local.Bot, as the
    chat does: no Session, runner or generate of their own, and nothing of the loader's insides
    (what they need of a loaded model, LoadedModel gives)."""
    graph_ = graph()
    for name in ("ladechat.bench.prompts", "ladechat.bench.serving"):
        assert "ladechat.backends.local" in graph_[name], name
        assert {dep for dep in graph_[name]
                if dep.startswith(("ladechat.engine.decode", "ladechat.engine.runner"))} == set(), name
        assert {dep for dep in graph_[name] if dep.startswith("ladechat.engine.load")} == set(), name
