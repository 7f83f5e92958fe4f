"""Steering old workers away from dead servers (docs/steering.md): pure steps (dead, live, plan,
mapdiff) inside the shells push.py, rounds.py and workers.py."""
