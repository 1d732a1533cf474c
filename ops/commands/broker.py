"""``fleetlease broker config``: the secured nats-server configuration for a
broker the operator runs (one server, or every member of a cluster), from the
control plane's broker keys in ``<state dir>/broker/``. ``serve
--broker-security`` then serves its auth callout."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleetlease.ops.cli import EXIT_OK, EXIT_USAGE, CliError, add_common
from fleetlease.ops.config import ensure_state_dir, from_args


def register(sub: Any) -> None:
    broker = sub.add_parser("broker", help="the secured NATS broker's configuration")
    bsub = broker.add_subparsers(dest="broker_command", metavar="COMMAND")
    bsub.required = True
    p = bsub.add_parser(
        "config",
        help="write the secured nats-server config (one server, or each member of a cluster)",
    )
    add_common(p)
    p.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="the config file to write; with --cluster, a directory for one NAME.conf per member",
    )
    p.add_argument(
        "--cluster",
        metavar="NAME=HOST[:PORT],...",
        help="the cluster's members: each one's server name and the address the others "
        "open routes to (route port default 6222); at least two",
    )
    p.add_argument("--cluster-name", default="fleetlease", help="the cluster's name")
    p.add_argument(
        "--listen",
        default="0.0.0.0",
        metavar="HOST",
        help="the interface the server(s) listen on, for clients and routes (default 0.0.0.0)",
    )
    p.add_argument("--port", type=int, default=4222, help="the client port (default 4222)")
    p.add_argument(
        "--store-dir",
        metavar="DIR",
        help="JetStream's directory on the server(s) (default: given on their command line)",
    )
    p.add_argument("--tls-cert", metavar="FILE", help="the server's certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="the server's private key (PEM)")
    p.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="the CA of the members' certificates: routes then verify each other",
    )
    p.set_defaults(func=cmd_broker_config)


def _tls(args: argparse.Namespace) -> Any:
    from fleetlease.transport.broker_config import TlsFiles

    if not args.tls_cert and not args.tls_key:
        if args.tls_ca:
            raise CliError("--tls-ca needs --tls-cert and --tls-key", EXIT_USAGE)
        return None
    if not (args.tls_cert and args.tls_key):
        raise CliError("--tls-cert and --tls-key go together", EXIT_USAGE)
    # Clients are not asked for certificates: agents and the CLI present none.
    return TlsFiles(
        cert_file=Path(args.tls_cert).resolve(),
        key_file=Path(args.tls_key).resolve(),
        ca_file=Path(args.tls_ca).resolve() if args.tls_ca else None,
    )


def cmd_broker_config(args: argparse.Namespace) -> int:
    from fleetlease.transport import broker_cluster as bc
    from fleetlease.transport.broker_config import (
        BrokerConfigError,
        BrokerKeys,
        secure_config,
        write_config,
    )
    from fleetlease.transport.subjects import Subjects

    settings = from_args(args)
    out = Path(args.out)
    try:
        # Everything is checked before anything is created or written.
        tls = _tls(args)
        if tls is not None:
            tls.render()  # the files exist
        listen = bc.listen_block(args.listen, args.port, args.store_dir)
        subjects = Subjects(settings.prefix)
        spec = None
        if args.cluster:
            spec = bc.ClusterSpec(
                members=bc.parse_members(args.cluster),
                route_secret=bc.PLACEHOLDER_SECRET,
                name=args.cluster_name,
                listen_host=args.listen,
                client_port=args.port,
                store_dir=args.store_dir,
                tls=tls,
            )
            if out.exists() and not out.is_dir():
                raise CliError(f"--out {out}: with --cluster, a directory", EXIT_USAGE)
        elif out.is_dir():
            raise CliError(f"--out {out} is a directory; name the config file", EXIT_USAGE)
        state = ensure_state_dir(settings.state_dir)
        keys = BrokerKeys.load_or_create(state / "broker")
        if spec is None:
            path = write_config(out, secure_config(keys, tls=tls, subjects=subjects) + listen)
            print(f"wrote {path}")
            print(f"run: nats-server -c {path}")
            print(f"then: fleetlease serve --broker-security --state-dir {state} --nats-url URL")
            return EXIT_OK
        spec = replace(spec, route_secret=bc.load_or_create_route_secret(state / "broker"))
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name, text in bc.cluster_configs(keys, spec, subjects=subjects).items():
            path = write_config(out / f"{name}.conf", text)
            print(f"wrote {path} (member {name}; holds the route secret, keep it 0600)")
    except BrokerConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    except OSError as exc:
        raise CliError(f"cannot write the broker config: {exc}", EXIT_USAGE) from exc
    urls = bc.client_urls(spec)
    print(f"run on each member NAME: nats-server -c {out}/NAME.conf")
    print(
        f"then: fleetlease serve --broker-security --state-dir {state} --nats-url {urls} "
        f"--js-replicas {min(3, len(spec.members))}"
    )
    return EXIT_OK
