"""`kvplane bench` benchmarks of the control plane (`planner`, `service`); see kvplane/cli.py."""
