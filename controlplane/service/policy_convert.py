"""Protobuf <-> domain translation of the policy messages (kvplane.v1 ``Policy``), with the same
validation and error paths as :mod:`controlplane.service.convert` (the rest of the API)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from controlplane.model import SchemaError, shown
from controlplane.policy import LayerKVParams, LVFParams, Policy
from controlplane.service.convert import _invalid, _schema
from kvplane.v1 import controlplane_pb2 as pb

# ---------------------------------------------------------------- policy

_POLICY_SCALARS = (
    "slo_tbt_ms",
    "slo_ttft_ms",
    "alpha",
    "window_min",
    "window_max",
    "mismatch_threshold",
    "ewma_factor",
    "victim_rule",
    "max_paused_steps",
    "solve_budget_fraction",
    "scheduler",
    "max_recompute_ratio",
    "deposit_credit",
)
# Derived from the dataclasses so that the wire format cannot silently drift from the policy
# (tests/service/test_convert.py checks every field round-trips).
_NESTED: dict[str, tuple[str, ...]] = {
    "layerkv": tuple(f.name for f in dataclasses.fields(LayerKVParams)),
    "lvf": tuple(f.name for f in dataclasses.fields(LVFParams)),
}


def policy_to_proto(policy: Policy) -> pb.Policy:
    msg = pb.Policy(version=policy.version)
    for name in _POLICY_SCALARS:
        setattr(msg, name, getattr(policy, name))
    for group, names in _NESTED.items():
        params: LayerKVParams | LVFParams = getattr(policy, group)
        sub = getattr(msg, group)
        for name in names:
            setattr(sub, name, getattr(params, name))
    return msg


def policy_changes_from_proto(msg: pb.Policy) -> dict[str, Any]:
    """The partial update a :class:`pb.Policy` names: only fields that are set; version ignored."""
    changes: dict[str, Any] = {}
    for name in _POLICY_SCALARS:
        if msg.HasField(name):
            changes[name] = getattr(msg, name)
    for group, names in _NESTED.items():
        if msg.HasField(group):
            sub = getattr(msg, group)
            nested = {n: getattr(sub, n) for n in names if sub.HasField(n)}
            if nested:
                changes[group] = nested
    return changes


def policy_changes_to_proto(changes: Mapping[str, Any]) -> pb.Policy:
    """The wire form of a partial update; raises InvalidArgument for unknown fields."""
    if not isinstance(changes, Mapping):  # as the embedded plane's store refuses it
        raise _invalid("policy", f"expected an object, got {type(changes).__name__}")
    msg = pb.Policy()
    for key, value in changes.items():
        if key in _NESTED:
            if not isinstance(value, Mapping):
                raise _invalid(key, f"expected an object, got {type(value).__name__}")
            sub = getattr(msg, key)
            for sub_key, sub_value in value.items():
                if sub_key not in _NESTED[key]:
                    raise _invalid(f"{key}.{shown(sub_key, bare=True)}", "unknown field")
                _set_field(sub, sub_key, sub_value, f"{key}.{sub_key}")
            sub.SetInParent()
        elif key in _POLICY_SCALARS:
            _set_field(msg, key, value, key)
        elif key == "version":
            continue
        else:
            allowed = sorted((*_POLICY_SCALARS, *_NESTED))
            raise _invalid(shown(key, bare=True), f"unknown policy field (allowed: {allowed})")
    return msg


def _set_field(msg: Any, name: str, value: Any, path: str) -> None:
    """``msg.name = value``, refused as the embedded control plane refuses it: protobuf itself
    would take ``True`` as 1 in a number field and any number as a bool."""
    kind = msg.DESCRIPTOR.fields_by_name[name].type
    if kind == FieldDescriptor.TYPE_BOOL and not isinstance(value, bool):
        raise _invalid(path, f"expected true or false, got {shown(value)}")
    if kind != FieldDescriptor.TYPE_BOOL and isinstance(value, bool):
        text = kind in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_ENUM)
        raise _invalid(path, f"expected {'a string' if text else 'a number'}, got {shown(value)}")
    try:
        setattr(msg, name, value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise _invalid(path, f"bad value {shown(value)} ({shown(str(exc), bare=True)})") from exc


def policy_from_proto(msg: pb.Policy) -> Policy:
    """A full policy from its wire form (missing fields take defaults)."""
    d = policy_changes_from_proto(msg)
    if msg.HasField("version"):
        d["version"] = msg.version
    try:
        return Policy.from_dict(d)
    except SchemaError as exc:
        raise _schema(exc) from exc
