"""Triton kernels (with torch reference implementations) for the layered KV data plane."""
