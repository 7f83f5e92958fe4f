"""Steering old (displaced) workers away from dead servers, as a pipeline of pure steps.

Decide:
- states.py: the current worker's `show servers state`, boiled down to evidence per endpoint;
- dead.py: which servers are dead, per generation (config digests interned by content, the
  three rules), and `Digests`, every config in use digested once;
- entries.py: what a backend's steer-map entries must be, given its dead servers;
- plan.py: one round's wanted maps for every worker, memoised by content.
Diff:
- mapdiff.py: from the entries a worker holds to the phased changes that make them its plan.
Wire:
- lines.py: those changes as CLI lines, and the answers to them read.
The stalled-connection detector: stalled.py (which sockets are stalled, which servers are
suspect, which sockets to destroy; pure) and detector.py (its owner, polling sock_diag).
Around them, the shells: live.py (reads of the current worker's states), push.py (one
worker's push and read-back, returning outcomes), rounds.py (the one place that changes a
worker's record, record.py, and publishes to State) and workers.py (tracks, plans, pushes,
verifies, backs off and rebuilds).
"""
