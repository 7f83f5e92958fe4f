"""The status HTTP app: /status, /metrics, /healthz, /readyz, the page, and the operator's actions.

It reads State and never changes it; operator actions (reload, mark a server dead) go
through the `actions` object the daemon passes in. What is shown is computed by pure
functions (`status_document`, `StateCollector`, and the page's in supervisor/page/), so
they are unit-tested without a server.

Who may act: over TCP, `POST`/`DELETE` need `Authorization: Bearer <token>` with the
token from `status.token_file` (none configured: 403). On a unix socket there is no
token: the socket file is created 0660, so its owner and group decide who may connect.

The package, one idea a module:
- `document`: the /status document and the readiness verdict; pure.
- `metrics`: the Prometheus collector over State; pure.
- `routes`: the aiohttp app: endpoints, who may act, bounded bodies, JSON errors.
- `listener`: the hardened listener (TCP or unix socket, connection limit, header
  timeout) and `StatusServer`, the daemon component that serves the app on it.

Every module logs as `supervisor.status` (`getLogger(__package__)`).
"""

from .listener import StatusServer, StatusServerError
from .routes import StatusActions

__all__ = ["StatusActions", "StatusServer", "StatusServerError"]
