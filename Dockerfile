# ftctl's container image: the migrating proxy, the canary daemon and the lock/failover
# commands, from the base install (no torch, no GPU libraries; `ftctl sim` and the CPU KV
# copier need the [sim] extra and are not in it). docs/container.md says how to build and run.
#
#   docker build -t ftctl:0.1.0 .
#   docker run --rm -p 8000:8000 -v "$PWD/ftctl.yaml:/etc/ftctl/ftctl.yaml:ro" \
#       ftctl:0.1.0 proxy --listen 0.0.0.0:8000

# Python 3.11 on Debian 12: the oldest Python the package supports (requires-python), so the
# image also proves it. Pin a digest (python:3.11-slim-bookworm@sha256:...) for byte-for-byte
# rebuilds; the tag follows 3.11's security releases.
FROM python:3.11-slim-bookworm AS build

WORKDIR /src
COPY pyproject.toml README.md hatch_build.py ./
COPY src ./src
# The slim image has no C compiler: the wheel's build hook skips the KV row-copy kernel (a
# [sim] feature) and the wheel is pure Python. The build backend comes from pyproject.toml.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM python:3.11-slim-bookworm

# Where the image was built from: the repository has no canonical URL of its own, so the
# build says it (docker build --build-arg SOURCE_URL=... --build-arg REVISION=$(git rev-parse HEAD)).
ARG SOURCE_URL=""
ARG REVISION=""
LABEL org.opencontainers.image.title="ftctl" \
      org.opencontainers.image.description="Fault-tolerance utilities for LLM inference clusters: migrating proxy, canary daemon, failover lock" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.revision="${REVISION}"

# A fixed numeric uid, so Kubernetes' runAsNonRoot can check it without a runAsUser.
# /var/lib/ftctl holds the canary latency baseline and the fault audit log (XDG_STATE_HOME);
# /etc/ftctl is where the inventory is mounted (FTCTL_INVENTORY).
RUN groupadd --system --gid 10001 ftctl \
    && useradd --system --uid 10001 --gid ftctl --home-dir /home/ftctl --create-home \
       --shell /usr/sbin/nologin ftctl \
    && mkdir -p /etc/ftctl /var/lib/ftctl \
    && chown ftctl:ftctl /var/lib/ftctl

COPY --from=build /dist/ /tmp/dist/
RUN pip install --no-cache-dir /tmp/dist/dynamo_ftctl-*.whl \
    && rm -rf /tmp/dist

ENV FTCTL_INVENTORY=/etc/ftctl/ftctl.yaml \
    XDG_STATE_HOME=/var/lib/ftctl \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /home/ftctl

# 8000: `ftctl proxy --listen 0.0.0.0:8000`; 8090: `ftctl canary --watch --listen 0.0.0.0:8090`.
EXPOSE 8000 8090

# No HEALTHCHECK: one image serves three roles on different ports (the proxy's and the
# daemon's /health, none for `ftctl lock`), and Kubernetes ignores it; the examples in
# examples/k8s declare a probe per role. Both servers stop cleanly on SIGTERM as PID 1.
ENTRYPOINT ["ftctl"]
CMD ["--help"]
