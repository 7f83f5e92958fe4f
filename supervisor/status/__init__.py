"""The status HTTP app: /status, /metrics, /healthz, /readyz, the page, and the operator's actions.

It reads State and never changes it; operator actions (reload, mark a server dead) go
through the `actions` object the daemon passes in. What is shown is computed by pure
functions (`status_document`, `StateCollector`, and the page's in supervisor/page.py), so
they are unit-tested without a server.

Who may act: over TCP, `POST`/`DELETE` need `Authorization: Bearer <token>` with the
token from `status.token_file` (none configured: 403). On a unix socket there is no
token: the socket file is created 0660, so its owner and group decide who may connect.

`document` (pure) says what is shown, `routes` is the aiohttp app, `listener` the hardened
listener and `StatusServer`. Every module logs as `supervisor.status` (`getLogger(__package__)`).
"""
