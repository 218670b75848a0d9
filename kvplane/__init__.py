"""kvplane: the `kvplane` command and the generated gRPC API (`kvplane.v1`)."""

__version__ = "0.1.0"
