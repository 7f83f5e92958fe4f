"""haproxy-supervisor: reload HAProxy without losing a request."""

__version__ = "0.1.0"
