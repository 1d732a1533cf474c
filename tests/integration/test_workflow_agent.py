"""Workflows run by a real ``fleetlease agent --workflows`` process against a real
control plane: outcomes, logs and artifacts, cancel, inert inputs, the step's
environment, invalid definitions, and process groups across an agent crash.
"""

from __future__ import annotations

import hashlib
import signal
import sqlite3
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fleetlease.hostagent.journal import JOURNAL_FILENAME
from fleetlease.persistence.model import RetryPolicy, TaskKind
from fleetlease.persistence.reads import Reads
from tests.integration.test_agent import ADMIN, System, eventually
from tests.integration.test_agent_process import (
    AgentProcess,
    Processes,
    make_system,  # noqa: F401
    procs,  # noqa: F401
)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not), read from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


async def submit(system: System, workflow: str, inputs: dict[str, Any] | None = None,
                 **overrides: Any) -> str:  # fmt: skip
    fields: dict[str, Any] = {
        "kind": TaskKind.WORKFLOW,
        "goal": None,
        "workflow": workflow,
        "payload": {"inputs": inputs or {}},
        "retry": RetryPolicy(max_attempts=3, backoff_base_s=0.0),
    }
    fields.update(overrides)
    return await system.submit(**fields)


async def lines_of(system: System, task_id: str) -> list[str]:
    return [r["line"] for r in await system.repo.read_logs(task_id, ADMIN)]


async def wait_line(system: System, task_id: str, prefix: str) -> str:
    found = await eventually(
        lambda: lines_of(system, task_id),
        lambda lines: any(line.startswith(prefix) for line in lines),
        timeout=30,
    )
    return next(line for line in found if line.startswith(prefix))


def spawn_workflow_agent(p: Processes, host_id: str, workflows: Path, **kw: Any) -> AgentProcess:
    extra = ["--workflows", str(workflows), *kw.pop("extra_args", ())]
    return p.spawn(host_id, extra_args=extra, **kw)


# --- outcomes, logs, artifacts, inputs, environment -----------------------------------------


async def test_workflows_end_done_failed_and_retried_with_logs_and_artifacts(
    procs: Callable[..., Awaitable[Processes]],  # noqa: F811
    tmp_path: Path,
) -> None:
    p = await procs(lease_s=10.0)
    system = p.system
    await system.add_host("h-wf")
    wfdir = tmp_path / "workflows"
    marker = tmp_path / "injected"
    write(wfdir, "build.yml", """
        name: build
        inputs:
          name: {type: string, required: true}
        steps:
          - name: greet
            run: |
              echo "hello $FLEETLEASE_INPUT_NAME"
              echo "::fleetlease::result::greeted=$FLEETLEASE_INPUT_NAME"
          - name: report
            run: |
              out="$FLEETLEASE_ARTIFACTS/report.txt"
              printf 'report for %s\\n' "$FLEETLEASE_INPUT_NAME" > "$out"
              env | sort
    """)  # fmt: skip
    write(wfdir, "fails.yml", """
        name: fails
        steps:
          - {name: boom, run: 'echo about to fail; exit 1'}
    """)  # fmt: skip
    write(wfdir, "flaky.yml", """
        name: flaky
        steps:
          - {name: try, run: 'echo temporary; exit 75', retryable-exit-codes: [75]}
    """)  # fmt: skip
    broken = write(wfdir, "broken.yml", """
        name: broken
        steps:
          - name: x
            runn: echo typo
    """)  # fmt: skip
    canary = "canary-" + hashlib.sha256(b"not for steps").hexdigest()[:16]
    agent = spawn_workflow_agent(
        p, "h-wf", wfdir, devices="local:2",
        extra_env={"FLEETLEASE_TOKEN": canary, "AGENT_SECRET": canary},
    )  # fmt: skip
    invalid = await agent.wait_event("workflow_invalid")
    assert invalid["path"] == str(broken) and invalid["line"] == 4
    await agent.wait_event("agent_registered")
    # Reported on stderr too, with file and line.
    assert f"{broken}:4:" in agent.log_path.read_text()

    hostile = f"$(touch {marker}); `touch {marker}`; echo x > {marker}"
    ok = await submit(system, "build", {"name": hostile})
    fails = await submit(system, "fails")
    flaky = await submit(system, "flaky")

    done = await system.wait_state(ok, "done", timeout=60)
    failed = await system.wait_state(fails, "failed", timeout=60)
    retried = await system.wait_state(flaky, "failed", timeout=90)

    assert done["attempt"] == 1 and done["result"]["greeted"] == hostile
    assert failed["attempt"] == 1
    assert failed["result"]["failed_step"] == "boom" and failed["result"]["exit_code"] == 1
    assert retried["attempt"] == 3  # retryable: every attempt of the policy was used
    # The input reached the step as data only.
    assert not marker.exists()
    lines = await eventually(
        lambda: lines_of(system, ok), lambda ls: any(line.startswith("PATH=") for line in ls)
    )
    assert f"hello {hostile}" in lines
    # The step's environment: allowlisted variables and the runner's own, never
    # the agent's credential or anything else of its environment.
    env_lines = [line for line in lines if "=" in line and not line.startswith("::")]
    names = {line.split("=", 1)[0] for line in env_lines}
    assert "FLEETLEASE_DEVICE_SERIAL" in names and "ANDROID_SERIAL" not in names
    assert "FLEETLEASE_TOKEN" not in names and "AGENT_SECRET" not in names
    credential = system.credentials["h-wf"]
    assert not any(canary in line or credential in line for line in lines)
    artifacts = await eventually(
        lambda: system.repo.list_artifacts(ok, ADMIN), lambda a: len(a) == 1, timeout=20
    )
    expected = f"report for {hostile}\n".encode()
    assert artifacts[0]["name"] == "report.txt"
    assert artifacts[0]["sha256"] == hashlib.sha256(expected).hexdigest()
    # An unknown workflow (the broken one) is not served by this host.
    assert "broken" not in agent.named("workflows_loaded")[0]["workflows"]


async def test_cancel_of_a_running_step_leaves_no_process(
    procs: Callable[..., Awaitable[Processes]],  # noqa: F811
    tmp_path: Path,
) -> None:
    p = await procs(lease_s=10.0)
    system = p.system
    await system.add_host("h-wf")
    wfdir = tmp_path / "workflows"
    write(wfdir, "hang.yml", """
        name: hang
        steps:
          - name: wait
            run: 'sleep 301 & echo "child $!"; echo "leader $$"; exec sleep 300'
    """)  # fmt: skip
    agent = spawn_workflow_agent(p, "h-wf", wfdir, devices="local:1")
    await agent.wait_event("agent_registered")
    task_id = await submit(system, "hang")
    child = int((await wait_line(system, task_id, "child ")).split()[1])
    leader = int((await wait_line(system, task_id, "leader ")).split()[1])
    assert alive(child) and alive(leader)

    await system.cp.cancel(task_id, ADMIN)
    view = await system.wait_state(task_id, "cancelled", timeout=60)

    assert view["attempt"] == 1
    await eventually(_alive_of(child, leader), lambda n: n == 0, timeout=20)


def _alive_of(*pids: int) -> Callable[[], Awaitable[int]]:
    async def probe() -> int:
        return sum(alive(pid) for pid in pids)

    return probe


def _journal_groups(directory: Path) -> Callable[[], Awaitable[list[str]]]:
    async def probe() -> list[str]:
        path = directory / JOURNAL_FILENAME
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        except sqlite3.Error:
            return []
        try:
            return [r[0] for r in conn.execute("SELECT pgroups FROM entries").fetchall()]
        except sqlite3.Error:
            return []
        finally:
            conn.close()

    return probe


async def test_a_restarted_agent_ends_the_steps_of_its_killed_predecessor(
    procs: Callable[..., Awaitable[Processes]],  # noqa: F811
    tmp_path: Path,
) -> None:
    p = await procs(lease_s=30.0)
    system = p.system
    await system.add_host("h-wf")
    wfdir = tmp_path / "workflows"
    first_run = tmp_path / "first-run"
    write(wfdir, "once.yml", f"""
        name: once
        steps:
          - name: wait
            run: |
              if [ ! -e {first_run} ]; then
                touch {first_run}; echo "leader $$"; exec sleep 300
              fi
              echo "::fleetlease::result::run=second"
    """)  # fmt: skip
    agent = spawn_workflow_agent(p, "h-wf", wfdir, devices="local:1")
    await agent.wait_event("agent_registered")
    task_id = await submit(system, "once")
    leader = int((await wait_line(system, task_id, "leader ")).split()[1])
    # The step's group is in the journal before the agent dies.
    await eventually(
        _journal_groups(system.agent_dir("h-wf")),
        lambda rows: any(f"[{leader}," in r for r in rows),
    )

    agent.kill()
    assert await agent.wait_exit() == -signal.SIGKILL
    assert alive(leader)  # a step outlives its agent

    restarted = spawn_workflow_agent(p, "h-wf", wfdir, devices="local:1")
    ended = await restarted.wait_event("orphan_process_groups_ended", task_id=task_id)
    assert ended["signalled"] == 1
    await eventually(_alive_of(leader), lambda n: n == 0, timeout=20)
    view = await system.wait_state(task_id, "done", timeout=60)
    assert view["attempt"] == 1
    assert view["result"]["run"] == "second"
    # The group was ended before the resumed attempt ran again.
    events = [e["event"] for e in restarted.events()]
    assert events.index("orphan_process_groups_ended") < events.index("attempt_resumed")


# --- matching ------------------------------------------------------------------------------


async def test_a_workflow_task_waits_for_a_host_that_serves_it(
    procs: Callable[..., Awaitable[Processes]],  # noqa: F811
    tmp_path: Path,
) -> None:
    p = await procs(lease_s=10.0)
    system = p.system
    reads = Reads(system.repo)
    for host in ("h-a", "h-b"):
        await system.add_host(host)
    step = "steps: [{name: s, run: 'echo ran on $FLEETLEASE_DEVICE_ID'}]\n"
    write(tmp_path / "wf-a", "other.yml", "name: other\n" + step)
    write(tmp_path / "wf-b", "needed.yml", "name: needed\n" + step)
    agent_a = spawn_workflow_agent(p, "h-a", tmp_path / "wf-a", devices="local:1")
    await agent_a.wait_event("agent_registered")

    async def host_a() -> dict[str, Any]:
        return next(h for h in await system.repo.list_hosts() if h["host_id"] == "h-a")

    advertised = await eventually(host_a, lambda h: h["workflows"] == ["other"])
    assert advertised["goal_runner"] == "sim-goal"

    needed = await submit(system, "needed")
    # Submitted later, ranked after "needed": its running to the end on h-a's
    # only device shows that "needed" was passed over, not merely not reached.
    other = await submit(system, "other")
    done = await system.wait_state(other, "done", timeout=60)
    assert done["attempts"][0]["host_id"] == "h-a"
    waiting = await reads.task_view(needed, ADMIN)
    assert (waiting["state"], waiting["attempt"]) == ("queued", 0)
    assert waiting["waiting_reason"] == "no live host serves workflow 'needed'"

    agent_b = spawn_workflow_agent(p, "h-b", tmp_path / "wf-b", devices="local:1")
    await agent_b.wait_event("agent_registered")
    view = await system.wait_state(needed, "done", timeout=60)

    assert [a["host_id"] for a in view["attempts"]] == ["h-b"]
    assert (await reads.task_view(needed, ADMIN))["waiting_reason"] is None


async def test_goal_tasks_run_through_the_goal_command(
    procs: Callable[..., Awaitable[Processes]],  # noqa: F811
    tmp_path: Path,
) -> None:
    p = await procs(lease_s=10.0)
    system = p.system
    await system.add_host("h-g")
    command = tmp_path / "automate"
    command.write_text(
        "#!/bin/sh\n"
        'echo "goal: $FLEETLEASE_GOAL on $FLEETLEASE_DEVICE_SERIAL"\n'
        'case "$FLEETLEASE_GOAL" in *later*) exit 75 ;; esac\n'
    )
    command.chmod(0o755)
    agent = p.spawn("h-g", devices="local:1", extra_args=["--goal-command", str(command)])
    await agent.wait_event("agent_registered")

    async def host() -> dict[str, Any]:
        return next(h for h in await system.repo.list_hosts() if h["host_id"] == "h-g")

    # No --workflows: this host takes any workflow (the simulated runner's).
    advert = await eventually(host, lambda h: h["goal_runner"] == "command-goal")
    assert advert["workflows"] is None
    ok = await system.submit(payload={}, goal="open the settings")
    later = await system.submit(payload={}, goal="try later")

    assert (await system.wait_state(ok, "done", timeout=60))["attempt"] == 1
    assert (await system.wait_state(later, "failed", timeout=90))["attempt"] == 3
    await wait_line(system, ok, "goal: open the settings on local-0")
