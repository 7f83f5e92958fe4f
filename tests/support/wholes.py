"""The product's incremental and composed functions taken whole: what the tests hold the
product to, built only from its public parts. The daemon never needs these at once (it
parses in parts, steers from memoised plans), so they live here, not in supervisor/."""

from __future__ import annotations

from supervisor.steering.states import LiveStates, LiveTally


def parse_live_states(text: str) -> LiveStates:
    """`show servers state` straight to LiveStates: LiveTally fed the whole answer at once."""
    tally = LiveTally()
    tally.add(text)
    return tally.result()
