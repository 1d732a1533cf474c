"""``fleetlease up`` as a new user meets it: the whole system in one command
(embedded PostgreSQL and NATS, the control plane, a local agent with 4
simulated devices, an admin whose token is in the context file), driven by the
CLI with no flags but the state dir, stopped with Ctrl-C and started again.

Runs ``up`` as a real subprocess on a fresh state dir; everything is awaited by
polling a condition with a deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fleetlease.ops.cli import main

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(600)]

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
ENV_VARS = (
    "FLEETLEASE_TOKEN",
    "FLEETLEASE_NATS_URL",
    "FLEETLEASE_DATABASE_URL",
    "FLEETLEASE_PREFIX",
    "FLEETLEASE_STATE_DIR",
)


def wait_for(probe: Callable[[], T], ok: Callable[[T], bool], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    value = probe()
    while not ok(value):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s (last: {value!r})")
        time.sleep(0.2)
        value = probe()
    return value


def processes_using(path: Path) -> list[tuple[int, str]]:
    """Processes whose command line mentions ``path`` (the embedded postgres and
    nats-server of a state dir, and the agent)."""
    needle = str(path).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


@dataclass
class Up:
    state_dir: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, *, demo: bool = False, extra: Sequence[str] = ()) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
        argv = [sys.executable, "-m", "fleetlease.ops.cli", "up"]
        # A port of its own: tests run side by side (the default is 127.0.0.1:9464).
        argv += ["--state-dir", str(self.state_dir), "--metrics", "127.0.0.1:0", *extra]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*argv, "--demo"] if demo else argv,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def context(self) -> dict[str, Any]:
        try:
            data = json.loads((self.state_dir / "context.json").read_text())
        except (OSError, ValueError):
            return {}
        assert self.alive(), f"up exited early:\n{self.log.read_text()}"
        return data if isinstance(data, dict) else {}

    def wait_ready(self) -> dict[str, Any]:
        assert self.proc is not None
        pid = self.proc.pid
        return wait_for(
            self.context,
            lambda c: c.get("pid") == pid and bool(c.get("admin_token_path")),
            180,
            "context.json written by this up",
        )

    def interrupt(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(120)

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Up]:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    # A short path: the embedded PostgreSQL listens on a unix socket in it.
    state = Path(os.environ.get("TMPDIR", "/tmp")) / f"flup-{os.getpid()}-{time.monotonic_ns()}"
    state.mkdir()
    system = Up(state, tmp_path / "up.log")
    try:
        yield system
    finally:
        system.kill()
        # Nothing of this state dir may outlive the test, whatever happened.
        for pid, _ in processes_using(state):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(state)], check=False)


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        assert self.code == 0, (self.code, self.err)
        return json.loads(self.out)


def fleetlease(
    capsys: pytest.CaptureFixture[str], state_dir: Path, *argv: str, token: str | None = None
) -> Run:
    """Run a command the way the README says: no flags but the state dir."""
    capsys.readouterr()
    full = [*argv, "--state-dir", str(state_dir)]
    if token is not None:
        full += ["--token", token]
    try:
        code = main(full)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return Run(code, out.out, out.err)


def test_up_is_a_whole_system_that_survives_a_restart(
    up: Up, capsys: pytest.CaptureFixture[str]
) -> None:
    def fl(*argv: str, token: str | None = None) -> Run:
        return fleetlease(capsys, up.state_dir, *argv, token=token)

    up.start()
    ctx = up.wait_ready()
    token_path = Path(ctx["admin_token_path"])
    assert token_path.stat().st_mode & 0o777 == 0o600
    # `status` finds the metrics listener through the context file.
    assert str(ctx["metrics_url"]).startswith("http://127.0.0.1:")
    status = fl("status", "--json")
    assert status.json()["ready"] is True, status.out

    hosts = wait_for(
        lambda: fl("hosts", "--json"),
        lambda r: r.code == 0 and any(h["live"] and h["devices"] == 4 for h in json.loads(r.out)),
        60,
        "the local host live with 4 devices",
    ).json()
    assert [h["host_id"] for h in hosts] == ["local"]

    ids = fl("submit", "--goal", "open settings", "--count", "20", "--json").json()["ids"]
    assert len(ids) == 20

    def states() -> dict[str, str]:
        return {t["id"]: t["state"] for t in fl("tasks", "--json", "--limit", "500").json()}

    wait_for(states, lambda s: all(s.get(i) == "done" for i in ids), 120, "20 tasks done")

    hang = fl(
        "submit", "--goal", "wait", "--payload", '{"sim": {"outcome": "hang"}}', "--json"
    ).json()["id"]
    wait_for(lambda: states().get(hang), lambda s: s == "running", 60, "hang task running")
    bob = fl("user", "add", "bob", "--json").json()["token"]
    denied = fl("cancel", hang, "--user", "bob", token=bob)
    assert denied.code == 3 and "forbidden" in denied.err
    assert fl("task", "show", hang, "--json").json()["cancel"]["requested"] is False
    assert fl("cancel", hang, "--json").json()["cancel"]["requested"] is True
    wait_for(lambda: states().get(hang), lambda s: s == "cancelled", 60, "hang task cancelled")

    before = {i: fl("task", "show", i, "--json").json() for i in [*ids, hang]}
    running = processes_using(up.state_dir)
    assert any("postgres" in cmd for _, cmd in running), running
    assert any("nats-server" in cmd for _, cmd in running), running

    assert up.interrupt() == 0, up.log.read_text()
    assert processes_using(up.state_dir) == []
    assert not (up.state_dir / "postgres" / "pgdata" / "postmaster.pid").exists()

    up.start()
    up.wait_ready()
    wait_for(lambda: fl("whoami").code, lambda c: c == 0, 60, "the control plane answering")
    after = {i: fl("task", "show", i, "--json").json() for i in before}
    for task_id, task in before.items():
        again = after[task_id]
        assert again["state"] == task["state"]
        assert again["attempts"] == task["attempts"]
        assert again["attempts"], task_id
    assert after[hang]["state"] == "cancelled"
    assert after[hang]["attempts"][-1]["end_reason"] == "cancelled"
    assert all(after[i]["attempts"][-1]["end_reason"] == "done" for i in ids)
    assert fl("cancel", hang, "--user", "bob", token=bob).code == 3

    assert up.interrupt() == 0, up.log.read_text()
    assert processes_using(up.state_dir) == []


def test_a_second_up_on_the_same_state_dir_refuses_to_start(up: Up) -> None:
    up.start()
    up.wait_ready()
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    second = subprocess.run(
        [sys.executable, "-m", "fleetlease.ops.cli", "up", "--state-dir", str(up.state_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 6, second.stderr
    assert "running" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    assert up.interrupt() == 0
    assert processes_using(up.state_dir) == []


def test_up_demo_shows_tasks_done_failed_retried_and_cancelled(
    up: Up, capsys: pytest.CaptureFixture[str]
) -> None:
    up.start(demo=True)
    up.wait_ready()

    def tasks() -> list[dict[str, Any]]:
        run = fleetlease(capsys, up.state_dir, "tasks", "--json", "--limit", "500")
        return run.json() if run.code == 0 else []

    def outcomes(ts: list[dict[str, Any]]) -> set[tuple[str, int]]:
        return {(t["state"], t["attempt"]) for t in ts}

    seen = wait_for(
        tasks,
        lambda ts: {("done", 1), ("failed", 1), ("failed", 3), ("cancelled", 1)} <= outcomes(ts),
        120,
        "demo tasks done, failed, failed after 3 attempts (retried), cancelled",
    )
    assert {t["kind"] for t in seen} == {"goal", "workflow"}
    assert up.interrupt() == 0, up.log.read_text()
    assert processes_using(up.state_dir) == []
    # Without a terminal the demo prints one line per state change.
    out = up.log.read_text()
    assert " retrying " in out and " cancelled " in out


README_WORKFLOW = """\
name: hello
inputs:
  who: {type: string, required: true}
steps:
  - name: greet
    run: echo "hello $FLEETLEASE_INPUT_WHO"
  - name: report
    run: echo "greeted $FLEETLEASE_INPUT_WHO" > "$FLEETLEASE_ARTIFACTS/report.txt"
"""


def test_the_readme_workflow_tutorial(
    up: Up, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fl(*argv: str) -> Run:
        return fleetlease(capsys, up.state_dir, *argv)

    workflows = tmp_path / "workflows"
    workflows.mkdir()
    (workflows / "hello.yml").write_text(README_WORKFLOW)
    up.start(extra=["--devices", "local:2", "--workflows", str(workflows)])
    up.wait_ready()
    [host] = wait_for(
        lambda: fl("hosts", "--json"),
        lambda r: r.code == 0 and any(h["live"] and h["devices"] == 2 for h in json.loads(r.out)),
        60,
        "the local host live with 2 devices",
    ).json()
    assert host["workflows"] == ["hello"]

    payload = '{"inputs": {"who": "world"}}'
    task_id = fl("submit", "--workflow", "hello", "--payload", payload, "--json").json()["id"]
    followed = fl("logs", task_id, "--follow")
    assert followed.code == 0 and "hello world" in followed.out
    assert fl("task", "show", task_id, "--json").json()["state"] == "done"
    monkeypatch.chdir(tmp_path)
    got = wait_for(
        lambda: fl("artifacts", task_id, "--get", "report.txt"), lambda r: r.code == 0, 30,
        "the artifact downloaded",
    )  # fmt: skip
    assert got.code == 0 and (tmp_path / "report.txt").read_text() == "greeted world\n"
    assert up.interrupt() == 0, up.log.read_text()
