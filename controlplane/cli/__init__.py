"""`kvplane` subcommands of the control plane (`plan`, `serve`); see kvplane/cli.py."""
