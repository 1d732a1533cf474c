"""Workflow definitions: the YAML files a host declares its workflows in.

One file per workflow, in the directory given to ``fleetlease agent --workflows``::

    name: smoke-test
    description: install the app and run its smoke tests
    timeout: 30m                  # the whole attempt (default 1h)
    inputs:
      build:                      # read by steps as $FLEETLEASE_INPUT_BUILD
        type: string              # string | integer | number | boolean
        required: true
      retries:
        type: integer
        default: 2
    steps:
      - name: install
        run: adb install -r "$FLEETLEASE_INPUT_BUILD"
        timeout: 5m               # this step alone (default: the workflow's)
        env: {ADB_INSTALL_TIMEOUT: "120"}
        retryable-exit-codes: [75]
      - name: test
        run: ./run-smoke.sh --out "$FLEETLEASE_ARTIFACTS"
        continue-on-error: false  # true: a failure is recorded, the workflow goes on
        artifacts: ["reports/*.xml"]

Loading never stops at the first bad file: every definition that validates is
served, and each one that does not is reported with its file and line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import yaml

__all__ = [
    "DefinitionError",
    "InputError",
    "InputSpec",
    "Step",
    "WorkflowDefinition",
    "input_environment",
    "load_workflow",
    "load_workflows",
    "parse_duration",
]

InputType = Literal["string", "integer", "number", "boolean"]
_INPUT_TYPES: tuple[str, ...] = ("string", "integer", "number", "boolean")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_INPUT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
#: Environment names a definition may not set: the runner's own.
_RESERVED_ENV_PREFIX = "FLEETLEASE_"
DEFAULT_TIMEOUT_S = 3600.0
MAX_STEPS = 100
MAX_DEFINITION_BYTES = 256 * 1024


class DefinitionError(ValueError):
    """A workflow file that does not validate; ``line`` is 1-based (0 when unknown)."""

    def __init__(self, path: Path | str, line: int, message: str) -> None:
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.line = line
        self.message = message


class InputError(ValueError):
    """A task's inputs do not match the workflow's declared inputs."""


def parse_duration(value: object, what: str = "duration") -> float:
    """Seconds from ``90``, ``1.5``, ``"500ms"``, ``"30s"``, ``"5m"`` or ``"2h"``."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a duration such as 30s, 5m or 1h")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if m is None:
            raise ValueError(f"{what} must be a duration such as 30s, 5m or 1h, got {value!r}")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not 0 < seconds <= 7 * 24 * 3600:
        raise ValueError(f"{what} must be more than 0 and at most 7 days")
    return seconds


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    name: str
    type: InputType = "string"
    required: bool = False
    default: str | int | float | bool | None = None
    description: str = ""

    def coerce(self, value: object) -> str | int | float | bool:
        """``value`` as this input's type, or ``InputError``."""
        ok: bool
        if self.type == "boolean":
            ok = isinstance(value, bool)
        elif self.type == "integer":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type == "number":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise InputError(f"input {self.name!r} must be a {self.type}, got {value!r}")
        assert isinstance(value, str | int | float | bool)
        return value


@dataclass(frozen=True, kw_only=True)
class Step:
    name: str
    run: str
    timeout_s: float | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    retryable_exit_codes: frozenset[int] = frozenset()
    continue_on_error: bool = False
    artifacts: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class WorkflowDefinition:
    name: str
    description: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    inputs: Mapping[str, InputSpec] = field(default_factory=dict)
    steps: tuple[Step, ...] = ()
    path: str = ""

    def resolve_inputs(
        self, given: Mapping[str, Any] | None
    ) -> dict[str, str | int | float | bool]:
        """The declared inputs with defaults applied, type-checked; an unknown
        or missing required input is an ``InputError``."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.inputs))
        if unknown:
            raise InputError(f"unknown input(s) for workflow {self.name!r}: {', '.join(unknown)}")
        resolved: dict[str, str | int | float | bool] = {}
        for name, spec in self.inputs.items():
            if name in given:
                resolved[name] = spec.coerce(given[name])
            elif spec.default is not None:
                resolved[name] = spec.default
            elif spec.required:
                raise InputError(f"input {name!r} of workflow {self.name!r} is required")
        return resolved


def input_environment(inputs: Mapping[str, str | int | float | bool]) -> dict[str, str]:
    """Inputs as environment variables (``FLEETLEASE_INPUT_<NAME>``): the only
    way a task's input reaches a step, never pasted into its command line."""
    env: dict[str, str] = {}
    for name, value in inputs.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        env[f"FLEETLEASE_INPUT_{name.upper()}"] = text
    return env


# --- loading ------------------------------------------------------------------------


class _Doc:
    """A mapping node of the YAML document, with line numbers for its keys."""

    def __init__(self, path: Path, node: yaml.Node, what: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            raise DefinitionError(path, _line(node), f"{what} must be a mapping")
        self.path = path
        self.node = node
        self.items: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                raise DefinitionError(path, _line(key), f"{what}: keys must be plain names")
            if key.value in self.items:
                raise DefinitionError(path, _line(key), f"{what}: {key.value!r} given twice")
            self.items[key.value] = (key, value)

    def check_keys(self, allowed: set[str], what: str) -> None:
        for name, (key, _value) in self.items.items():
            if name not in allowed:
                raise DefinitionError(
                    self.path,
                    _line(key),
                    f"{what}: unknown key {name!r} (expected one of {', '.join(sorted(allowed))})",
                )

    def get(self, name: str) -> yaml.Node | None:
        item = self.items.get(name)
        return None if item is None else item[1]

    def value(self, name: str) -> Any:
        node = self.get(name)
        return None if node is None else _construct(node)

    def line(self, name: str) -> int:
        node = self.get(name)
        return _line(node) if node is not None else _line(self.node)


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _construct(node: yaml.Node) -> Any:
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _text(doc: _Doc, name: str, what: str, *, required: bool = False, default: str = "") -> str:
    value = doc.value(name)
    if value is None:
        if required:
            raise DefinitionError(doc.path, doc.line(name), f"{what}: {name!r} is required")
        return default
    if not isinstance(value, str):
        raise DefinitionError(doc.path, doc.line(name), f"{what}: {name!r} must be a string")
    return value


def _duration(doc: _Doc, name: str, what: str) -> float | None:
    value = doc.value(name)
    if value is None:
        return None
    try:
        return parse_duration(value, f"{what}: {name!r}")
    except ValueError as exc:
        raise DefinitionError(doc.path, doc.line(name), str(exc)) from None


def _input(path: Path, name: str, node: yaml.Node) -> InputSpec:
    what = f"input {name!r}"
    if not _INPUT_NAME.match(name):
        raise DefinitionError(path, _line(node), f"{what}: names are letters, digits and _")
    doc = _Doc(path, node, what)
    doc.check_keys({"type", "required", "default", "description"}, what)
    kind_value = doc.value("type") or "string"
    if kind_value not in _INPUT_TYPES:
        raise DefinitionError(
            path, doc.line("type"), f"{what}: type must be one of {', '.join(_INPUT_TYPES)}"
        )
    kind = cast(InputType, kind_value)
    required = doc.value("required") or False
    if not isinstance(required, bool):
        raise DefinitionError(path, doc.line("required"), f"{what}: required must be true/false")
    spec = InputSpec(
        name=name, type=kind, required=required, description=_text(doc, "description", what)
    )
    default = doc.value("default")
    if default is not None:
        try:
            default = spec.coerce(default)
        except InputError as exc:
            raise DefinitionError(path, doc.line("default"), f"default: {exc}") from None
        spec = InputSpec(
            name=name, type=kind, required=required, default=default, description=spec.description
        )
    return spec


def _step(path: Path, index: int, node: yaml.Node) -> Step:
    doc = _Doc(path, node, f"step {index + 1}")
    name = doc.value("name")
    what = f"step {name!r}" if isinstance(name, str) else f"step {index + 1}"
    doc.check_keys(
        {"name", "run", "timeout", "env", "retryable-exit-codes", "continue-on-error", "artifacts"},
        what,
    )
    name = _text(doc, "name", what, default=f"step-{index + 1}")
    run = _text(doc, "run", what, required=True)
    if not run.strip():
        raise DefinitionError(path, doc.line("run"), f"{what}: 'run' is empty")
    env_value = doc.value("env") or {}
    if not isinstance(env_value, dict):
        raise DefinitionError(path, doc.line("env"), f"{what}: env must be a mapping")
    env: dict[str, str] = {}
    for key, value in env_value.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise DefinitionError(path, doc.line("env"), f"{what}: bad env name {key!r}")
        if key.startswith(_RESERVED_ENV_PREFIX):
            raise DefinitionError(
                path,
                doc.line("env"),
                f"{what}: env names starting {_RESERVED_ENV_PREFIX} are set by the runner",
            )
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise DefinitionError(path, doc.line("env"), f"{what}: env {key!r} must be a scalar")
        env[key] = str(value)
    codes = doc.value("retryable-exit-codes") or []
    if not isinstance(codes, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= 255 for c in codes
    ):
        raise DefinitionError(
            path, doc.line("retryable-exit-codes"), f"{what}: retryable-exit-codes are 1..255"
        )
    cont = doc.value("continue-on-error") or False
    if not isinstance(cont, bool):
        raise DefinitionError(
            path, doc.line("continue-on-error"), f"{what}: continue-on-error must be true/false"
        )
    globs = doc.value("artifacts") or []
    if isinstance(globs, str):
        globs = [globs]
    if not isinstance(globs, list) or not all(isinstance(g, str) and g for g in globs):
        raise DefinitionError(path, doc.line("artifacts"), f"{what}: artifacts is a list of globs")
    for g in globs:
        if g.startswith("/") or ".." in Path(g).parts:
            raise DefinitionError(
                path, doc.line("artifacts"), f"{what}: artifact globs stay inside the workspace"
            )
    return Step(
        name=name,
        run=run,
        timeout_s=_duration(doc, "timeout", what),
        env=env,
        retryable_exit_codes=frozenset(codes),
        continue_on_error=cont,
        artifacts=tuple(globs),
    )


def load_workflow(path: Path) -> WorkflowDefinition:
    """One definition from ``path``, or ``DefinitionError`` naming file and line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DefinitionError(path, 0, f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_DEFINITION_BYTES:
        raise DefinitionError(path, 0, f"larger than {MAX_DEFINITION_BYTES} bytes")
    try:
        root = yaml.compose(data.decode("utf-8"), Loader=yaml.SafeLoader)
    except UnicodeDecodeError:
        raise DefinitionError(path, 0, "not UTF-8 text") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 0
        raise DefinitionError(path, line, f"not valid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise DefinitionError(path, 0, f"not valid YAML: {exc}") from None
    if root is None:
        raise DefinitionError(path, 1, "the file is empty")
    doc = _Doc(path, root, "workflow")
    doc.check_keys({"name", "description", "timeout", "inputs", "steps"}, "workflow")
    name = _text(doc, "name", "workflow", required=True)
    if not _NAME.match(name):
        raise DefinitionError(
            path, doc.line("name"), "workflow: name is letters, digits, '.', '_', '-' (max 128)"
        )
    inputs: dict[str, InputSpec] = {}
    inputs_node = doc.get("inputs")
    if inputs_node is not None:
        for key, (_k, value) in _Doc(path, inputs_node, "inputs").items.items():
            inputs[key] = _input(path, key, value)
    steps_node = doc.get("steps")
    if not isinstance(steps_node, yaml.SequenceNode) or not steps_node.value:
        raise DefinitionError(path, doc.line("steps"), "workflow: 'steps' is a non-empty list")
    if len(steps_node.value) > MAX_STEPS:
        raise DefinitionError(path, doc.line("steps"), f"workflow: at most {MAX_STEPS} steps")
    steps = tuple(_step(path, i, node) for i, node in enumerate(steps_node.value))
    seen: set[str] = set()
    for i, step in enumerate(steps):
        if step.name in seen:
            raise DefinitionError(
                path, _line(steps_node.value[i]), f"step name {step.name!r} is used twice"
            )
        seen.add(step.name)
    return WorkflowDefinition(
        name=name,
        description=_text(doc, "description", "workflow"),
        timeout_s=_duration(doc, "timeout", "workflow") or DEFAULT_TIMEOUT_S,
        inputs=inputs,
        steps=steps,
        path=str(path),
    )


def load_workflows(directory: Path) -> tuple[dict[str, WorkflowDefinition], list[DefinitionError]]:
    """Every ``*.yml`` / ``*.yaml`` file of ``directory``: the definitions that
    validate by name, and the errors of those that do not (a second file with
    a name already taken is an error too)."""
    found: dict[str, WorkflowDefinition] = {}
    errors: list[DefinitionError] = []
    files = sorted(p for p in directory.iterdir() if p.suffix in (".yml", ".yaml") and p.is_file())
    for path in files:
        try:
            wf = load_workflow(path)
        except DefinitionError as exc:
            errors.append(exc)
            continue
        if wf.name in found:
            errors.append(
                DefinitionError(
                    path, 1, f"workflow {wf.name!r} is already defined in {found[wf.name].path}"
                )
            )
            continue
        found[wf.name] = wf
    return found, errors
