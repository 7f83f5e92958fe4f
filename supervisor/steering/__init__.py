"""Steering old (displaced) workers away from dead servers, as a pipeline of pure steps.

Decide:
- dead.py: which servers are dead, per generation (config digests interned by content, the
  three rules), and `Digests`, every config in use digested once;
- live.py: the current worker's evidence (its `show servers state`, parsed in parts), read;
- plan.py: what a backend's steer-map entries must be, and one round's plans for every
  worker, memoised by content.
Diff and wire:
- mapdiff.py: from the entries a worker holds to the phased changes that make them its plan,
  as CLI lines, and the answers to them read.
The stalled-connection detector: detector.py (which sockets are stalled, which servers are
suspect, which sockets to destroy, and StalledDetector, their owner, polling sock_diag).
Around them, the shells: push.py (one worker's push and read-back, returning outcomes),
rounds.py (the one place that changes a worker's record, and publishes to State) and
workers.py (tracks, plans, pushes, verifies, backs off and rebuilds; a reload's ReloadPlan).
"""
