"""`make demo`: start the demo backends, then the supervisor on config.example.yaml.

Ctrl-C stops the supervisor (which stops HAProxy) and the backends, by PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = {"hello_r1": 8081, "hello_r2": 8082, "fallback": 8089}


def main() -> int:
    procs = [
        subprocess.Popen([sys.executable, str(ROOT / "demo" / "backend.py"), str(port), name])
        for name, port in BACKENDS.items()
    ]
    print(
        "\nhaproxy-supervisor demo\n"
        "  curl http://127.0.0.1:8080/            # served by hello_r1 / hello_r2 through HAProxy\n"
        "  curl http://127.0.0.1:9180/status      # the supervisor's view, JSON\n"
        "  curl http://127.0.0.1:9180/metrics     # Prometheus metrics\n"
        "  open http://127.0.0.1:9180/            # the status page\n"
        "  edit demo/rendered/haproxy.cfg         # and watch it reload\n"
        "Ctrl-C stops everything.\n",
        flush=True,
    )
    daemon = subprocess.Popen(
        [str(Path(sys.executable).parent / "haproxy-supervisor"), "run", "--config", str(ROOT / "config.example.yaml")]
    )
    try:
        return daemon.wait()
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):
            daemon.send_signal(signal.SIGINT)
        return daemon.wait(timeout=60)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            proc.wait(5)


if __name__ == "__main__":
    raise SystemExit(main())
