"""Runtime changes to live servers, and the plan that says when a reload is not needed.

HAProxy runs each CLI command as its own locked operation, even several on one `;` line, so
between two commands a server routes traffic in whatever state the first left it
(docs/runtime-changes.md, "The order of runtime commands"). `plan` (pure) says what may change
without a reload, `apply` sends it to one worker, `hook.RuntimeApplier` is what the reloader
calls. Every module logs as `supervisor.haproxy.runtime`.
"""
