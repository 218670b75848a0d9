"""Dockerfile and .dockerignore, checked statically (no Docker daemon on the test machines):
multi-stage, slim pinned Python 3.11 base, control plane only, no compilers or pip in the final
stage, non-root uid 10001, `kvplane serve` entrypoint, and consistency with the Helm chart."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

import yaml

from tests.helm.conftest import CHART, REPO

COMPILERS = ("build-essential", "gcc", "g++", "clang", "make", "cmake", "gfortran", "cc ")


@dataclass
class Stage:
    """One build stage: its FROM line and instructions (continuations joined)."""

    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def of(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _parse() -> tuple[dict[str, str], list[Stage]]:
    text = (REPO / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(image=image, name=name))
        elif keyword == "ARG" and not stages:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
        else:
            stages[-1].instructions.append((keyword, rest.strip()))
    return args, stages


ARGS, STAGES = _parse()
BUILDER, FINAL = STAGES[0], STAGES[-1]


def test_multi_stage_on_pinned_slim_python_311():
    """Two stages on the same pinned python:3.11.x-slim image (never latest)."""
    assert len(STAGES) == 2 and BUILDER.name == "builder"
    for stage in STAGES:
        assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", stage.image), stage.image
        assert "latest" not in stage.image


def test_builder_installs_only_the_control_plane_with_constraints():
    """The builder pip-installs `.` (no extras, so no SGLang/torch) with the pinned constraints."""
    runs = " ".join(BUILDER.of("RUN"))
    install = re.search(r"pip install ([^&]*)", runs)
    assert install is not None
    words = install.group(1).split()
    assert "-c" in words and words[words.index("-c") + 1] == "requirements/constraints.txt"
    assert "." in words and not any("[" in w for w in words), words
    assert "--only-binary=:all:" in words
    copied = " ".join(BUILDER.of("COPY"))
    for excluded in ("sglang_ext", "kernels", "simulator", "tests"):
        assert excluded not in copied
    for needed in (
        "pyproject.toml",
        "README.md",
        "requirements/constraints.txt",
        "kvplane/",
        "controlplane/",
    ):
        assert needed in copied


def test_final_stage_has_no_compilers_or_installers():
    """The final stage installs nothing: no apt-get, no pip, no compilers; it copies the venv."""
    final_runs = " ".join(FINAL.of("RUN"))
    assert "apt-get" not in final_runs and "pip" not in final_runs
    for tool in COMPILERS:
        assert tool not in final_runs
    copies = FINAL.of("COPY")
    assert copies == ["--from=builder /opt/kvplane /opt/kvplane"]
    assert "pip uninstall --yes pip setuptools" in " ".join(BUILDER.of("RUN"))


def test_runs_as_non_root_uid_10001():
    """The final USER is the numeric non-root uid 10001, created without a home or shell."""
    assert FINAL.of("USER") == ["10001:10001"]
    runs = " ".join(FINAL.of("RUN"))
    assert "--uid 10001" in runs and "/usr/sbin/nologin" in runs


def test_entrypoint_and_ports():
    """ENTRYPOINT is exec-form `kvplane serve`; gRPC 50051 and metrics 9090 are exposed."""
    assert [json.loads(e) for e in FINAL.of("ENTRYPOINT")] == [["kvplane", "serve"]]
    assert sorted(FINAL.of("EXPOSE")[0].split()) == ["50051", "9090"]
    cmd = json.loads(FINAL.of("CMD")[0])
    assert cmd[:2] == ["--listen", "0.0.0.0:50051"] and "--metrics-port" in cmd
    assert FINAL.of("STOPSIGNAL") == ["SIGTERM"]


def test_dockerignore_allows_only_what_is_copied():
    """The build context is an allowlist that covers every COPY source and nothing else."""
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert lines[0] == "*"
    allowed = {ln[1:] for ln in lines if ln.startswith("!")}
    sources = set()
    for copy in BUILDER.of("COPY"):
        parts = shlex.split(copy)
        sources.update(p for p in parts[:-1] if not p.startswith("--"))
    assert sources == allowed
    for path in allowed:
        assert (REPO / path).exists(), path


def test_image_matches_the_chart():
    """The chart's uid, ports and entrypoint assumptions match the image."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["securityContext"]["runAsUser"] == 10001
    assert values["podSecurityContext"]["runAsUser"] == 10001
    assert {values["service"]["grpcPort"], values["service"]["metricsPort"]} == {50051, 9090}
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    label = " ".join(FINAL.of("LABEL"))
    assert f'org.opencontainers.image.version="{chart["appVersion"]}"' in label
