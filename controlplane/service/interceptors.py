"""Server interceptors: error mapping, bearer-token auth for policy writes, per-client rate limit.

Installed in this order (outermost first): :class:`ErrorMappingInterceptor`,
:class:`RateLimitInterceptor`, :class:`AuthInterceptor`. Auth and rate limit raise domain errors
(``api.Unauthenticated``, ``api.ResourceExhausted``); the error mapper is the only place that turns
any exception into a status, so every RPC ends with OK or a proper code, never a crashed server.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog

from controlplane import api
from controlplane.service.errors import status_for
from controlplane.service.metrics import ServiceMetrics

MAX_DETAILS_BYTES = 1024
"""Longest status details sent (and logged), in UTF-8 bytes: gRPC refuses trailing metadata past
its limit (8 KiB by default, randomly from the soft limit below it), and the client then sees
RESOURCE_EXHAUSTED instead of the error (control-plane review, session 80). It counts the details
percent-encoded: a byte outside ASCII is three, so 1,024 bytes stay within 3 KiB."""

log = structlog.get_logger(__name__)

Behavior = Callable[..., Any]
Around = Callable[[Behavior, bool, str], Behavior]
"""Wraps a behavior: (behavior, response_streaming, method) -> behavior."""

EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")  # HEALTH_PREFIX, REFLECTION_PREFIX
"""Infrastructure services never rate limited (probes must always get through)."""


class MalformedRequest:
    """Stands in for a request whose bytes did not parse (turned into INVALID_ARGUMENT)."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error

    def invalid(self) -> api.InvalidArgument:
        return api.InvalidArgument(
            f"request: not a valid {self.message_type} message ({type(self.error).__name__})"
        )


def _safe_deserializer(deserializer: Callable[[bytes], Any] | None, method: str) -> Any:
    """Deserializer that returns :class:`MalformedRequest` instead of raising.

    gRPC would answer a raising deserializer with INTERNAL; we want INVALID_ARGUMENT.
    """
    if deserializer is None:
        return None
    name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    message_type = name.full_name if name is not None else method

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return MalformedRequest(message_type, exc)

    return deserialize


def _wrap_handler(
    handler: grpc.RpcMethodHandler | None, method: str, around: Around, *, safe: bool = False
) -> Any:
    if handler is None:
        return None
    deserializer = handler.request_deserializer
    if safe:
        deserializer = _safe_deserializer(deserializer, method)
    kwargs = {
        "request_deserializer": deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            around(handler.unary_unary, False, method), **kwargs
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            around(handler.unary_stream, True, method), **kwargs
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            around(handler.stream_unary, False, method), **kwargs
        )
    return grpc.stream_stream_rpc_method_handler(
        around(handler.stream_stream, True, method), **kwargs
    )


def _checked(request: Any) -> Any:
    """``request`` itself, or for a request stream an iterator raising on malformed items."""
    if isinstance(request, MalformedRequest):
        raise request.invalid()
    if hasattr(request, "__next__") and not hasattr(request, "DESCRIPTOR"):

        def items() -> Iterator[Any]:
            for item in request:
                if isinstance(item, MalformedRequest):
                    raise item.invalid()
                yield item

        return items()
    return request


CERTIFICATE_IDENTITIES = ("cn=", "san=", "cert-sha256=")
"""Prefixes of :func:`peer_identity` for a client certificate (anything else is a peer address)."""


def peer_identity(context: grpc.ServicerContext) -> str:
    """Who is calling: under mTLS the client certificate's CN, else (certificates without one: SPIFFE,
    cert-manager) its subject alternative names, else a digest of the certificate; without a
    client certificate the peer address. gRPC reports a certificate without a CN as
    ``x509_common_name = [b'']``, which once made every such peer ``"cn="``: one identity, so two
    workers' certificates could take each other's worker id (control-plane review, session 54)."""
    try:
        auth = context.auth_context()
    except Exception:  # pragma: no cover - auth_context is always there on real contexts
        auth = {}
    if auth:
        cn = [v for v in auth.get("x509_common_name", ()) if v]
        if cn:
            return "cn=" + cn[0].decode("utf-8", "replace")
        san = sorted(v.decode("utf-8", "replace") for v in auth.get("x509_subject_alternative_name", ()) if v)
        if san:
            return "san=" + ",".join(san)
        pem = [v for v in auth.get("x509_pem_cert", ()) if v]
        if pem:
            return "cert-sha256=" + hashlib.sha256(pem[0]).hexdigest()
    return str(context.peer())


HEALTH_PREFIX = "/grpc.health.v1."
REFLECTION_PREFIX = "/grpc.reflection."


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Maps domain errors to status codes; anything else becomes INTERNAL (and is logged).

    Health is left unwrapped: it raises no domain error, and wrapping ``Watch`` dropped its
    ``experimental_non_blocking``, so each watch held a server thread and an RPC slot while open
    (a mesh's health watches took every slot: sessions, ``Check`` and ``GetPolicy`` refused,
    control-plane review of session 65). Reflection streams hold a thread each while open: at
    most ``reflection_streams`` at once, more get RESOURCE_EXHAUSTED naming the limit."""

    def __init__(self, metrics: ServiceMetrics | None = None, reflection_streams: int = 2) -> None:
        self._metrics = metrics
        self.reflection_streams = reflection_streams
        self._reflection = threading.BoundedSemaphore(reflection_streams)

    def _reflection_limited(self, behavior: Behavior, streaming: bool, method: str) -> Behavior:
        def stream_behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not self._reflection.acquire(blocking=False):
                if self._metrics is not None:
                    self._metrics.rejected.labels(limit="reflection_streams").inc()
                raise api.ResourceExhausted(
                    f"reflection: {self.reflection_streams} reflection streams already open "
                    f"(limit {self.reflection_streams}; each holds a server thread)")
            try:
                yield from behavior(request, context)
            finally:
                self._reflection.release()

        return stream_behavior if streaming else behavior

    def _abort(self, context: grpc.ServicerContext, method: str, exc: Exception) -> None:
        code = status_for(exc)
        if code is None:
            already = context.code() if hasattr(context, "code") else None
            if already not in (None, grpc.StatusCode.OK):
                raise exc  # the servicer aborted with its own status: keep it
            log.error("rpc_internal_error", method=method, error=repr(exc), exc_info=exc)
            code, details = grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})"
        else:
            details = str(exc) or code.name
            raw = details.encode("utf-8", errors="replace")
            if len(raw) > MAX_DETAILS_BYTES:  # the messages cut the values they echo (shown)
                cut = raw[:MAX_DETAILS_BYTES].decode("utf-8", errors="ignore")
                details = f"{cut}... ({len(details)} characters)"
            log.info("rpc_error", method=method, code=code.name, details=details)
        if self._metrics is not None:
            self._metrics.rpc_errors.labels(method=method, code=code.name).inc()
        context.abort(code, details)

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        method = handler_call_details.method

        def around(behavior: Behavior, streaming: bool, method: str) -> Behavior:
            if streaming:

                def stream_behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                    try:
                        yield from behavior(_checked(request), context)
                    except grpc.RpcError:
                        return  # the client cancelled or vanished: nobody to answer
                    except Exception as exc:
                        self._abort(context, method, exc)

                return stream_behavior

            def unary_behavior(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return behavior(_checked(request), context)
                except grpc.RpcError:
                    return None  # the client cancelled or vanished: nobody to answer
                except Exception as exc:
                    self._abort(context, method, exc)

            return unary_behavior

        if method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if method.startswith(REFLECTION_PREFIX):
            handler = _wrap_handler(handler, method, self._reflection_limited)
        return _wrap_handler(handler, method, around, safe=True)


def _guard(check: Callable[[grpc.ServicerContext, str], None]) -> Around:
    """An ``around`` that runs ``check(context, method)`` before the behavior."""

    def around(behavior: Behavior, streaming: bool, method: str) -> Behavior:
        if streaming:

            def stream_behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                check(context, method)
                yield from behavior(request, context)

            return stream_behavior

        def unary_behavior(request: Any, context: grpc.ServicerContext) -> Any:
            check(context, method)
            return behavior(request, context)

        return unary_behavior

    return around


class AuthInterceptor(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on write methods when a token is configured.

    Reads stay open. The token is compared with :func:`hmac.compare_digest` (constant time).
    """

    def __init__(self, token: str | None, write_methods: frozenset[str]) -> None:
        self._token = token.encode() if token else None
        self._write_methods = write_methods

    def check(self, context: grpc.ServicerContext, method: str) -> None:
        if self._token is None:
            return
        presented = bearer_token(context)
        if presented is None:
            raise api.Unauthenticated(
                f"{method} needs metadata 'authorization: Bearer <token>' (none given)"
            )
        if not hmac.compare_digest(presented.encode(), self._token):
            raise api.Unauthenticated(f"{method}: the bearer token is not valid")

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if self._token is None or handler_call_details.method not in self._write_methods:
            return handler
        return _wrap_handler(handler, handler_call_details.method, _guard(self.check))


def bearer_token(context: grpc.ServicerContext) -> str | None:
    """The token of an ``authorization: Bearer ...`` metadata entry, or None."""
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` banked; thread-safe."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


def _client_key(peer: str) -> str:
    """The client host of a peer string (``ipv4:127.0.0.1:5555`` -> ``ipv4:127.0.0.1``)."""
    head, sep, _port = peer.rpartition(":")
    return head if sep and head else peer


class RateLimitInterceptor(grpc.ServerInterceptor):
    """Limits RPC calls (unary calls and stream opens) per client host to ``rps`` per second.

    Messages inside an open Session stream are not counted (gRPC flow control paces them, and one
    worker's stream runs on its own thread). Health and reflection are exempt.
    """

    MAX_CLIENTS = 10_000

    def __init__(self, rps: float, metrics: ServiceMetrics | None = None) -> None:
        self._rps = rps
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()
        self._metrics = metrics

    def check(self, context: grpc.ServicerContext, method: str) -> None:
        key = _client_key(str(context.peer()))
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                if len(self._buckets) >= self.MAX_CLIENTS:
                    self._buckets.clear()  # bounded memory; worst case a brief extra burst
                bucket = self._buckets[key] = TokenBucket(self._rps, max(1.0, self._rps))
        if not bucket.take():
            if self._metrics is not None:
                self._metrics.rejected.labels(limit="rate_limit_rps").inc()
            raise api.ResourceExhausted(
                f"rate_limit_rps: client {key} exceeded {self._rps:g} requests/s; retry later"
            )

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if self._rps <= 0 or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        return _wrap_handler(handler, handler_call_details.method, _guard(self.check))
