"""Below the API layer nothing takes Starlette's `Request` (DESIGN.md §3.14, issue 33 item 1).

The API layer (front/api/) parses a request and builds its context (front/request_context.py,
front/api/context.py); the chat pipeline, sessions, the archive capture, the tool loop, the
dispatcher and every other module under front/ get that context, or the fields they need, never
the web framework's request, so none of them can recompute the caller or reread a header.

`check` parses every module under front/ except front/api/ with `ast` (nothing is imported) and
reports each import of `Request` (or `HTTPConnection`, its base) from `starlette.requests`, and
each parameter annotated with it — by its name, an alias, `starlette.requests.Request`, inside
`X | None` or a string annotation. The few functions at the API layer's edge that live outside
front/api/ are allowed by name in EDGE, each with why; their modules may import `Request`, and no
other function in them may take it. test_the_checker_catches_planted_violations plants breaches
in a copy of the real tree to prove each kind is caught.
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

FRONT = Path(__file__).resolve().parents[2] / "src" / "modelyard" / "front"
BANNED = frozenset({"Request", "HTTPConnection"})  # from starlette.requests

# (module under front/, function) → why it may take a Request. Nothing else below front/api/ may.
EDGE: dict[tuple[str, str], str] = {
    # Starlette calls an app's exception handlers with its Request: their signature is its.
    ("app.py", "_on_modelyard_error"): "a Starlette exception handler",
    ("app.py", "_on_http_error"): "a Starlette exception handler",
    ("app.py", "_on_client_disconnect"): "a Starlette exception handler",
    ("app.py", "_on_unexpected"): "a Starlette exception handler",
    ("render.py", "render_error"): "the exception handlers' renderer (app.py): the same edge",
    # The handlers' readers of a request, beside FrontState which they return or read with; only
    # the API layer has a request to give them (nothing below may take one: this test).
    ("state.py", "state_of"): "a handler's reader: the front's parts",
    ("state.py", "read_json_object"): "a handler's reader: the body",
    ("state.py", "request_priority"): "a handler's reader: X-Modelyard-Priority",
    ("identity/principal.py", "principal_of"): (
        "a handler's reader of the caller the auth gate attached (its scope key is defined "
        "with the Principal)"),
    ("ops/metrics.py", "metrics"): "the GET /metrics route handler, beside the metrics it serves",
}


def _modules(root: Path) -> Iterator[tuple[str, ast.Module]]:
    """Every module under `root` (a copy of front/) but the API layer's own."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith("api/"):
            yield rel, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported_names(tree: ast.Module) -> tuple[list[tuple[int, str]], set[str], set[str]]:
    """The banned imports (line, what), the local names bound to a banned class, and the local
    names bound to the `starlette.requests` module itself."""
    found: list[tuple[int, str]] = []
    names: set[str] = set()
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "starlette.requests":
            for alias in node.names:
                if alias.name in BANNED:
                    found.append((node.lineno, f"starlette.requests.{alias.name}"))
                    names.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module == "starlette":
            for alias in node.names:
                if alias.name == "requests":
                    found.append((node.lineno, "starlette.requests"))
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "starlette.requests":
                    found.append((node.lineno, "starlette.requests"))
                    modules.add(alias.asname or "starlette.requests")
    return found, names, modules


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _names_request(annotation: ast.expr, names: set[str], modules: set[str]) -> bool:
    """Whether a parameter's annotation mentions a banned class, however it is spelled."""
    for node in ast.walk(annotation):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # "Request | None"
            try:
                inner = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                continue
            if _names_request(inner, names, modules):
                return True
        dotted = _dotted(node) if isinstance(node, ast.Name | ast.Attribute) else None
        if dotted is None:
            continue
        if dotted in names:
            return True
        head, _, last = dotted.rpartition(".")
        if last in BANNED and (head in modules or head == "starlette.requests"):
            return True
    return False


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.Module) -> Iterator[Function]:
    """Every function, methods and nested ones included (a lambda's parameters have no
    annotations)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _params(fn: Function) -> Iterator[ast.arg]:
    args = fn.args
    yield from (*args.posonlyargs, *args.args, *args.kwonlyargs)
    if args.vararg is not None:
        yield args.vararg
    if args.kwarg is not None:
        yield args.kwarg


def check(root: Path) -> list[str]:
    """Every breach under `root` (a front/ tree), one line each."""
    report = []
    for rel, tree in _modules(root):
        edge = {fn for module, fn in EDGE if module == rel}
        imports, names, modules = _imported_names(tree)
        if not edge:
            report += [f"{rel}:{line} imports {what}" for line, what in imports]
        for fn in _functions(tree):
            if fn.name in edge:
                continue
            for param in _params(fn):
                if param.annotation is not None and _names_request(param.annotation, names,
                                                                   modules):
                    report.append(f"{rel}:{param.lineno} {fn.name}() takes {param.arg}: "
                                  "a Request")
    return report


def test_nothing_below_the_api_layer_takes_a_starlette_request() -> None:
    report = check(FRONT)
    assert report == [], (
        f"{len(report)} use(s) of Starlette's Request below front/api/ (hand down the request's "
        "context, front/request_context.py, or the fields needed):\n" + "\n".join(report))


def test_every_allowed_edge_function_exists_and_takes_a_request() -> None:
    """An exception that no longer applies is removed, so the list only ever shrinks."""
    for (rel, name), why in EDGE.items():
        assert why
        tree = ast.parse((FRONT / rel).read_text(encoding="utf-8"))
        _, names, modules = _imported_names(tree)
        takes = [fn for fn in _functions(tree) if fn.name == name
                 and any(p.annotation is not None and _names_request(p.annotation, names,
                                                                     modules)
                         for p in _params(fn))]
        assert takes, f"{rel}: {name}() takes no Request any more: drop it from EDGE"


def test_the_checker_catches_planted_violations(tmp_path: Path) -> None:
    root = tmp_path / "front"
    shutil.copytree(FRONT, root, ignore=shutil.ignore_patterns("studio", "__pycache__"))
    assert check(root) == []  # the copy is as clean as the tree

    def plant(rel: str, text: str, *, append: bool = False) -> None:
        path = root / rel
        path.write_text((path.read_text() if append else "") + text)

    # The pipeline taking the request again, the old way.
    plant("chat/pipeline.py", "\nfrom starlette.requests import Request\n\n\n"
          "async def again(request: Request, n: int) -> None: ...\n", append=True)
    # An alias, in a union, in a string, as a keyword-only parameter.
    plant("chat/sessions/planted.py",
          "from starlette.requests import Request as R\n"
          "def f(x: int, *, client: 'R | None' = None) -> None: ...\n")
    # Through the module, without importing the class by name.
    plant("dispatch/planted.py",
          "import starlette.requests\n"
          "def g(*args: starlette.requests.Request) -> None: ...\n")
    plant("archive/planted.py",
          "from starlette import requests as web\n"
          "def h(**kw: web.HTTPConnection) -> None: ...\n")
    # A new function in an edge module is not an edge function.
    plant("state.py", "\n\ndef sneaky(request: Request) -> None: ...\n", append=True)
    # The API layer may, and another class named Request (the metrics' own) is not Starlette's.
    plant("api/planted.py", "from starlette.requests import Request\n"
          "def ok(request: Request) -> None: ...\n")
    plant("ops/planted.py", "from modelyard import metrics as m\n"
          "def fine(request: m.Request) -> None: ...\n")

    report = check(root)
    pipeline_lines = (root / "chat/pipeline.py").read_text().count("\n")
    state_lines = (root / "state.py").read_text().count("\n")
    assert sorted(report) == sorted([
        f"chat/pipeline.py:{pipeline_lines - 3} imports starlette.requests.Request",
        f"chat/pipeline.py:{pipeline_lines} again() takes request: a Request",
        "chat/sessions/planted.py:1 imports starlette.requests.Request",
        "chat/sessions/planted.py:2 f() takes client: a Request",
        "dispatch/planted.py:1 imports starlette.requests",
        "dispatch/planted.py:2 g() takes args: a Request",
        "archive/planted.py:1 imports starlette.requests",
        "archive/planted.py:2 h() takes kw: a Request",
        f"state.py:{state_lines} sneaky() takes request: a Request",
    ])
