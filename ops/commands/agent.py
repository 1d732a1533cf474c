"""``fleetlease agent``: run the host agent (outbound connections only).

NATS URL: ``--nats-url`` > ``FLEETLEASE_NATS_URL`` > the context file of the
state dir (written by ``fleetlease up``). The agent keeps its journal in
``<state dir>/agents/<host id>/`` and holds a lock there, so two agents for one
host never share a journal. SIGTERM or SIGINT: stop claiming, let running
attempts finish within ``--grace-s``, hand back the rest, exit 0.

Exit codes besides the common ones: 3 when the control plane refuses the host's
credential at registration, 7 when the NATS server keeps refusing the host's
authorization for ``--broker-refused-s`` (a revoked host on a secured broker).
Unreachable servers are retried forever.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from fleetlease.hostagent.config import config_default
from fleetlease.ops import eventloop, interpreter
from fleetlease.ops.cli import EXIT_DENIED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError
from fleetlease.ops.commands.status import add_metrics_flag, metrics_from_args
from fleetlease.ops.config import ConfigError, ensure_state_dir, from_args
from fleetlease.ops.logging import configure_logging
from fleetlease.ops.observe import attach as observe
from fleetlease.ops.observe.looplag import LoopLagProbe
from fleetlease.ops.system import AlreadyRunning, single_instance

MAX_RESUMES_ENV = "FLEETLEASE_AGENT_MAX_RESUMES"
#: The NATS server refuses the host's authorization (revoked on a secured broker).
EXIT_BROKER_REFUSED = 7


def register(sub: Any) -> None:
    p = sub.add_parser(
        "agent",
        help="run the host agent for this machine's devices (outbound connections only)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host-id", required=True, help="this host's id (as given to `host add`)")
    p.add_argument(
        "--token-file",
        required=True,
        help="file holding the host credential printed by `fleetlease host add`",
    )
    p.add_argument("--nats-url", help="NATS URL (env FLEETLEASE_NATS_URL, else the context file)")
    p.add_argument(
        "--devices",
        action="append",
        default=None,
        help="a device source: 'simulated:N', 'local:N' (N slots on this host), 'adb' / "
        "'adb:/path/to/adb', 'command:/path/to/lister' or a plugin's NAME[:ARG]; repeat it "
        "or separate sources with commas to combine them (default simulated:4)",
    )
    p.add_argument(
        "--workflows",
        metavar="DIR",
        help="serve the workflow definitions (*.yml) of DIR, each step run as a process "
        "(invalid files are reported and skipped)",
    )
    p.add_argument(
        "--goal-command",
        metavar="CMD",
        help="run goal tasks through CMD (the goal in $FLEETLEASE_GOAL); "
        "default: the --goal-runner",
    )
    p.add_argument(
        "--state-dir",
        help="state directory (env FLEETLEASE_STATE_DIR, default ~/.local/share/fleetlease)",
    )
    p.add_argument("--prefix", help="NATS subject prefix (env FLEETLEASE_PREFIX)")
    p.add_argument(
        "--goal-runner", default=config_default("goal_runner"), help="runner for goal tasks"
    )
    p.add_argument(
        "--workflow-runner",
        default=config_default("workflow_runner"),
        help="runner for workflow tasks",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=config_default("grace_s"),
        help="on SIGTERM, time running attempts get to finish before being handed back",
    )
    p.add_argument(
        "--claim-wait-s",
        type=float,
        default=config_default("claim_wait_s"),
        help="long-poll duration of one claim",
    )
    p.add_argument(
        "--claim-polls",
        type=int,
        default=config_default("claim_polls"),
        help="the idle devices are split between up to this many outstanding claims",
    )
    p.add_argument(
        "--resync-jitter-s",
        type=float,
        default=config_default("resync_jitter_s"),
        help="random delay before re-registering after a reconnect",
    )
    p.add_argument(
        "--max-resumes",
        type=int,
        default=None,
        help="an attempt resumed this many times after agent restarts (it keeps killing "
        f"the agent) is reported as a retryable failure instead of run again "
        f"(env {MAX_RESUMES_ENV}, default {config_default('max_resumes')})",
    )
    p.add_argument(
        "--broker-refused-s",
        type=float,
        default=config_default("broker_refused_s"),
        help="exit (code 7) once the NATS server has refused this host's authorization "
        f"for this long with no successful connect in between (default "
        f"{config_default('broker_refused_s'):g}; a control plane restarting on a "
        "secured broker is refused the same way for a moment)",
    )
    add_metrics_flag(p, default_on=False)
    p.add_argument("--debug", action="store_true", help="debug logs and tracebacks")
    p.set_defaults(func=cmd_agent)


def max_resumes_from(args: argparse.Namespace) -> int:
    """``--max-resumes`` > ``FLEETLEASE_AGENT_MAX_RESUMES`` > the
    :class:`AgentConfig` default; CliError (usage) for anything but an int >= 0."""
    if args.max_resumes is not None:
        value, where = str(args.max_resumes), "--max-resumes"
    else:
        default = str(config_default("max_resumes"))
        value, where = os.environ.get(MAX_RESUMES_ENV, default), MAX_RESUMES_ENV
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise CliError(f"{where} must be an integer >= 0, got {value!r}", EXIT_USAGE)
    return n


def agent_dir(state_dir: Path, host_id: str) -> Path:
    """Where the agent of ``host_id`` keeps its journal and lock."""
    return state_dir / "agents" / host_id


def cmd_agent(args: argparse.Namespace) -> int:
    eventloop.checked_factory(lambda message: CliError(message, EXIT_USAGE))
    from fleetlease.hostagent.agent import (
        FAILPOINTS_ENV,
        Agent,
        AgentConfig,
        BrokerRefused,
        RegistrationRefused,
        load_credential,
        parse_failpoints,
    )
    from fleetlease.hostagent.execution import plan_execution
    from fleetlease.hostagent.runners import load_runners
    from fleetlease.hostagent.sources import device_manager_from_specs
    from fleetlease.transport.subjects import validate_token

    settings = from_args(args).with_context()
    configure_logging(debug=settings.debug, cache=True)
    try:
        validate_token(args.host_id, "--host-id")
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    try:
        credential = load_credential(args.token_file)
    except OSError as exc:
        raise CliError(
            f"cannot read --token-file {args.token_file}: {exc.strerror or exc}", EXIT_USAGE
        ) from None
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if not settings.nats_url:
        raise CliError(
            "no NATS URL: pass --nats-url, set FLEETLEASE_NATS_URL, or run `fleetlease up` "
            f"with --state-dir {settings.state_dir}",
            EXIT_USAGE,
        )
    try:
        max_resumes = max_resumes_from(args)
        devices = device_manager_from_specs(args.devices or ["simulated:4"])
        failpoints = parse_failpoints(os.environ.get(FAILPOINTS_ENV))
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    metrics, _ = metrics_from_args(args, default_on=False)
    directory = agent_dir(settings.state_dir, args.host_id)
    try:
        ensure_state_dir(directory)
        plan = plan_execution(
            state_dir=directory,
            available=load_runners(),
            goal_runner=args.goal_runner,
            workflow_runner=args.workflow_runner,
            workflows_dir=Path(args.workflows) if args.workflows else None,
            goal_command=args.goal_command,
            device_snapshot=devices.snapshot,
            grace_s=min(args.grace_s, 5.0),
            report=lambda line: print(line, file=sys.stderr, flush=True),
        )
        config = AgentConfig(
            host_id=args.host_id,
            credential=credential,
            nats_url=settings.nats_url,
            state_dir=directory,
            prefix=settings.prefix,
            goal_runner=plan.goal_runner,
            workflow_runner=plan.workflow_runner,
            workflows=plan.workflows,
            grace_s=args.grace_s,
            claim_wait_s=args.claim_wait_s,
            claim_polls=args.claim_polls,
            resync_jitter_s=args.resync_jitter_s,
            failpoints=failpoints,
            max_resumes=max_resumes,
            broker_refused_s=args.broker_refused_s,
        )
        agent = Agent(config, devices, runners=plan.runners)
        plan.bind(agent)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    try:
        with single_instance(directory, "agent"):
            interpreter.tune()
            eventloop.run(_run(agent, metrics))
    except AlreadyRunning as exc:
        raise CliError(exc.message, EXIT_UNAVAILABLE) from None
    except RegistrationRefused as exc:
        raise CliError(exc.message, EXIT_DENIED) from None
    except BrokerRefused as exc:
        raise CliError(exc.message, EXIT_BROKER_REFUSED) from None
    return EXIT_OK


async def _run(agent: Any, metrics: str | None = None) -> None:
    loop = asyncio.get_running_loop()
    listener = observe.for_agent(agent, metrics, loop) if metrics else None
    lag = LoopLagProbe().start() if listener is not None else None
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, agent.stop)
    try:
        await agent.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if lag is not None:
            await lag.stop()
        if listener is not None:
            await asyncio.to_thread(listener.stop)
