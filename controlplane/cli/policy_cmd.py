"""`kvplane policy get|update|watch`: read and change a live control plane's policy over gRPC.

The target is any server of ``kvplane.v1.PolicyService``: ``kvplane serve`` (its ``--listen``) or
an SGLang server launched with ``--enable-layered-kv --kv-policy-listen HOST:PORT`` (the embedded
control plane). Examples::

    kvplane policy get --target 127.0.0.1:50061
    kvplane policy update --target 127.0.0.1:50061 --token-file token \\
        --set slo_tbt_ms=150 --set alpha=0.5 --set scheduler=lvf --set lvf.alpha=2
    kvplane policy watch --target 127.0.0.1:50061 --count 2

``get`` and ``update`` print the (new) policy as one JSON object; ``watch`` prints the current
policy, then every new version, one JSON object per line (``--count N`` stops after N). An
update needs the server's bearer token when it has one (``--token-file``): without it the answer
is UNAUTHENTICATED. ``--set KEY=VALUE`` takes a JSON value (a bare word is a string); ``--json``
takes the changes as one object. Exit status: 0 done, 1 the server refused or could not be
reached (one line on stderr with the status), 2 a bad command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from controlplane import api
from controlplane.policy import Policy
from controlplane.policy_store import load_token_file

EXIT_REFUSED = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    for name, help_text in (
        ("get", "print the live policy"),
        ("update", "change fields of the live policy (a new version)"),
        ("watch", "print the live policy, then every new version"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--target", required=True, help="HOST:PORT (or grpc://HOST:PORT) of the policy service")
        p.add_argument("--token-file", type=Path, default=None, help="file holding the bearer token (updates)")
        p.add_argument("--tls-ca", type=Path, default=None, help="CA that signed the server certificate (TLS)")
        p.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mutual TLS)")
        p.add_argument("--tls-key", type=Path, default=None, help="client private key (mutual TLS)")
        p.add_argument("--server-name", default=None, help="name to check the server certificate against")
        p.add_argument("--timeout-s", type=float, default=10.0, help="deadline of get / update, seconds")
        if name == "update":
            p.add_argument("--set", dest="changes", action="append", default=[], metavar="KEY=VALUE",
                           help="a field to change (dotted for lvf.* / layerkv.*); repeatable")
            p.add_argument("--json", dest="changes_json", default=None, help="the changes as one JSON object")
        if name == "watch":
            p.add_argument("--count", type=int, default=0, help="stop after this many policies (0: until interrupted)")


def parse_changes(pairs: list[str], as_json: str | None) -> dict[str, Any]:
    """The update ``--set`` / ``--json`` name; ValueError naming the bad argument."""
    changes: dict[str, Any] = {}
    if as_json is not None:
        try:
            loaded = json.loads(as_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json: not valid JSON ({exc})") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--json: expected an object, got {type(loaded).__name__}")
        changes.update(loaded)
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE (e.g. slo_tbt_ms=150)")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare word: scheduler=lvf
        group, dot, field = key.partition(".")
        if dot:
            nested = changes.setdefault(group, {})
            if not isinstance(nested, dict):
                raise ValueError(f"--set {pair!r}: {group!r} is set as a value and as an object")
            nested[field] = value
        else:
            changes[key] = value
    if not changes:
        raise ValueError("update: nothing to change (give --set KEY=VALUE or --json)")
    return changes


def _client(args: argparse.Namespace) -> Any:
    from controlplane.service.client import ClientTLS, GrpcControlPlane

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key must be given together")
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = ClientTLS(
            root_certificates=args.tls_ca.read_bytes() if args.tls_ca else None,
            private_key=args.tls_key.read_bytes() if args.tls_key else None,
            cert_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
            server_name=args.server_name,
        )
    token = None
    if args.token_file is not None:
        try:
            token = load_token_file(args.token_file)
        except api.InvalidArgument as exc:
            raise ValueError(f"--token-file: {exc}") from None
    return GrpcControlPlane(args.target, token=token, tls=tls, timeout_s=args.timeout_s)


def _print(policy: Policy) -> None:
    print(json.dumps(policy.to_dict(), sort_keys=True), flush=True)


def _watch(client: Any, count: int) -> Iterator[Policy]:
    watch = client.watch_policy()
    try:
        for n, policy in enumerate(watch, start=1):
            yield policy
            if count and n >= count:
                return
    finally:
        watch.close()


def run(args: argparse.Namespace) -> int:
    try:
        changes = parse_changes(args.changes, args.changes_json) if args.action == "update" else None
        if args.action == "watch" and args.count < 0:
            raise ValueError(f"--count={args.count} is out of range (allowed >= 0; 0: until interrupted)")
        client = _client(args)
    except (OSError, ValueError) as exc:
        print(f"kvplane policy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.action == "get":
            _print(client.get_policy())
        elif args.action == "update":
            _print(client.update_policy(changes))
        else:
            for policy in _watch(client, args.count):
                _print(policy)
    except api.ControlPlaneError as exc:
        status = {api.Unauthenticated: "UNAUTHENTICATED", api.InvalidArgument: "INVALID_ARGUMENT",
                  api.Unavailable: "UNAVAILABLE"}.get(type(exc), type(exc).__name__)
        print(f"kvplane policy: {status}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()
    return 0
