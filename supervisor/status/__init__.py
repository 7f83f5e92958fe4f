"""The status HTTP app (docs/status.md): it reads State, and acts through the daemon's `actions`.
`document` says what is shown, `routes` is the aiohttp app, `listener` serves it. Every module
logs as `supervisor.status` (`getLogger(__package__)`)."""
