# coda rollout pacing service: a slim image that runs `coda-server` as a non-root sidecar.
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

COPY deploy/container.yaml /etc/coda/pacer.yaml

# Durable state (server.state_dir in /etc/coda/pacer.yaml): mount a volume to keep it across containers.
VOLUME ["/var/lib/coda"]
USER 10001
EXPOSE 50051 9464
# Probes the standard gRPC health service (readiness); orchestrators with native gRPC probes can use that instead.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["coda-client", "--address", "127.0.0.1:50051", "health", "--service", "readiness"]
# The config path comes from $CODA_CONFIG (mount a file over /etc/coda/pacer.yaml); extra arguments are key=value overrides.
ENTRYPOINT ["coda-server"]
