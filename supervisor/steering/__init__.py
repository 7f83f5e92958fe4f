"""Steering old (displaced) workers away from dead servers (docs/steering.md): pure steps
(dead, live, plan, mapdiff; the detector's judgements) inside the shells push.py, rounds.py
(the one place that changes a worker's record) and workers.py (OldWorkers, a reload's plan).
"""
