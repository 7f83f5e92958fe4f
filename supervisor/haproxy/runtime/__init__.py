"""Runtime changes to live servers, and the plan that says when a reload is not needed.

Every change this daemon makes to a live server's address, port, weight or enabled
state goes through this package. HAProxy runs each CLI command as its own locked
operation, even several on one `;` line, so between two commands a server routes
traffic in whatever state the first one left it. `set server B/S addr 127.0.0.1 port 1`
on a `ready` server makes it routable at the placeholder until the `state maint` that
follows lands: requests balanced to it in that window fail with 503 (termination state
SC), and without `option redispatch` every retry hits the same slot.

`plan` (pure) says what may change without a reload, `apply` sends it to one worker, and
`hook.RuntimeApplier` is what the reloader calls. Every module logs as
`supervisor.haproxy.runtime` (`getLogger(__package__)`).
"""
