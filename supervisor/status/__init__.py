"""The status HTTP app (docs/status.md). It reads State and never changes it; operator actions
go through the `actions` object the daemon passes in. `document` (pure) says what is shown,
`routes` is the aiohttp app, `listener` the hardened listener and `StatusServer`. Every
module logs as `supervisor.status` (`getLogger(__package__)`).
"""
