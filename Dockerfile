# coda rollout pacing service: a slim image that runs `coda-server` as a non-root sidecar.
#   docker build -t coda-pacer:0.1.0 -t coda-pacer:latest .      (the tag is the version in pyproject.toml; add
#     -t coda-pacer:0.1.0-$(git rev-parse --short HEAD) so a rebuild leaves the previous image to roll back to)
#   docker run --stop-timeout 30 -p 50051:50051 -p 9464:9464 -v coda-state:/var/lib/coda coda-pacer:0.1.0
# Only the paths COPY names enter the build context (.dockerignore): local custom strategies are mounted, not baked in.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CODA_CONFIG=/etc/coda/pacer.yaml

WORKDIR /src
COPY pyproject.toml README.md ./
COPY conf ./conf
COPY coda_server ./coda_server
COPY coda_client ./coda_client
COPY coda_worker ./coda_worker
COPY coda_sim ./coda_sim
RUN pip install --no-cache-dir .[server] \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin coda \
    && mkdir -p /var/lib/coda && chown 10001 /var/lib/coda \
    && rm -rf /src
# /src is gone: run in the state volume, the one directory the server may write to, so that a relative
# server.state_dir (the default ./coda-state, when a config of your own leaves the key out) lands there too.
WORKDIR /var/lib/coda

COPY deploy/container.yaml /etc/coda/pacer.yaml

# Durable state (server.state_dir in /etc/coda/pacer.yaml): mount a volume to keep it across containers.
VOLUME ["/var/lib/coda"]
USER 10001
EXPOSE 50051 9464
# Readiness on the plaintext health-only port (server.health_address in /etc/coda/pacer.yaml): it answers
# whether or not server.tls is set. Orchestrators with native gRPC probes can use either port instead.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["coda-client", "--address", "127.0.0.1:8081", "health", "--service", "readiness"]
# On SIGTERM the server gives in-flight calls server.shutdown_grace_seconds (10 s): `docker stop` waits only
# 10 s before SIGKILL, so run with `--stop-timeout 30` (or `docker stop -t 30`).
# The config path comes from $CODA_CONFIG (mount a file and point CODA_CONFIG at it); extra arguments are
# key=value overrides.
ENTRYPOINT ["coda-server"]
