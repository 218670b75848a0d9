"""kvplane control plane: placement model, planner, adaptive controller and gRPC service.

Pure Python: never imports torch, SGLang or CUDA. See README.md for the layering rule.
"""
