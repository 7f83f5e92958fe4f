"""Runtime changes to live servers, and the plan that says when a reload is not needed.

Every change this daemon makes to a live server's address, port, weight or enabled
state goes through this package. HAProxy runs each CLI command as its own locked
operation, even several on one `;` line, so between two commands a server routes
traffic in whatever state the first one left it. `set server B/S addr 127.0.0.1 port 1`
on a `ready` server makes it routable at the placeholder until the `state maint` that
follows lands: requests balanced to it in that window fail with 503 (termination state
SC), and without `option redispatch` every retry hits the same slot.

One idea a module:
- `plan`: whether the new config differs from the running one only in what the runtime API
  can change, and the changes (or the one-line reason a reload is needed); a change to one
  live server, and the order of its commands; pure.
- `apply`: sending the changes to one worker, make before break, every answer checked.
- `add_remove`: servers added (`add server`) and removed (`del server`) in the current
  worker, its slot table kept in step.
- `pending`: removals HAProxy still refuses (connections attached), retried in the background.
- `hook`: `RuntimeApplier`, the reloader's `runtime_apply` and `save_server_state`.

Every module logs as `supervisor.haproxy.runtime` (`getLogger(__package__)`).
"""

from .hook import RuntimeApplier, RuntimeOutcome

__all__ = ["RuntimeApplier", "RuntimeOutcome"]
