"""POST /admin/import checks the folder it is given like a file server (issue 31).

`{"path": "../../../"}` walked the whole filesystem from the front's working directory, and
`/proc` (whose `*/root` links lead back to `/`) never ended. Now a relative path is relative to
$MODELYARD_HOME and may not leave it, `..` may not climb out of the model folders, the kernel's
trees are refused, and the walk is bounded (store/import_roots.py, store/catalog.py WalkLimits).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.fakes.hub_repos import fake_gguf
from tests.integration.harness import config
from tests.integration.pull_support import native_models, post
from tests.support import Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base/front (the home) and, beside it, folders outside every root."""
    base = tmp_path_factory.mktemp("imports")
    fake_gguf(base / "outside" / "escaped-Q4_0.gguf", 20_000, seed=1)
    fake_gguf(base / "explicit" / "wanted-Q4_0.gguf", 20_000, seed=2)
    fake_gguf(base / "front" / "extra" / "homed-Q4_0.gguf", 20_000, seed=3)
    fake_gguf(base / "deep" / "a" / "shallow-Q4_0.gguf", 20_000, seed=4)
    fake_gguf(base / "deep" / "a" / "b" / "c" / "d" / "buried-Q4_0.gguf", 20_000, seed=5)
    for i in range(40):
        (base / "crowded" / f"note-{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (base / "crowded" / f"note-{i}.txt").write_text("x")
    fake_gguf(base / "crowded" / "lost-Q4_0.gguf", 20_000, seed=6)
    (base / "to-sys").symlink_to("/sys/kernel/mm")
    return base


@pytest.fixture(scope="module")
def server(tree: Path) -> Iterator[Server]:
    # Small walk bounds, so the deep and crowded folders cross them.
    cfg = config(hf_cache_dir=str(tree / "hf"), import_max_depth=3, import_max_entries=30)
    s = Server(tree / "front", cfg)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def refused(server: Server, path: str) -> str:
    r = post(server, "/admin/import", {"path": path})
    assert r.status_code == 400, r.text
    assert (r.json()["error"], r.json()["param"]) == ("invalid_request", "path")
    return str(r.json()["message"])


def test_a_relative_path_is_relative_to_the_home_and_stays_in_it(
    server: Server, tree: Path
) -> None:
    r = post(server, "/admin/import", {"path": "extra"})
    assert r.status_code == 200 and r.json()["imported"] == ["homed-q4_0"], r.text
    # The same folder from the front's working directory: the way the old code read it.
    climbing = os.path.relpath(tree / "outside", Path.cwd())
    assert ".." in Path(climbing).parts
    assert "$MODELYARD_HOME" in refused(server, climbing)
    assert "$MODELYARD_HOME" in refused(server, "../outside")
    assert "escaped-q4_0" not in native_models(server)


def test_dot_dot_may_not_climb_out_of_the_roots_but_an_explicit_path_may(
    server: Server, tree: Path
) -> None:
    assert "'..'" in refused(server, f"{tree / 'front'}/../outside")
    assert "escaped-q4_0" not in native_models(server)
    r = post(server, "/admin/import", {"path": str(tree / "explicit")})
    assert r.status_code == 200 and r.json()["imported"] == ["wanted-q4_0"], r.text


@pytest.mark.parametrize("path", ["/proc/self/fdinfo", "/sys/kernel/mm", "/dev", "to-sys"])
def test_the_kernels_trees_are_refused(server: Server, tree: Path, path: str) -> None:
    # `to-sys`: a link (outside the home, named absolutely) into /sys.
    where = str(tree / path) if path == "to-sys" else path
    assert "system folder" in refused(server, where)


def test_the_walk_is_bounded_in_depth_and_entries(server: Server, tree: Path) -> None:
    r = post(server, "/admin/import", {"path": str(tree / "deep")})
    assert r.status_code == 200 and r.json()["imported"] == ["shallow-q4_0"], r.text
    assert "more than 30" in refused(server, str(tree / "crowded"))
    assert "lost-q4_0" not in native_models(server)
