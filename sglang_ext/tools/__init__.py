"""`kvplane` subcommands of the data plane: `bench transfer`, `bench attention`, `profile`.

Each module exposes ``add_arguments(parser)`` and ``run(args) -> int`` (see kvplane/cli.py).
"""
