"""The current worker's `show servers state`, boiled down to evidence per endpoint (rule (b)
of dead.py), parsed in parts so that a big answer never holds the event loop for long."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..haproxy.answers import ADMIN_MAINT_MASK, ServerKey, servers_state_rows

# Where a server is: "<backend> <address>:<port>". One string (a backend name has no blank):
# strings cache their hash, and sets of thousands of them are compared on every drain.
At = str


@dataclass(frozen=True)
class LiveStates:
    """The current worker's `show servers state`, boiled down to evidence per endpoint."""

    down: frozenset[At] = frozenset()  # endpoints where servers are DOWN or MAINT and none is alive
    pending: frozenset[At] = frozenset()  # endpoints whose only servers have not been checked yet
    # Verdicts by "backend/server": every server that is not plainly alive, and those
    # configured by host name (their live address differs from the configured one).
    alive_by_key: dict[str, bool | None] = field(default_factory=dict)

    def unusable(self) -> frozenset[str]:
        """Its servers that are DOWN or in maintenance: a `use-server` rule skips them."""
        return frozenset(k for k, verdict in self.alive_by_key.items() if verdict is False)


_LIVE_COLUMNS = ("be_name", "srv_name", "srv_addr", "srv_port", "srv_op_state", "srv_admin_state",
                 "srv_check_state", "srv_check_result", "srv_fqdn")  # fmt: skip
_CHECK_RUNNING = 0x02 | 0x04  # CHK_ST_CONFIGURED | CHK_ST_ENABLED
_RUNNING_CHECK_STATES = frozenset(str(v) for v in range(256) if v & _CHECK_RUNNING == _CHECK_RUNNING)
_CHECK_UNKNOWN = "0"  # the check result before the first check concluded


class LiveTally:
    """`show servers state` boiled down to LiveStates, fed in parts: an endpoint is down only
    if no part shows a server alive there, so the verdict waits for the last part."""

    def __init__(self) -> None:
        self.down: set[tuple[str, str, str]] = set()
        self.up: set[tuple[str, str, str]] = set()
        self.pending: set[tuple[str, str, str]] = set()
        self.by_key: dict[str, bool | None] = {}

    def add(self, text: str) -> None:
        """Rows of `show servers state` (answers.servers_state_rows): a loop that does next to
        nothing for the usual row (alive)."""
        down, up, pending, by_key = self.down, self.up, self.pending, self.by_key
        for block in servers_state_rows(text, _LIVE_COLUMNS):
            col = block.at
            i_be, i_name, i_addr = col["be_name"], col["srv_name"], col["srv_addr"]
            i_port, i_op, i_admin = col.get("srv_port"), col["srv_op_state"], col["srv_admin_state"]
            i_cstate, i_cres, i_fqdn = col.get("srv_check_state"), col.get("srv_check_result"), col.get("srv_fqdn")
            for v in block.rows:
                where = (v[i_be], v[i_addr], v[i_port] if i_port is not None else "")
                admin = v[i_admin]
                verdict: bool | None
                if v[i_op] == "0" or (admin != "0" and int(admin) & ADMIN_MAINT_MASK):
                    verdict = False
                    down.add(where)
                elif i_cstate is not None and v[i_cres] == _CHECK_UNKNOWN and v[i_cstate] in _RUNNING_CHECK_STATES:
                    verdict = None
                    pending.add(where)
                else:
                    up.add(where)
                    if i_fqdn is None or v[i_fqdn] == "-":
                        continue  # the usual case: nothing more to note
                    verdict = True
                by_key[ServerKey.of(v[i_be], v[i_name])] = verdict

    def result(self) -> LiveStates:
        def ats(raw: set[tuple[str, str, str]]) -> frozenset[At]:
            return frozenset(f"{b} {a}:{p}" if p.isdigit() else f"{b} {a}" for b, a, p in raw)

        up = self.up
        return LiveStates(ats(self.down - up), ats(self.pending - up - self.down), dict(self.by_key))
