# haproxy-supervisor on Debian 12 with Debian's HAProxy (2.6).
#
#   docker build -t haproxy-supervisor .
#   docker run -d --name hs --stop-timeout 40 \
#     -v /srv/haproxy/rendered:/etc/haproxy/rendered:ro \
#     -p 80:8080 -p 127.0.0.1:9180:9180 haproxy-supervisor
#
# The controller writes the rendered config into the mounted /etc/haproxy/rendered; the
# daemon watches it, validates it and reloads HAProxy. Mount your own settings over
# /etc/haproxy-supervisor/config.yaml (see config.example.yaml for every key).
#
# The daemon is PID 1 and handles SIGTERM itself: it soft-stops HAProxy and waits up to
# haproxy.stop_timeout_s (30 s by default), so give `docker stop` more than that
# (--stop-timeout 40, or terminationGracePeriodSeconds in Kubernetes).
#
# It runs as the unprivileged `haproxy` user (created by Debian's package). Ports below
# 1024 need `--sysctl net.ipv4.ip_unprivileged_port_start=0` (Docker sets it by default
# since 20.10 unless the host network is used) or ports >= 1024 in the rendered config.
FROM debian:bookworm-slim

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# HAProxy from Debian's packages (the version the tests run); Python for the daemon.
RUN apt-get update \
 && apt-get install -y --no-install-recommends haproxy python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

# The package, installed (not editable) into its own venv. Dependencies first, so a code
# change does not rebuild them: pyproject.toml and README.md are all setuptools needs.
WORKDIR /opt/haproxy-supervisor/src
COPY pyproject.toml README.md ./
COPY supervisor ./supervisor
RUN python3 -m venv /opt/haproxy-supervisor/venv \
 && /opt/haproxy-supervisor/venv/bin/pip install --no-compile . \
 && ln -s /opt/haproxy-supervisor/venv/bin/haproxy-supervisor /usr/local/bin/haproxy-supervisor \
 && haproxy-supervisor --version \
 && haproxy -v | head -1

# Settings for a container: the rendered config under /etc/haproxy/rendered, runtime
# files under /run/haproxy-supervisor, status on every interface (reads only: with no
# status.token_file, POST/DELETE over TCP answer 403).
COPY docker/config.yaml /etc/haproxy-supervisor/config.yaml
RUN mkdir -p /etc/haproxy/rendered /run/haproxy-supervisor \
 && chown haproxy:haproxy /run/haproxy-supervisor

USER haproxy
WORKDIR /run/haproxy-supervisor
EXPOSE 9180

# /healthz is 200 while the event loop runs and the HAProxy master is up. urlopen raises
# on a 503 or a refused connection, and an uncaught exception exits 1 (unhealthy).
# Exec form, no shell; the address must follow status.listen in the settings.
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
  CMD ["/opt/haproxy-supervisor/venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9180/healthz', timeout=3)"]

STOPSIGNAL SIGTERM
CMD ["haproxy-supervisor", "run", "--config", "/etc/haproxy-supervisor/config.yaml"]
