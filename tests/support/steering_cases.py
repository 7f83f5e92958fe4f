"""The configs the steering's pure tests share, a node drained between OLD and NEW (its replicas
moved to another address), and the small helpers that read them: the guarded model, its digest,
the steer-map entries and the routes they give, and live server states."""

from __future__ import annotations

import random

from rigs.wholes import inject_guard, steer_entries
from supervisor.haproxy.answers import ServerState
from supervisor.haproxy.config import Config
from supervisor.haproxy.guard import slot_table
from supervisor.steering.dead import ConfigDigest, Sections, dead_groups

MAP = "/run/hs/steer.map"
TABLE = "/run/hs/slots-0.map"

OLD = """\
defaults
    mode http
backend echo
    server echo_r1 10.0.0.1:8001 check
    server fallback 10.0.9.9:8000 check backup
backend highscale
    server hs_r1 10.0.0.1:8002 check
    server hs_r2 10.0.0.1:8003 check
    server fallback 10.0.9.9:8000 check backup
backend wide
    server wide_r1 10.0.0.1:8004 check
    server wide_r2 10.0.0.2:8004 check
    server wide_r3 10.0.0.3:8004 check
    server fallback 10.0.9.9:8000 check backup
backend nobackup
    server nb_r1 10.0.0.1:8005 check
    server nb_r2 10.0.0.2:8005 check
backend parked
    server p1 10.0.0.1:8006 disabled
    server p2 10.0.0.2:8006
"""

# node 10.0.0.1 drained: its replicas moved to 10.0.0.4
NEW = """\
defaults
    mode http
backend echo
    server echo_r9 10.0.0.4:8001 check
    server fallback 10.0.9.9:8000 check backup
backend highscale
    server hs_r8 10.0.0.4:8002 check
    server hs_r9 10.0.0.4:8003 check
    server fallback 10.0.9.9:8000 check backup
backend wide
    server wide_r9 10.0.0.4:8004 check
    server wide_r2 10.0.0.2:8004 check
    server wide_r3 10.0.0.3:8004 check
    server fallback 10.0.9.9:8000 check backup
backend nobackup
    server nb_r9 10.0.0.4:8005 check
    server nb_r2 10.0.0.2:8005 check
backend parked
    server p2 10.0.0.2:8006
"""


def routes(config: Config, entries: dict[str, str], backend: str) -> list[str]:
    """The server each slot a steered request can pick resolves to, as the guard's rules
    resolve it: the steer map's entry for the slot, else the slot table's."""
    table = dict(slot_table(config)).get(backend, [])
    count = int(entries.get(f"{backend}_n", "-1"))
    return [entries.get(f"{backend}_{i}", table[i] if i < len(table) else "<none>") for i in range(count)]


def home_entries(entries: dict[str, str], slots: int) -> dict[str, str]:
    """The count and the overrides of table slots, without the draw slots past the table."""
    return {k: v for k, v in entries.items() if k.endswith("_n") or int(k.rpartition("_")[2]) < slots}


def model(text: str) -> Config:
    return inject_guard(Config.parse(text), MAP, TABLE)


def digest(config: Config, cache: Sections | None = None) -> ConfigDigest:
    return (cache if cache is not None else Sections()).digest(config)


def steer_map_entries(
    config: Config, dead: frozenset[str], no_backup: str, unusable: frozenset[str] = frozenset()
) -> dict[str, str]:
    return steer_entries(digest(config), dead, no_backup, unusable)  # type: ignore[arg-type]


def dead_in(generation: ConfigDigest, latest: ConfigDigest, view) -> frozenset[str]:
    return frozenset().union(*dead_groups(generation, latest, view).values())


def state(key: str, address: str, op: int = 2, admin: int = 0, weight: int = 1) -> ServerState:
    backend, _, name = key.partition("/")
    host, _, port = address.partition(":")
    return ServerState(backend, name, host, int(port), op, admin, weight)


def live_of(text: str, down: set[str] = frozenset(), maint: set[str] = frozenset()) -> list[ServerState]:
    return [
        state(s.key, s.endpoint, op=0 if s.key in down else 2, admin=1 if s.key in maint else 0)
        for s in Config.parse(text).servers()
    ]


def random_model(rng: random.Random) -> Config:
    text = "defaults\n    mode http\n"
    for b in rng.sample(range(8), rng.randint(1, 8)):
        servers = [f"    server s{r} 10.0.{rng.randint(0, 2)}.{r}:80\n" for r in range(rng.randint(1, 3))]
        text += f"backend be{b}\n" + "".join(servers) + ("    server bk 10.9.9.9:80 backup\n" if b % 2 else "")
    return model(text)


def random_config(rng: random.Random, cache: Sections) -> ConfigDigest:
    return digest(random_model(rng), cache)
