"""``PolicyEndpointConfig``: the ``--kv-policy-listen`` flag family, checked at launch.

``--kv-policy-listen HOST:PORT`` makes TP rank 0's scheduler serve the embedded control plane's
``kvplane.v1.PolicyService`` (the one ``kvplane serve`` hosts; :class:`~sglang_ext.policy_endpoint.
PolicyEndpoint`). Rules, each refused at launch with one line naming the flag and the value:

* HOST:PORT with PORT an integer in [0, 65535] (0: any free port, logged by the scheduler);
* updates need a bearer token: ``--kv-policy-listen-token-file FILE`` (non-empty), unless
  ``--kv-policy-listen-allow-unauthenticated`` says otherwise explicitly;
* TLS: ``--kv-policy-listen-tls-cert`` and ``--kv-policy-listen-tls-key`` together (the port then
  speaks TLS), ``--kv-policy-listen-tls-ca`` on top requires client certificates (mutual TLS); the
  PEM files are parsed now (:mod:`controlplane.service.pem_files`);
* only with the embedded control plane (a ``grpc://`` one serves its own policy) and
  ``--dp-size 1`` (one embedded control plane per data-parallel rank);
* the port is free now (:meth:`PolicyEndpointConfig.check_bindable`; should it be taken later,
  the scheduler logs one line and serves on without the endpoint).

The ``--kv-policy-listen-*`` options without ``--kv-policy-listen`` are refused too. Pure Python
(no torch, no SGLang, no grpc at import: the launcher imports it).
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from controlplane.service.server import ServerConfig
    from sglang_ext.args import LayeredKVArgs

MAX_PORT = 65535
_LISTEN = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-_]+):(?P<port>-?[0-9]+)$")
_FLAGS = MappingProxyType({
    "kv_policy_listen_token_file": "--kv-policy-listen-token-file",
    "kv_policy_listen_allow_unauthenticated": "--kv-policy-listen-allow-unauthenticated",
    "kv_policy_listen_tls_cert": "--kv-policy-listen-tls-cert",
    "kv_policy_listen_tls_key": "--kv-policy-listen-tls-key",
    "kv_policy_listen_tls_ca": "--kv-policy-listen-tls-ca",
})
"""LayeredKVArgs field -> flag, for the options that need ``--kv-policy-listen``."""


@dataclass(frozen=True)
class PolicyEndpointConfig:
    """A validated ``--kv-policy-listen`` configuration."""

    listen: str
    """``HOST:PORT`` (IPv6 hosts in brackets)."""
    token_file: str | None = None
    """File holding the bearer token policy updates must carry."""
    allow_unauthenticated: bool = False
    """Serve updates without a token (must be explicit)."""
    tls_cert: str | None = None
    """Server certificate chain (PEM)."""
    tls_key: str | None = None
    """Server private key (PEM)."""
    tls_ca: str | None = None
    """CA of client certificates (mutual TLS)."""

    def __post_init__(self) -> None:
        match = _LISTEN.match(self.listen) if isinstance(self.listen, str) else None
        if match is None:
            raise ValueError(
                f"--kv-policy-listen={self.listen!r}: expected HOST:PORT (e.g. 127.0.0.1:50061, [::1]:50061)"
            )
        port = int(match.group("port"))
        if not 0 <= port <= MAX_PORT:
            raise ValueError(f"--kv-policy-listen={self.listen!r}: port {port} is out of range [0, {MAX_PORT}]")
        if self.token_file is None and not self.allow_unauthenticated:
            raise ValueError(
                f"--kv-policy-listen={self.listen!r} serves policy updates: give "
                "--kv-policy-listen-token-file FILE (the bearer token updates must carry), or "
                "--kv-policy-listen-allow-unauthenticated to serve them to anyone who can connect"
            )
        if self.token_file is not None and self.allow_unauthenticated:
            raise ValueError(
                "--kv-policy-listen-token-file and --kv-policy-listen-allow-unauthenticated "
                "contradict each other; give one"
            )
        if self.token_file is not None:
            _ = self.token  # read and checked now, not at the first update
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--kv-policy-listen-tls-cert and --kv-policy-listen-tls-key must be given together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError(
                "--kv-policy-listen-tls-ca (mutual TLS) needs --kv-policy-listen-tls-cert and "
                "--kv-policy-listen-tls-key (the server's own certificate)"
            )
        if self.tls_cert is not None and self.tls_key is not None:
            from controlplane.service.pem_files import (
                check_ca_dates,
                check_key_pair,
            )

            check_key_pair("--kv-policy-listen-tls-cert", self.tls_cert, "--kv-policy-listen-tls-key", self.tls_key)
            if self.tls_ca is not None:
                check_ca_dates("--kv-policy-listen-tls-ca", self.tls_ca)

    @property
    def host(self) -> str:
        """The host part, brackets stripped."""
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @property
    def token(self) -> str | None:
        """The bearer token (read from ``token_file``), None when updates are open."""
        if self.token_file is None:
            return None
        from controlplane.api import InvalidArgument
        from controlplane.policy_store import load_token_file

        try:
            return load_token_file(self.token_file)
        except InvalidArgument as exc:
            raise ValueError(f"--kv-policy-listen-token-file: {exc}") from None

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def server_config(self) -> ServerConfig:
        """The gRPC server's limits and security (a policy-only server: few threads)."""
        from controlplane.service.server import ServerConfig, TLSConfig

        tls = None
        if self.tls_cert is not None and self.tls_key is not None:
            tls = TLSConfig.from_files(self.tls_cert, self.tls_key, self.tls_ca)
        return ServerConfig(max_sessions=1, max_watchers=8, unary_workers=2, policy_token=self.token, tls=tls)

    def check_bindable(self) -> None:
        """ValueError naming the flag when HOST:PORT cannot be bound now (port 0 always can)."""
        if self.port == 0:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                sock.bind((self.host, self.port))
        except OSError as exc:
            raise ValueError(
                f"--kv-policy-listen={self.listen!r}: cannot bind ({exc.strerror or exc}); "
                "choose a free port (or 0 for any)"
            ) from None

    @classmethod
    def from_args(cls, args: LayeredKVArgs) -> PolicyEndpointConfig | None:
        """The configuration ``args`` ask for; None without ``--kv-policy-listen``. ValueError
        naming the flag for anything the endpoint cannot serve with."""
        if args.kv_policy_listen is None:
            given = [flag for field, flag in _FLAGS.items() if getattr(args, field, None) not in (None, False)]
            if given:
                raise ValueError(f"{', '.join(given)} only apply with --kv-policy-listen HOST:PORT")
            return None
        if args.kv_control_plane != "embedded":
            raise ValueError(
                f"--kv-policy-listen serves the embedded control plane's policy; with "
                f"--kv-control-plane={args.kv_control_plane} the remote service serves it (kvplane serve)"
            )
        for field in ("kv_policy_listen_token_file", "kv_policy_listen_tls_cert", "kv_policy_listen_tls_key",
                      "kv_policy_listen_tls_ca"):
            value = getattr(args, field)
            if value is not None and not Path(value).is_file():
                raise ValueError(f"{_FLAGS[field]}={value!r}: no such file")
        return cls(
            listen=args.kv_policy_listen,
            token_file=args.kv_policy_listen_token_file,
            allow_unauthenticated=bool(args.kv_policy_listen_allow_unauthenticated),
            tls_cert=args.kv_policy_listen_tls_cert,
            tls_key=args.kv_policy_listen_tls_key,
            tls_ca=args.kv_policy_listen_tls_ca,
        )

    @classmethod
    def check_launch(cls, args: LayeredKVArgs, namespace: Any) -> PolicyEndpointConfig | None:
        """The launcher's check (``--enable-layered-kv`` on): the configuration, ``--dp-size 1``,
        the port free now. ValueError naming the flag otherwise."""
        config = cls.from_args(args)
        if config is None:
            return None
        dp_size = int(getattr(namespace, "dp_size", 1) or 1)
        if dp_size > 1:
            raise ValueError(
                f"--kv-policy-listen with --dp-size {dp_size}: each data-parallel rank runs its own "
                "embedded control plane, one port cannot serve them all (use --dp-size 1, or a "
                "shared control plane: kvplane serve + --kv-control-plane grpc://HOST:PORT)"
            )
        config.check_bindable()
        return config
