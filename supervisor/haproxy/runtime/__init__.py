"""Runtime changes to live servers: `plan` (pure) says what may change without a reload, `apply`
sends it to one worker, `hook.RuntimeApplier` is what the reloader calls. HAProxy runs each CLI
command on its own, so between two a server routes as the first left it (docs/runtime-changes.md)."""
