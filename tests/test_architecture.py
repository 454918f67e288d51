"""The house rules (STYLE.md, docs/architecture.md) as tests: module and function sizes, the
orchestrator's size, no private names across modules, no test module importing another, no
environment variables read by library code. The layer contract itself is `lint-imports`
(pyproject.toml), run by .ci/run."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "diloco_peer"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_ORCHESTRATOR_LINES = 400
OWN_MODULES = {
    "diloco_peer",
    "tests",
    "bench",
    "conftest",
    "_common",
    "_averager_peer",
    "_wan_worker",
}
"""Top-level names of this repository's modules (the package, test and bench helpers)."""


def sources(*folders: str) -> Iterator[tuple[Path, ast.Module]]:
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_no_module_of_the_package_is_over_500_lines() -> None:
    big = {
        rel(p): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert big == {}, f"split these by job (STYLE 1): {big}"


def test_no_function_of_the_package_is_over_80_lines() -> None:
    long = {
        f"{rel(path)}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
        for path, tree in sources("diloco_peer")
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert long == {}


def test_swarm_peer_only_orchestrates() -> None:
    tree = ast.parse((PACKAGE / "peer" / "swarm_peer.py").read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SwarmPeer"]
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 <= MAX_ORCHESTRATOR_LINES


def test_no_private_name_is_imported_from_another_module() -> None:
    found = [
        f"{rel(path)}:{node.lineno} {alias.name} from {node.module}"
        for path, tree in sources("diloco_peer", "tests", "bench")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.level > 0 or (node.module or "").split(".")[0] in OWN_MODULES)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert found == []


def test_no_test_module_imports_another_test_module() -> None:
    found = [
        f"{rel(path)}:{node.lineno}"
        for path, tree in sources("tests")
        for node in ast.walk(tree)
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[-1].startswith("test_")
        )
        or (
            isinstance(node, ast.Import)
            and any(a.name.split(".")[-1].startswith("test_") for a in node.names)
        )
    ]
    assert found == []


def test_library_code_reads_no_environment_variables() -> None:
    found = [
        f"{rel(path)}:{node.lineno}"
        for path, tree in sources("diloco_peer")
        if "cli" not in path.relative_to(PACKAGE).parts
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("environ", "getenv")
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    ]
    assert found == [], "hand settings and test hooks in as arguments (STYLE 12)"
