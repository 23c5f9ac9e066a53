# syntax=docker/dockerfile:1
# One image for every role: `gpuops agent`, `gpuops run --role engine|executor`.
#   docker build -t gpuops:0.1.0 .
#   docker build --build-arg PROBE_PACKAGES=cupy-cuda12x -t gpuops:0.1.0-probe .
# The install steps are the ones tests/e2e/test_install.py runs: build the wheel, then
# `pip install` it into a fresh venv. Nothing else touches the package.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY . .
RUN python -m pip wheel --no-deps --no-cache-dir --wheel-dir /dist .

FROM ${PYTHON_IMAGE}
# The known-answer GPU probe needs CuPy or PyTorch; without one the agent reports the
# probe as `unavailable` (never a pass). Both are large, so the default image has none.
ARG PROBE_PACKAGES=""
# openssh-client: the executor reaches nodes over SSH (ansible); ipmitool: reprovision.yml
# drives BMCs from the executor (delegate_to: localhost). Nothing else from apt:
# no compiler, no git (a rule's `ref:` pin needs a git checkout; see docs/deploy.md).
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssh-client ipmitool \
    && rm -rf /var/lib/apt/lists/*
# A fixed uid/gid so that Kubernetes' runAsUser and file ownership on hosts agree.
RUN groupadd --system --gid 10001 gpuops \
    && useradd --system --uid 10001 --gid gpuops --home-dir /var/lib/gpuops \
       --shell /usr/sbin/nologin gpuops \
    && install -d -o gpuops -g gpuops -m 0700 /var/lib/gpuops \
    && install -d -o root -g gpuops -m 0750 /etc/gpuops
COPY --from=build /dist/ /tmp/dist/
RUN python -m venv /opt/gpuops \
    && /opt/gpuops/bin/pip install --no-cache-dir /tmp/dist/gpuops-*.whl \
    && if [ -n "$PROBE_PACKAGES" ]; then /opt/gpuops/bin/pip install --no-cache-dir $PROBE_PACKAGES; fi \
    && rm -rf /tmp/dist
COPY deploy/docker/healthcheck.py /opt/gpuops/healthcheck.py
# The site directory: rules/ and playbooks/ here are used before the shipped ones.
RUN install -d -o root -g gpuops -m 0755 /srv/gpuops

# XDG_STATE_HOME makes /var/lib/gpuops the default state dir (lowest precedence: a
# settings file, GPUOPS_STATE_DIR or --state-dir still win). Settings and secrets go
# under /etc/gpuops (GPUOPS_CONFIG=/etc/gpuops/gpuops.yml), mounted by the deployment.
ENV PATH=/opt/gpuops/bin:$PATH \
    HOME=/var/lib/gpuops \
    XDG_STATE_HOME=/var/lib \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /srv/gpuops
USER 10001:10001
EXPOSE 8080

# Only a process started with an HTTP address (GPUOPS_HTTP, or --http) has /healthz;
# the script says healthy for the others (the agent), which have nothing to ask.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["/opt/gpuops/bin/python", "/opt/gpuops/healthcheck.py"]
ENTRYPOINT ["gpuops"]
CMD ["--help"]
