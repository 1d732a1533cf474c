"""Workflow definitions: what validates, and where a bad one is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetlease.hostagent.workflows import (
    DefinitionError,
    InputError,
    input_environment,
    load_workflow,
    load_workflows,
    parse_duration,
)

GOOD = """\
name: smoke
description: two steps
timeout: 10m
inputs:
  build: {type: string, required: true}
  retries: {type: integer, default: 2}
  verbose: {type: boolean, default: false}
steps:
  - name: install
    run: echo "$FLEETLEASE_INPUT_BUILD"
    timeout: 30s
    env: {MODE: fast, LEVEL: 3}
    retryable-exit-codes: [75]
  - name: test
    run: ./run.sh
    continue-on-error: true
    artifacts: ["reports/*.xml"]
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_full_definition_loads_with_every_field(tmp_path: Path) -> None:
    wf = load_workflow(write(tmp_path, "smoke.yml", GOOD))
    assert wf.name == "smoke" and wf.description == "two steps" and wf.timeout_s == 600
    assert [s.name for s in wf.steps] == ["install", "test"]
    install, test = wf.steps
    assert install.timeout_s == 30 and install.env == {"MODE": "fast", "LEVEL": "3"}
    assert install.retryable_exit_codes == {75} and not install.continue_on_error
    assert test.continue_on_error and test.artifacts == ("reports/*.xml",)
    assert test.timeout_s is None
    assert wf.inputs["retries"].default == 2 and wf.inputs["build"].required


def test_inputs_get_defaults_types_and_refuse_unknown_or_missing(tmp_path: Path) -> None:
    wf = load_workflow(write(tmp_path, "smoke.yml", GOOD))
    assert wf.resolve_inputs({"build": "b1"}) == {"build": "b1", "retries": 2, "verbose": False}
    with pytest.raises(InputError, match="required"):
        wf.resolve_inputs({})
    with pytest.raises(InputError, match="unknown input"):
        wf.resolve_inputs({"build": "b", "bogus": 1})
    with pytest.raises(InputError, match="must be a integer"):
        wf.resolve_inputs({"build": "b", "retries": "2"})
    env = input_environment(wf.resolve_inputs({"build": "$(touch owned)", "verbose": True}))
    assert env["FLEETLEASE_INPUT_BUILD"] == "$(touch owned)"
    assert env["FLEETLEASE_INPUT_VERBOSE"] == "true"


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("name: x\nsteps:\n  - run: a\n    bogus: 1\n", 4, "unknown key 'bogus'"),
        ("name: x\nsteps: []\n", 2, "non-empty list"),
        ("name: x\nsteps:\n  - name: a\n", 3, "'run' is required"),
        ("name: x\ntimeout: soon\nsteps:\n  - run: a\n", 2, "duration"),
        ("name: x\nsteps:\n  - run: a\n    timeout: -1\n", 4, "more than 0"),
        ("name: x\nsteps:\n  - run: a\n    env: {FLEETLEASE_X: x}\n", 4, "set by the runner"),
        ("name: x\nsteps:\n  - run: a\n    artifacts: ['../up']\n", 4, "inside the workspace"),
        ("name: x\ninputs:\n  n: {type: integer, default: no}\nsteps:\n  - run: a\n", 3, "default"),
        ("name: x\nsteps:\n  - run: a\n  - run: [unclosed\n", 5, "not valid YAML"),
        ("steps:\n  - run: a\n", 1, "'name' is required"),
        ("name: a b\nsteps:\n  - run: a\n", 1, "name is letters"),
        ("name: x\nsteps:\n  - {name: a, run: b}\n  - {name: a, run: c}\n", 4, "used twice"),
    ],
)
def test_a_bad_definition_names_its_file_and_line(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(DefinitionError) as err:
        load_workflow(path)
    assert err.value.path == str(path)
    assert err.value.line == line, str(err.value)
    assert message in str(err.value)
    assert str(err.value).startswith(f"{path}:{line}: ")


def test_a_directory_serves_the_good_files_and_reports_the_bad(tmp_path: Path) -> None:
    write(tmp_path, "a.yml", GOOD)
    write(tmp_path, "b.yaml", "name: other\nsteps:\n  - run: exit 0\n")
    write(tmp_path, "c.yml", "name: broken\nsteps: nope\n")
    write(tmp_path, "d.yml", GOOD)  # the same name again
    write(tmp_path, "notes.txt", "not a workflow")
    found, errors = load_workflows(tmp_path)
    assert sorted(found) == ["other", "smoke"]
    assert sorted(Path(e.path).name for e in errors) == ["c.yml", "d.yml"]


@pytest.mark.parametrize(
    ("value", "seconds"), [(90, 90.0), ("500ms", 0.5), ("30s", 30.0), ("5m", 300.0), ("2h", 7200.0)]
)
def test_durations(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", [0, "0s", "8d", True, "10 minutes", None])
def test_bad_durations(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)
