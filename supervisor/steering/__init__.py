"""Steering old (displaced) workers away from dead servers.

- dead.py: which servers are dead, per generation (config digests interned by content,
  the current worker's server states, the three rules);
- entries.py: what a backend's steer-map entries must be, given its dead servers;
- mapdiff.py: from the entries a worker holds to the ordered CLI lines that change them;
- plan.py: one round's wanted maps for every worker, memoised by content;
- workers.py: the I/O shell that tracks, pushes, verifies, backs off and rebuilds.
"""
