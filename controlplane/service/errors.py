"""The one mapping between domain errors and gRPC status codes (both directions).

Server side, :func:`status_for` picks the code for an exception raised by a servicer or by the
control plane; the client maps a status back with :func:`error_for` so that
:class:`~controlplane.service.client.GrpcControlPlane` raises the same domain errors as the
embedded control plane.
"""

from __future__ import annotations

import grpc

from controlplane import api
from controlplane.model import SchemaError

# Order matters: the first matching class wins.
_TO_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (api.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (SchemaError, grpc.StatusCode.INVALID_ARGUMENT),
    (api.NotFound, grpc.StatusCode.NOT_FOUND),
    (api.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (api.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (api.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (api.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
)

_FROM_STATUS: dict[grpc.StatusCode, type[api.ControlPlaneError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: api.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: api.NotFound,
    grpc.StatusCode.UNAUTHENTICATED: api.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: api.PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: api.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: api.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: api.Unavailable,
}


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The status code for a domain error, or None when ``exc`` is not one (an internal bug)."""
    for cls, code in _TO_STATUS:
        if isinstance(exc, cls):
            return code
    return None


def error_for(err: grpc.RpcError) -> api.ControlPlaneError:
    """The domain error for a failed call (unknown codes become Unavailable with the code)."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _FROM_STATUS.get(code, api.Unavailable) if code is not None else api.Unavailable
    if cls is api.Unavailable and code not in (grpc.StatusCode.UNAVAILABLE, None):
        return api.Unavailable(f"{code.name}: {details}")
    return cls(details or (code.name if code is not None else "unknown error"))
