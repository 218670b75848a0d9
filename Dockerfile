# syntax=docker/dockerfile:1
# kvplane control plane image: `kvplane serve` (gRPC on 50051, Prometheus metrics on 9090).
#
#   docker build -t ghcr.io/kvplane/kvplane-controlplane:0.1.0 .
#   docker run --rm -p 50051:50051 -p 9090:9090 ghcr.io/kvplane/kvplane-controlplane:0.1.0 \
#       --listen 0.0.0.0:50051 --metrics-port 9090
#
# Only the control plane is installed (no torch, no SGLang, no [sglang] extra); every dependency
# comes from PyPI as a binary wheel pinned by requirements/constraints.txt. The final stage has no
# compilers, no pip cache and runs as uid 10001 (matches the Helm chart's securityContext).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---------------------------------------------------------------- builder
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvplane
WORKDIR /src
# Packaging metadata and pins first, so dependency layers cache across source edits.
COPY pyproject.toml README.md ./
COPY requirements/constraints.txt requirements/constraints.txt
# The control-plane packages only (kvplane = CLI + generated gRPC code in kvplane/v1).
COPY kvplane/ kvplane/
COPY controlplane/ controlplane/
COPY proto/ proto/
# Binary wheels only: the builder needs no compilers either. Then drop what the server never
# loads: cbcbox's debug CBC builds and headers (~370 MB; chosen only with CBCBOX_BUILD=debug),
# pip and setuptools. Finally a smoke test: the CLI parses and CBC solves a tiny MIP.
RUN /opt/kvplane/bin/pip install --only-binary=:all: -c requirements/constraints.txt . \
    && SITE="$(/opt/kvplane/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -rf "$SITE"/cbcbox/cbc_dist_debug* "$SITE"/cbcbox/cbc_dist*/include \
    && /opt/kvplane/bin/python -m pip uninstall --yes pip setuptools \
    && /opt/kvplane/bin/kvplane serve --help > /dev/null \
    && /opt/kvplane/bin/python -c "import mip; m = mip.Model(solver_name='CBC'); m.verbose = 0; \
x = m.add_var(var_type=mip.BINARY); m.objective = mip.maximize(x); \
assert m.optimize() == mip.OptimizationStatus.OPTIMAL"

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvplane-controlplane" \
      org.opencontainers.image.description="SLO-aware KV-cache placement control plane for SGLang" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvplane \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin kvplane
COPY --from=builder /opt/kvplane /opt/kvplane
ENV PATH=/opt/kvplane/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
EXPOSE 50051 9090
# SIGTERM stops the server gracefully (--grace-s); exec form so kvplane is PID 1 and receives it.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvplane", "serve"]
CMD ["--listen", "0.0.0.0:50051", "--metrics-port", "9090"]
