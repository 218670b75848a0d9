"""Generate the gRPC API code from ``proto/`` (``python -m controlplane.protogen``, ``make proto``).

Writes ``kvplane/v1/*_pb2.py``, ``*_pb2_grpc.py`` and ``*_pb2.pyi`` with grpcio-tools. The
generated files are committed and never edited by hand; ``tests/service/test_protogen.py``
regenerates into a temporary directory and fails when the committed copies are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = Path("kvplane") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The ``.proto`` sources of the versioned API, relative to ``proto_root``, sorted."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc (grpcio-tools) into ``out_root``; return the generated files, sorted.

    Raises RuntimeError naming the failing file when protoc reports an error.
    """
    import importlib.resources

    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    sources = proto_files(proto_root)
    if not sources:
        raise RuntimeError(f"no .proto files under {proto_root / PACKAGE_DIR}")
    for source in sources:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{proto_root}",
                f"-I{include}",
                f"--python_out={out_root}",
                f"--pyi_out={out_root}",
                f"--grpc_python_out={out_root}",
                str(source),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {source} (exit code {rc})")
    return sorted(
        p.relative_to(out_root)
        for p in (out_root / PACKAGE_DIR).iterdir()
        if p.name.endswith(GENERATED_SUFFIXES)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
