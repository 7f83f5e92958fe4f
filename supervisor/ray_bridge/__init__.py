"""The bridge Ray Serve runs as its HAProxy binary (`haproxy-supervisor-ray-bridge`): see main.py
and docs/ray-serve.md."""
