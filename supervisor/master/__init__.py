"""The HAProxy master process: start, adopt, watch, restart with backoff, stop.

One object owns the master the way gunicorn's Arbiter owns its workers. HAProxy
runs in master-worker mode in the foreground (`-W`, no `-D`), as our child in a
session of its own, so a Ctrl-C on the daemon's terminal reaches the daemon only.
Its stdout is the daemon's; its stderr is the daemon's FIFO (haproxy/stderr.py), which
the daemon relays line by line to its own stderr (under systemd: the journal) and reads
server state changes from. The FIFO's write end is non-blocking: after a daemon crash
HAProxy's messages are lost (EPIPE, ignored), HAProxy is never stalled, and the next
daemon opens the FIFO again by its path.

A master that is not our child (adopted after a daemon restart) is watched through
a pidfd, which becomes readable when the process exits; a child is watched the
same way and reaped. No thread, no polling.

HAProxy's signals in master-worker mode (checked on 2.6.12): SIGUSR1 to the master
soft-stops every worker and the master exits once they are all gone; SIGTERM (and
SIGINT) hard-stop them. When the master dies, its workers notice (their pipe to the
master closes) and exit.

The package, one idea a module:
- `process`: `MasterProcess`, the one object that owns the lifecycle (start, adopt, restart
  with backoff, re-execute, stop), and its errors.
- `find`: which process is our master (by the master socket it holds) and which are its
  workers (by argv); pure recognisers and /proc reads.
- `readiness`: whether a worker is ready (answers on the master CLI, listens on the config's
  ports, seen through sock_diag).
- `processes`: what /proc says about a process (alive, start time, sockets held); its end:
  watched through a pidfd, described, brought about by signals; `WorkerExits`, a pidfd per
  old worker.
- `sockdiag`: the one sock_diag client (TCP sockets by state and port, SOCK_DESTROY).

Every module logs as `supervisor.master` (`getLogger(__package__)`).
"""

from .process import MasterError, MasterProcess, MasterSocketGone

__all__ = ["MasterError", "MasterProcess", "MasterSocketGone"]
