"""The package import rules of DESIGN.md §2 and docs/architecture.md, checked on the source text.

The rules are data (RULES); `check` parses every module with `ast` (nothing is imported, so a
heavy or broken module cannot hide a violation) and returns every breach of a rule and every
import cycle. test_the_checker_catches_planted_violations proves each kind of breach is caught.

Which imports count:
- For the layering rules, every static import: module level, inside functions, and inside
  `if TYPE_CHECKING:` blocks. A lazy import is still a dependency (it runs on the first call,
  and moving an import into a function is the usual way to dodge a rule like this), and a
  TYPE_CHECKING import still couples the importer to the other side's types: the boundary these
  rules draw is about knowledge, not only about import time.
- For cycles, every import that runs: module level and inside functions, but not TYPE_CHECKING
  blocks (they never run, and a type-only back reference is the normal way to annotate with a
  type from a module that depends on you). A function-level import is how today's cycles are
  hidden (hw.gpu_probe <-> engine.ledger, the front's render -> api.services -> proxy -> drain
  ring that issue 16 names): counting module-level imports only would find no cycle at all.
- `importlib.import_module("...")` with a dynamic name is not seen; the project uses none across
  these boundaries.

test_front_is_light.py stays separate: it checks what the front *process* loads at run time
(torch, transformers, pynvml, vllm through any third-party path), which no static rule between
our own packages can see. test_test_layout.py is about test file names, unrelated.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SRC = Path(__file__).resolve().parents[2] / "src"
STDLIB = "<stdlib>"  # stands for every module in sys.stdlib_module_names


@dataclass(frozen=True)
class Rule:
    """Modules under `source` may not import `forbid`, or, when `only` is set, nothing outside
    `only` among the imports within `scope` ("" = every import, "modelyard" = our own)."""

    name: str
    source: str
    forbid: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None
    scope: str = ""
    # module -> prefixes that one module may import despite `forbid`
    allow: tuple[tuple[str, tuple[str, ...]], ...] = ()


RULES: tuple[Rule, ...] = (
    Rule(
        "front never imports engine, proc or hw (its engine providers aside)",
        source="modelyard.front",
        forbid=("modelyard.engine", "modelyard.proc", "modelyard.hw"),
        allow=(
            # the in-process provider runs an engine; the local one spawns engine processes,
            # one per GPU it counts on this machine
            ("modelyard.front.engines.provider",
             ("modelyard.engine", "modelyard.proc", "modelyard.hw")),
            # the supervisor spawns and watches engine processes
            ("modelyard.front.engines.supervisor", ("modelyard.proc",)),
        ),
    ),
    Rule(
        "front reaches the cluster package only from its Ray provider (which creates agents)",
        source="modelyard.front",
        forbid=("modelyard.cluster",),
        allow=(("modelyard.front.engines.ray_provider", ("modelyard.cluster",)),),
    ),
    Rule(
        "cluster (a node's agent) reaches the front only for the engine supervisor it runs",
        source="modelyard.cluster",
        only=(STDLIB, "ray", "modelyard.cluster", "modelyard.config", "modelyard.errors",
              "modelyard.types", "modelyard.wire", "modelyard.home", "modelyard.proc",
              "modelyard.hw", "modelyard.placement", "modelyard.store",
              "modelyard.front.engines.supervisor"),
        scope="modelyard",
    ),
    Rule("engine never imports front", source="modelyard.engine", forbid=("modelyard.front",)),
    Rule(
        "placement imports only stdlib, pydantic, types, errors and wire",
        source="modelyard.placement",
        only=(STDLIB, "pydantic", "modelyard.types", "modelyard.errors", "modelyard.placement",
              "modelyard.wire"),
    ),
    Rule(
        "wire imports only stdlib, pydantic, orjson, types and errors",
        source="modelyard.wire",
        # orjson: the lease frames' codec, on every request (pydantic would cost microseconds);
        # placement.devices: the data types of a placement (stdlib only) that status reports
        only=(STDLIB, "pydantic", "orjson", "modelyard.types", "modelyard.errors",
              "modelyard.wire", "modelyard.placement.devices"),
    ),
    Rule(
        "hw imports nothing above it (types, errors, config allowed)",
        source="modelyard.hw",
        only=("modelyard.hw", "modelyard.types", "modelyard.errors", "modelyard.config"),
        scope="modelyard",
    ),
)


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    runs: bool  # False inside `if TYPE_CHECKING:`, which never runs


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, runs: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement below `node` (functions included), with whether it ever runs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, runs
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), False)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), runs)
        else:
            yield from _walk(child, runs)


def _targets(
    node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: dict[str, Path]
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:
        parts = importer.split(".")
        # `from . import x` in a package's __init__ is relative to the package itself
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep] + ([base] if base else []))
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in modules else base


def load(root: Path, package: str = "modelyard") -> Graph:
    """Parse every module of `package` under `root` (the directory holding the package)."""
    graph = Graph()
    for path in sorted((root / package).rglob("*.py")):
        graph.modules[_module_name(root, path)] = path
    for name, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, runs in _walk(tree, True):
            for target in dict.fromkeys(_targets(node, name, is_package, graph.modules)):
                graph.imports.append(Import(name, target, node.lineno, runs))
    return graph


def _allowed_by(target: str, allowed: Iterable[str]) -> bool:
    top = target.split(".")[0]
    return any(
        (p == STDLIB and top in sys.stdlib_module_names) or (p != STDLIB and _under(target, p))
        for p in allowed
    )


def rule_violations(graph: Graph, rules: Iterable[Rule] = RULES) -> list[str]:
    found = []
    for rule in rules:
        for imp in graph.imports:
            if not _under(imp.importer, rule.source) or not _under(imp.target, rule.scope):
                continue
            if rule.only is not None:
                bad = not _allowed_by(imp.target, rule.only)
            else:
                extra = dict(rule.allow).get(imp.importer, ())
                bad = _allowed_by(imp.target, rule.forbid) and not _allowed_by(imp.target, extra)
            if bad:
                where = f"{graph.modules[imp.importer]}:{imp.line}"
                found.append(f"[{rule.name}] {imp.importer} imports {imp.target}  ({where})")
    return found


def cycles(graph: Graph) -> list[tuple[list[str], list[str]]]:
    """One concrete cycle per strongly connected component of the graph of imports that run."""
    edges: dict[str, set[str]] = {m: set() for m in graph.modules}
    for imp in graph.imports:
        if imp.runs and imp.target in graph.modules and imp.target != imp.importer:
            edges[imp.importer].add(imp.target)

    # Tarjan's algorithm, iterative (the graph is small, but recursion limits are not ours to set)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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

    found = []
    for component in components:
        members = set(component)
        # shortest way back to the first member: breadth-first inside the component
        first = component[0]
        paths = {first: [first]}
        queue = [first]
        cycle: list[str] = []
        while queue and not cycle:
            node = queue.pop(0)
            for child in sorted(edges[node] & members):
                if child == first:
                    cycle = [*paths[node], first]
                    break
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    queue.append(child)
        found.append((cycle, component))
    return found


def check(root: Path, package: str = "modelyard", rules: Iterable[Rule] = RULES) -> list[str]:
    """Every violation, one line each: rule breaches, then cycles (one per tangle of modules,
    with the whole tangle named when it is larger than the cycle shown)."""
    graph = load(root, package)
    report = rule_violations(graph, rules)
    for cycle, component in cycles(graph):
        line = "[no import cycles] " + " -> ".join(cycle)
        if len(component) > len(cycle) - 1:
            line += f"  (tangled with it: {', '.join(sorted(set(component) - set(cycle)))})"
        report.append(line)
    return report


def test_the_source_tree_keeps_the_import_rules() -> None:
    report = check(SRC)
    assert report == [], f"{len(report)} import rule violation(s):\n" + "\n".join(report)


FRONT = f"[{RULES[0].name}] "


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if parent != Path("."):
                (root / parent / "__init__.py").touch()
        path.write_text(text)


def test_the_checker_catches_planted_violations(tmp_path: Path) -> None:
    _plant(tmp_path, {
        # front reaching into engine, three ways a test must not miss
        "modelyard/front/routing.py": "from modelyard.engine.ledger import Ledger\n",
        "modelyard/front/lazy.py": "def f():\n    import modelyard.engine.loop\n",
        "modelyard/front/typed.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from modelyard.hw import nvml\n"
        ),
        "modelyard/engine/ledger.py": "Ledger = object\n",
        "modelyard/engine/loop.py": "from modelyard.front import routing\n",
        "modelyard/hw/nvml.py": "from modelyard.engine import ledger\n",
        # the allowed exceptions and clean modules stay quiet
        "modelyard/front/engines/provider.py": "from modelyard.engine.loop import x\n",
        "modelyard/front/engines/supervisor.py": "from modelyard.proc import process\n",
        "modelyard/proc/process.py": "import os\n",
        "modelyard/types.py": "",
        "modelyard/errors.py": "",
        "modelyard/placement/policy.py": (
            "from __future__ import annotations\nimport dataclasses\nimport pydantic\n"
            "from modelyard.wire import status\nfrom modelyard import types, errors\n"
        ),
        # wire importing front and a third-party package
        "modelyard/wire/status.py": "from ..front import routing\nimport httpx\n",
        # a cycle a -> b -> a at module level; d -> e -> d hidden in a function; f -> g with a
        # type-only import back is no cycle
        "modelyard/front/a.py": "from modelyard.front import b\n",
        "modelyard/front/b.py": "from . import a\n",
        "modelyard/front/f.py": "import modelyard.front.g\n",
        "modelyard/front/g.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import f\n",
        "modelyard/front/d.py": "from modelyard.front import e\n",
        "modelyard/front/e.py": "def f():\n    from . import d\n",
    })
    report = check(tmp_path)
    assert sorted(report) == sorted([
        FRONT + "modelyard.front.routing imports modelyard.engine.ledger  "
        f"({tmp_path}/modelyard/front/routing.py:1)",
        FRONT + "modelyard.front.lazy imports modelyard.engine.loop  "
        f"({tmp_path}/modelyard/front/lazy.py:2)",
        FRONT + "modelyard.front.typed imports modelyard.hw.nvml  "
        f"({tmp_path}/modelyard/front/typed.py:3)",
        "[engine never imports front] modelyard.engine.loop imports modelyard.front.routing  "
        f"({tmp_path}/modelyard/engine/loop.py:1)",
        "[hw imports nothing above it (types, errors, config allowed)] "
        f"modelyard.hw.nvml imports modelyard.engine.ledger  ({tmp_path}/modelyard/hw/nvml.py:1)",
        "[wire imports only stdlib, pydantic, orjson, types and errors] modelyard.wire.status "
        "imports "
        f"modelyard.front.routing  ({tmp_path}/modelyard/wire/status.py:1)",
        "[wire imports only stdlib, pydantic, orjson, types and errors] modelyard.wire.status "
        "imports "
        f"httpx  ({tmp_path}/modelyard/wire/status.py:2)",
        "[no import cycles] modelyard.front.a -> modelyard.front.b -> modelyard.front.a",
        "[no import cycles] modelyard.front.d -> modelyard.front.e -> modelyard.front.d",
    ])


def test_the_supervisor_may_not_import_the_engine(tmp_path: Path) -> None:
    # An exception covers only what its row names: the supervisor spawns processes (proc), it
    # does not run an engine in-process.
    _plant(tmp_path, {
        "modelyard/front/engines/supervisor.py": "from modelyard.engine import loop\n",
        "modelyard/engine/loop.py": "",
    })
    assert check(tmp_path) == [
        FRONT + "modelyard.front.engines.supervisor imports modelyard.engine.loop  "
        f"({tmp_path}/modelyard/front/engines/supervisor.py:1)",
    ]
