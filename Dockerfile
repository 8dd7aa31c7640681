# checkpoint-sidecar: mirrors Agent Framework hosting state (.checkpoints/, .function_approvals/)
# to durable storage and restores it after compute recreation.
#
#   podman build -t checkpoint-sidecar .          (docker build works the same)
#   podman run --rm checkpoint-sidecar --help
#
# Two stages: `build` makes a self-contained virtual environment in /opt/checkpoint-sidecar
# (dependencies in their own layer, keyed on pyproject.toml only); the final stage copies that
# venv onto the same slim base: no compiler, no pip, no build cache. Runs as UID/GID 10001 in
# /app, where the agent's state directories are expected (mount them at /app/.checkpoints and
# /app/.function_approvals, or set SIDECAR_ROOTS to absolute paths).
ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/checkpoint-sidecar
WORKDIR /src
# Dependencies only (a stub package stands in for the code), at the versions in constraints.txt
# (the ones CI tests): rebuilt when pyproject.toml or constraints.txt changes.
COPY pyproject.toml constraints.txt ./
RUN mkdir sidecar && touch sidecar/__init__.py \
 && /opt/checkpoint-sidecar/bin/pip install -c constraints.txt . \
 && /opt/checkpoint-sidecar/bin/pip uninstall -y checkpoint-sidecar \
 && rm -rf sidecar build ./*.egg-info
# The code (README.m[d]: copied when present, the pattern matches nothing otherwise).
COPY README.m[d] ./
COPY sidecar ./sidecar
RUN /opt/checkpoint-sidecar/bin/pip install --no-deps . \
 && /opt/checkpoint-sidecar/bin/pip uninstall -y pip setuptools \
 && /opt/checkpoint-sidecar/bin/checkpoint-sidecar --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="checkpoint-sidecar" \
      org.opencontainers.image.description="Mirrors Agent Framework checkpoints to durable storage and restores them after compute recreation" \
      org.opencontainers.image.licenses="MIT"
# A fixed, non-root UID/GID: the agent container must run as the same UID to share the state
# files (the sidecar writes them 0600 in 0700 directories).
RUN groupadd --gid 10001 sidecar \
 && useradd --uid 10001 --gid 10001 --home-dir /home/sidecar --create-home --shell /usr/sbin/nologin sidecar \
 && install -d -o 10001 -g 10001 -m 0755 /app \
 && install -d -o 10001 -g 10001 -m 0700 /app/.checkpoints /app/.function_approvals
COPY --from=build /opt/checkpoint-sidecar /opt/checkpoint-sidecar
# SIDECAR_HTTP_ADDR: /livez /readyz /metrics on every interface, so kubelet and other
# containers of the pod can reach them (the program's own default is loopback only).
ENV PATH=/opt/checkpoint-sidecar/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SIDECAR_HTTP_ADDR=0.0.0.0:7479 \
    SIDECAR_LOG_FORMAT=json
WORKDIR /app
USER 10001:10001
EXPOSE 7479
# Exec form throughout: the CLI is PID 1 and handles SIGTERM/SIGINT itself (graceful drain,
# bounded by SIDECAR_DRAIN_TIMEOUT, default 20 s; give the runtime a longer stop timeout).
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["checkpoint-sidecar", "probe", "live"]
ENTRYPOINT ["checkpoint-sidecar"]
CMD ["sync"]
