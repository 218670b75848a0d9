"""kvplane's SGLang plugin and data plane (layered KV pool, block tables, transfers).

Data plane only: takes placements, never decides them. Imports torch; never imports the
control plane's planner (only its plain data types through the client interface).
"""
