"""The workflow runner runs real processes: outcomes, logs, artifacts, stopping,
timeouts, and inputs that stay inert."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from fleetlease.hostagent.runners.base import RunContext, RunOutcome
from fleetlease.hostagent.runners.process import run_process_group
from fleetlease.hostagent.runners.workflow import CommandGoalRunner, ProcessWorkflowRunner
from fleetlease.hostagent.workflows import WorkflowDefinition, load_workflow
from fleetlease.persistence.model import Outcome, TaskKind


class Sink:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.artifacts: dict[str, bytes] = {}
        self.progress: list[str] = []

    def context(
        self, workflow: str, payload: dict[str, object] | None = None, **kw: object
    ) -> RunContext:
        return RunContext(
            task_id="t1",
            attempt=kw.pop("attempt", 1),  # type: ignore[arg-type]
            device_id="dev-1",
            kind=TaskKind.WORKFLOW,
            workflow=workflow,
            payload=payload or {},
            log=self.lines.append,
            artifact=self.artifacts.__setitem__,
            progress=self.progress.append,
            **kw,  # type: ignore[arg-type]
        )


def define(tmp_path: Path, text: str) -> WorkflowDefinition:
    path = tmp_path / "wf.yml"
    path.write_text(text)
    return load_workflow(path)


def runner(tmp_path: Path, wf: WorkflowDefinition, **kw: object) -> ProcessWorkflowRunner:
    return ProcessWorkflowRunner({wf.name: wf}, tmp_path / "work", grace_s=2.0, **kw)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def found(root: Path, pattern: str) -> list[Path]:
    return list(root.rglob(pattern))


def read_pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in path.read_text().split()]
    except FileNotFoundError:
        return []


async def wait_for(cond: object, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def test_steps_log_write_artifacts_report_fields_and_end_done(tmp_path: Path) -> None:
    wf = define(
        tmp_path,
        """\
name: build
steps:
  - name: one
    run: |
      echo hello from one
      echo "to stderr" >&2
      echo "::fleetlease::progress::half way"
      echo "::fleetlease::result::version=1.2.3"
      mkdir -p reports && echo '<xml/>' > reports/r.xml
      printf 'apk bytes' > "$FLEETLEASE_ARTIFACTS/app.apk"
    artifacts: ["reports/*.xml"]
  - name: two
    run: echo "step $FLEETLEASE_STEP of $FLEETLEASE_WORKFLOW on $FLEETLEASE_DEVICE_ID"
""",
    )
    sink = Sink()
    out = await runner(tmp_path, wf).run(sink.context("build"))
    assert out == RunOutcome.done(result={"version": "1.2.3"})
    assert "hello from one" in sink.lines and "to stderr" in sink.lines
    assert "step two of build on dev-1" in sink.lines
    assert not any(line.startswith("::fleetlease::") for line in sink.lines)
    assert sink.progress == ["half way"]
    assert sink.artifacts == {"app.apk": b"apk bytes", "reports/r.xml": b"<xml/>\n"}
    assert not (tmp_path / "work" / "t1-1").exists(), "the workspace is removed afterwards"


async def test_a_failing_step_fails_with_its_exit_code_and_last_lines(tmp_path: Path) -> None:
    wf = define(
        tmp_path,
        """\
name: w
steps:
  - name: bad
    run: "for i in 1 2 3; do echo line $i; done; exit 3"
  - name: never
    run: touch never-ran
""",
    )
    sink = Sink()
    out = await runner(tmp_path, wf).run(sink.context("w"))
    assert out.outcome is Outcome.FAILED and not out.retryable
    assert out.reason == "step 'bad' exited 3"
    assert out.result["failed_step"] == "bad" and out.result["exit_code"] == 3
    assert out.result["output_tail"] == ["line 1", "line 2", "line 3"]
    assert "::step never" not in sink.lines


async def test_a_retryable_exit_code_is_a_retryable_failure(tmp_path: Path) -> None:
    wf = define(tmp_path, "name: w\nsteps:\n  - run: exit 75\n    retryable-exit-codes: [75]\n")
    out = await runner(tmp_path, wf).run(Sink().context("w"))
    assert out.outcome is Outcome.FAILED and out.retryable


async def test_continue_on_error_records_the_failure_and_goes_on(tmp_path: Path) -> None:
    wf = define(
        tmp_path,
        """\
name: w
steps:
  - {name: flaky, run: exit 1, continue-on-error: true}
  - {name: after, run: echo after}
""",
    )
    sink = Sink()
    out = await runner(tmp_path, wf).run(sink.context("w"))
    assert out.outcome is Outcome.DONE
    assert out.result["continued_after"] == [{"step": "flaky", "exit_code": 1}]
    assert "after" in sink.lines


async def test_inputs_reach_steps_as_environment_only_and_stay_inert(tmp_path: Path) -> None:
    wf = define(
        tmp_path,
        """\
name: w
inputs:
  name: {type: string, required: true}
steps:
  - run: 'echo "got $FLEETLEASE_INPUT_NAME"; ls'
""",
    )
    sink = Sink()
    evil = "$(touch owned); rm -rf ~ `touch owned2` && touch owned3"
    out = await runner(tmp_path, wf).run(sink.context("w", {"inputs": {"name": evil}}))
    assert out.outcome is Outcome.DONE
    assert f"got {evil}" in sink.lines
    assert not any("owned" in line for line in sink.lines if not line.startswith("got "))
    assert not found(tmp_path, "owned*")


async def test_a_bad_input_fails_the_attempt_without_running_anything(tmp_path: Path) -> None:
    wf = define(tmp_path, "name: w\ninputs:\n  n: {type: integer}\nsteps:\n  - run: touch ran\n")
    out = await runner(tmp_path, wf).run(Sink().context("w", {"inputs": {"n": "x"}}))
    assert out.outcome is Outcome.FAILED and not out.retryable and "must be a integer" in out.reason
    assert not found(tmp_path, "ran")


async def test_the_agents_secrets_never_reach_a_step(tmp_path: Path) -> None:
    wf = define(tmp_path, "name: w\nsteps:\n  - run: env\n")
    environ = {
        "PATH": os.environ["PATH"],
        "HOME": "/home/agent",
        "FLEETLEASE_CREDENTIAL": "secret-credential",
        "FLEETLEASE_TOKEN": "secret-token",
        "AWS_SECRET_ACCESS_KEY": "secret-aws",
    }
    sink = Sink()
    out = await runner(tmp_path, wf, environ=environ).run(sink.context("w"))
    assert out.outcome is Outcome.DONE
    dump = "\n".join(sink.lines)
    assert "secret-" not in dump
    assert "HOME=/home/agent" in sink.lines and "FLEETLEASE_TASK_ID=t1" in sink.lines


async def test_cancel_ends_the_step_and_every_process_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    wf = define(
        tmp_path,
        f"""\
name: w
steps:
  - run: |
      sleep 300 &
      echo $! >> {pids}
      sh -c 'sleep 300 & echo $! >> {pids}; wait' &
      echo $$ >> {pids}
      echo started
      wait
""",
    )
    sink = Sink()
    ctx = sink.context("w")
    task = asyncio.create_task(runner(tmp_path, wf).run(ctx))
    await wait_for(lambda: len(read_pids(pids)) == 3)
    started = read_pids(pids)
    assert all(alive(p) for p in started)
    ctx.cancelled.set()
    out = await asyncio.wait_for(task, 30)
    assert out.outcome is Outcome.CANCELLED
    await wait_for(lambda: not any(alive(p) for p in started))


async def test_a_step_timeout_ends_the_group_and_fails_the_attempt(tmp_path: Path) -> None:
    wf = define(tmp_path, "name: w\nsteps:\n  - {name: slow, run: sleep 300, timeout: 500ms}\n")
    out = await runner(tmp_path, wf).run(Sink().context("w"))
    assert out.outcome is Outcome.FAILED and out.reason == "step 'slow' timed out"


async def test_a_background_process_left_behind_by_a_step_is_ended(tmp_path: Path) -> None:
    pid_file = tmp_path / "bg"
    wf = define(tmp_path, f"name: w\nsteps:\n  - run: 'sleep 300 & echo $! > {pid_file}'\n")
    out = await runner(tmp_path, wf).run(Sink().context("w"))
    assert out.outcome is Outcome.DONE
    (pid,) = read_pids(pid_file)
    await wait_for(lambda: not alive(pid))


async def test_a_failing_on_start_ends_the_group_it_was_told_of(tmp_path: Path) -> None:
    started: list[int] = []

    def on_start(pgid: int) -> None:
        started.append(pgid)
        raise RuntimeError("journal unavailable")

    with pytest.raises(RuntimeError, match="journal unavailable"):
        await run_process_group(
            "sleep 300",
            cwd=tmp_path,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            on_line=lambda line: None,
            timeout_s=None,
            stop=asyncio.Event(),
            grace_s=2.0,
            on_start=on_start,
        )
    (pgid,) = started
    await wait_for(lambda: not alive(pgid))


async def test_a_failing_line_handler_does_not_stall_a_chatty_step(tmp_path: Path) -> None:
    """The step writes far more than a pipe holds; its lines' handler fails at
    the first. The output is still read to the end (the step is never blocked
    on a full pipe, here with no timeout), then the handler's error is raised."""

    def on_line(line: str) -> None:
        raise ValueError("sink closed")

    with pytest.raises(ValueError, match="sink closed"):
        await asyncio.wait_for(
            run_process_group(
                "seq 1 200000; echo finished > done",
                cwd=tmp_path,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                on_line=on_line,
                timeout_s=None,
                stop=asyncio.Event(),
                grace_s=2.0,
            ),
            timeout=60,
        )
    assert (tmp_path / "done").read_text() == "finished\n"


async def test_an_unknown_workflow_is_a_retryable_failure(tmp_path: Path) -> None:
    wf = define(tmp_path, "name: w\nsteps:\n  - run: exit 0\n")
    out = await runner(tmp_path, wf).run(Sink().context("other"))
    assert out.outcome is Outcome.FAILED and out.retryable


async def test_the_goal_command_gets_the_goal_and_the_device(tmp_path: Path) -> None:
    script = tmp_path / "planner.sh"
    script.write_text('#!/bin/sh\necho "goal=$FLEETLEASE_GOAL device=$FLEETLEASE_DEVICE_ID"\n')
    script.chmod(0o755)
    sink = Sink()
    ctx = RunContext(
        task_id="t2", attempt=1, device_id="dev-9", kind=TaskKind.GOAL,
        goal="open settings; rm -rf /", log=sink.lines.append,
    )  # fmt: skip
    out = await CommandGoalRunner(str(script), tmp_path / "work").run(ctx)
    assert out.outcome is Outcome.DONE
    assert "goal=open settings; rm -rf / device=dev-9" in sink.lines


@pytest.mark.parametrize(("code", "retryable"), [(1, False), (75, True)])
async def test_the_goal_command_fails_on_nonzero_exit(
    tmp_path: Path, code: int, retryable: bool
) -> None:
    ctx = RunContext(task_id="t3", attempt=1, device_id="d", kind=TaskKind.GOAL, goal="g")
    out = await CommandGoalRunner(f"exit {code}", tmp_path / "work").run(ctx)
    assert out.outcome is Outcome.FAILED and out.retryable is retryable


# --- the output pipe's descriptor -------------------------------------------------------------


async def _steps_leave_other_descriptors_open(tmp_path: Path) -> None:
    """Steps run while threads keep opening descriptors (each takes the lowest
    free number, so often the number of the pipe a step just closed). A second
    close of a pipe's number would close a thread's descriptor under it: its
    own use of it then fails with EBADF."""
    stop = threading.Event()
    stolen: list[OSError] = []

    def open_and_close() -> None:
        while not stop.is_set():
            fd = os.open(os.devnull, os.O_RDONLY)
            try:
                os.fstat(fd)
            except OSError as exc:
                stolen.append(exc)
            try:
                os.close(fd)
            except OSError as exc:
                stolen.append(exc)

    threads = [threading.Thread(target=open_and_close, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for i in range(300):
            lines: list[str] = []
            res = await run_process_group(
                f"echo line {i}",
                cwd=tmp_path,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                on_line=lines.append,
                timeout_s=30.0,
                stop=asyncio.Event(),
                grace_s=1.0,
            )
            assert (res.exit_code, lines) == (0, [f"line {i}"])
            assert not stolen, stolen
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not stolen, stolen


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_the_output_pipe_is_closed_once_on_either_loop(tmp_path: Path, loop_kind: str) -> None:
    factory = None
    if loop_kind == "uvloop":
        factory = pytest.importorskip("uvloop").new_event_loop
    with asyncio.Runner(loop_factory=factory) as loop_runner:
        loop_runner.run(_steps_leave_other_descriptors_open(tmp_path))
