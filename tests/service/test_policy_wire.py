"""The wire format carries every tunable policy field (no drift between policy.py and the proto)."""

import dataclasses

from controlplane.policy import LayerKVParams, LVFParams, Policy
from controlplane.service.policy_convert import policy_from_proto, policy_to_proto
from kvplane.v1 import controlplane_pb2 as pb


def _non_default_policy() -> Policy:
    """A policy whose every field differs from its default."""
    layerkv = LayerKVParams(
        ttft_slo_ms=1234.0,
        tpot_margin=0.5,
        max_prefill_tokens=777,
        output_len_lower_bound=3,
        prefill_correction=1.5,
        offload_correction=0.75,
        model_params=7e9,
        hidden_size=2048,
        device_tflops=123.0,
    )
    lvf = LVFParams(alpha=2.0, beta_b=0.25, beta_f=0.75, transfer_budget_blocks=99)
    return Policy(
        version=7,
        slo_tbt_ms=55.0,
        slo_ttft_ms=999.0,
        alpha=0.5,
        window_min=2,
        window_max=9,
        mismatch_threshold=0.3,
        ewma_factor=0.6,
        victim_rule="longest",
        max_paused_steps=321,
        solve_budget_fraction=0.5,
        scheduler="lvf",
        max_recompute_ratio=0.25,
        deposit_credit=True,
        layerkv=layerkv,
        lvf=lvf,
    )


def test_every_policy_field_has_a_proto_field():
    """Each Policy, LayerKVParams and LVFParams field exists in the proto message."""
    for cls, msg in ((Policy, pb.Policy), (LayerKVParams, pb.LayerKVParams), (LVFParams, pb.LVFParams)):
        wire = set(msg.DESCRIPTOR.fields_by_name)
        missing = {f.name for f in dataclasses.fields(cls)} - wire
        assert not missing, f"{cls.__name__} fields missing from {msg.DESCRIPTOR.name}: {missing}"


def test_policy_round_trips_through_the_wire():
    """A policy with every field changed survives policy_to_proto -> bytes -> policy_from_proto."""
    policy = _non_default_policy()
    for f in dataclasses.fields(Policy):
        if f.name not in ("layerkv", "lvf"):
            assert getattr(policy, f.name) != getattr(Policy(), f.name), f.name
    data = policy_to_proto(policy).SerializeToString()
    assert policy_from_proto(pb.Policy.FromString(data)) == policy
