"""The user API's errors carry wire codes only; the CLI alone maps them to exit codes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fleetlease.ops import cli
from fleetlease.ops.client import OpsError

OPS = Path(cli.__file__).resolve().parent


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [
        ("bad_request", cli.EXIT_USAGE),
        ("unauthorized", cli.EXIT_DENIED),
        ("forbidden", cli.EXIT_DENIED),
        ("not_found", cli.EXIT_NOT_FOUND),
        ("conflict", cli.EXIT_CONFLICT),
        ("gone", cli.EXIT_CONFLICT),
        ("unavailable", cli.EXIT_UNAVAILABLE),
        ("bad_reply", cli.EXIT_ERROR),
        ("something_new", cli.EXIT_ERROR),
    ],
)
def test_the_cli_maps_each_error_code_to_its_exit_code(code: str, exit_code: int) -> None:
    assert cli.exit_code_for(OpsError("x", code)) == exit_code


def test_an_ops_error_is_no_cli_error_and_knows_no_exit_code() -> None:
    err = OpsError("no control plane answers", "unavailable")
    assert not isinstance(err, cli.CliError)
    assert not hasattr(err, "exit_code")
    assert (err.code, err.message, str(err)) == (
        "unavailable",
        "no control plane answers",
        "no control plane answers",
    )


def test_an_error_without_a_code_exits_1() -> None:
    assert cli.exit_code_for(RuntimeError("boom")) == cli.EXIT_ERROR


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize(
    "path",
    [
        OPS / "client.py",
        *sorted((OPS / "userapi").glob("*.py")),
        *sorted((OPS / "web").glob("*.py")),
    ],
    ids=lambda p: str(p.relative_to(OPS)),
)
def test_the_api_client_and_the_console_import_nothing_of_the_cli(path: Path) -> None:
    bad = {
        m
        for m in _imports(path)
        if m == "fleetlease.ops.cli" or m.startswith("fleetlease.ops.commands")
    }
    assert not bad, f"{path.name} imports {sorted(bad)}"
