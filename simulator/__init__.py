"""Discrete-event simulator of a continuous-batching server with layered KV offloading.

Drives the control plane's own planner and controller: no second implementation of a policy.
"""
