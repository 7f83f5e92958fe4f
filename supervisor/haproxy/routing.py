"""How HAProxy picks a server, as far as the guard can reproduce it with HAProxy's own sample
fetches: the guard overrides only requests HAProxy would send to a dead server. Cookies, stick
ids, map-based hashes (lb_map.c), consistent-hash buckets (lb_chash.c): docs/steering.md."""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import gcd

from .lexer import Line
from .resolution import ProxySettings, Server

# A name or argument that goes into a sample expression: no `,`, `)`, blanks, quotes or `#`.
_SAFE_ARG = re.compile(r"^[A-Za-z0-9_.:-]+$")
# A whole sample expression copied from the config (a stick rule's pattern, `balance hash`).
_SAFE_EXPR = re.compile(r"^[A-Za-z0-9_.:(),/-]+$")
_HASH_FUNCTIONS = ("sdbm", "djb2", "wt6", "crc32")


@dataclass(frozen=True, slots=True)
class Routing:
    """What the guard of one backend reproduces of HAProxy's choice, as sample expressions."""

    cookie: str | None = None  # the request's server cookie value
    sticks: tuple[str, ...] = ()  # per stick rule that matches, in order: the server id it stored
    hash_key: str | None = None  # the key HAProxy hashes
    hash_function: str | None = None  # the converter that hashes it like HAProxy (None: the key is the hash)
    consistent: bool = False  # `hash-type consistent`: a bucket of the ring, not a map position

    @property
    def hashed(self) -> bool:
        return self.hash_key is not None


PLAIN = Routing()


def routing_of(settings: ProxySettings, body: Sequence[Line], backend: str) -> Routing:
    hashing = _hash_of(settings)
    consistent = settings.hash_type[:1] == ("consistent",)
    if consistent and hashing is not None:
        balance_factor = any(line.words[:1] == ("hash-balance-factor",) for line in body)
        if hashing[1] is None or balance_factor or any(_hash_keys(line.words) for line in body):
            hashing = None
    hash_key, hash_function = hashing or (None, None)
    return Routing(
        cookie=_cookie_expr(settings) if settings.mode == "http" else None,
        sticks=_stick_exprs(body, backend),
        hash_key=hash_key,
        hash_function=hash_function,
        consistent=hashing is not None and consistent,
    )


def _hash_keys(words: tuple[str, ...]) -> bool:
    """Whether a server line sets a `hash-key` other than `id` (the default, reproduced)."""
    if words[:1] not in (("server",), ("server-template",), ("default-server",)):
        return False
    return any(w == "hash-key" and words[i + 1] != "id" for i, w in enumerate(words[:-1]))


def _cookie_expr(settings: ProxySettings) -> str | None:
    words = settings.cookie
    if not words or not _SAFE_ARG.match(words[0]) or "dynamic" in words[1:]:
        return None
    expr = f"req.cook({words[0]})"
    if "prefix" in words[1:]:
        return expr + ",field(1,~)"
    if "maxidle" in words[1:] or "maxlife" in words[1:]:
        return expr + ",field(1,|)"
    return expr


def _stick_exprs(body: Sequence[Line], backend: str) -> tuple[str, ...]:
    exprs: list[str] = []
    for line in body:
        words = line.words
        if len(words) < 3 or words[0] != "stick" or words[1] not in ("match", "on"):
            continue
        rest = list(words[3:])
        table = backend
        if rest[:1] == ["table"] and len(rest) > 1:
            table, rest = rest[1], rest[2:]
        if rest or not _SAFE_EXPR.match(words[2]) or not _SAFE_ARG.match(table):
            continue  # a condition the guard does not evaluate, or a pattern it cannot copy
        exprs.append(f"{words[2]},table_server_id({table})")
    return tuple(exprs)


def _hash_of(settings: ProxySettings) -> tuple[str, str | None] | None:
    """(the key HAProxy hashes, the converter that hashes it like HAProxy), or None."""
    kind, *rest = settings.hash_type or ("map-based",)
    if kind not in ("map-based", "consistent") or settings.balance == ():
        return None
    function = rest[0] if rest and rest[0] in (*_HASH_FUNCTIONS, "none") else "sdbm"
    if function == "none":
        return None
    # `hash-type consistent` alone means sdbm with avalanche (cfgparse-listen.c).
    avalanche = "avalanche" in rest or (kind == "consistent" and not rest)
    converter = f"{function}(1)" if avalanche else function
    algo, *options = settings.balance
    if algo == "uri":
        if "len" in options or "depth" in options:
            return None
        whole, path_only = "whole" in options, "path-only" in options
        key = ("pathq" if whole else "path") if path_only else ("url" if whole else "url,field(1,?)")
        return key, converter
    if algo == "source" and not options and not avalanche:
        # get_server_sh() ignores the hash function: for IPv4 the key is the address as an
        # integer (an IPv6 one casts to none, and is drawn instead).
        return "src", None
    if algo.startswith("hdr(") and algo.endswith(")") and not options:
        name = algo[4:-1]
        return (f"req.hdr({name},1)", converter) if _SAFE_ARG.match(name) else None
    if algo == "url_param" and len(options) == 1 and _SAFE_ARG.match(options[0]):
        return f"url_param({options[0]})", converter
    if algo.startswith("rdp-cookie(") and algo.endswith(")") and not options:
        name = algo[11:-1]
        return (f"req.rdp_cookie({name})", converter) if _SAFE_ARG.match(name) else None
    if algo == "hash" and len(options) == 1 and _SAFE_EXPR.match(options[0]):
        return options[0], converter
    return None


def server_ids(servers: Iterable[tuple[str, Sequence[str]]]) -> dict[str, int]:
    """name -> the id HAProxy gives each (name, params): its `id`, else the lowest one free, in config order from 1."""
    listed = list(servers)
    ids: dict[str, int] = {}
    for name, params in listed:
        for i, word in enumerate(params[:-1]):
            if word == "id" and params[i + 1].isdigit():
                ids[name] = int(params[i + 1])
    taken = set(ids.values())
    next_id = 1
    for name, _ in listed:
        if name in ids:
            continue
        while next_id in taken:
            next_id += 1
        ids[name] = next_id
        taken.add(next_id)
    return ids


def effective_weight(server: Server) -> int:
    return server.weight if server.weight is not None else 1


def server_map(servers: Sequence[Server], up: Iterable[str]) -> list[str]:
    """The map-based server map (lb_map.c) of primaries `up`: `hash % len(map)` picks a server."""
    usable = set(up)
    divisor = gcd(*(effective_weight(s) for s in servers)) or 1
    eweight = {s.name: (effective_weight(s) + divisor - 1) // divisor for s in servers}
    chosen = [s for s in servers if not s.backup and s.name in usable and eweight[s.name] > 0]
    if not chosen:
        return []
    total = sum(eweight[s.name] for s in chosen)
    if total == 1 or len(chosen) == 1:
        return [chosen[0].name] * total
    score = {s.name: 0 for s in chosen}
    table: list[str] = []
    for _ in range(total):
        best: str | None = None
        best_value = 0
        for s in chosen:
            score[s.name] += eweight[s.name]
            value = (score[s.name] + total) // total
            if best is None or value > best_value:
                best, best_value = s.name, value
        assert best is not None
        table.append(best)
        score[best] -= total
    return table


_M32 = 0xFFFFFFFF


def full_hash(a: int) -> int:
    """HAProxy's full_hash() (Bob Jenkins' avalanche, then a prime multiply), on 32 bits."""
    a = ((a + 0x7ED55D16) + (a << 12)) & _M32
    a = ((a ^ 0xC761C23C) ^ (a >> 19)) & _M32
    a = ((a + 0x165667B1) + (a << 5)) & _M32
    a = ((a + 0xD3A2646C) ^ (a << 9)) & _M32
    a = ((a + 0xFD7046C5) + (a << 3)) & _M32
    a = ((a ^ 0xB55A4F09) ^ (a >> 16)) & _M32
    return (a * 3221225473) & _M32


def sdbm(data: bytes) -> int:
    h = 0
    for c in data:
        h = (c + (h << 6) + (h << 16) - h) & _M32
    return h


NodeKeys = str  # "id-times-4096" (2.6, 2.8) or "hashed-id" (3.0): where a ring point's key comes from
ID_TIMES_4096, HASHED_ID = "id-times-4096", "hashed-id"
BUCKET_BITS = 12  # the guard reads a hash's top 12 bits: 4,096 buckets


def ring(
    servers: Sequence[Server], up: Iterable[str], ids: dict[str, int], node_keys: NodeKeys
) -> list[tuple[int, str]]:
    """The consistent-hash ring of primaries `up`: (point key, server) sorted, 16 points per unit of weight."""
    usable = set(up)
    points: list[tuple[int, str]] = []
    for s in servers:
        weight = effective_weight(s)
        if s.backup or s.name not in usable or weight <= 0:
            continue
        puid = ids[s.name]
        for node in range(weight * 16):
            seed = (full_hash(puid) + node) if node_keys == HASHED_ID else (puid * 4096 + node)
            points.append((full_hash(seed & _M32), s.name))
    points.sort()
    return points


def _arcs(points: list[tuple[int, str]]) -> list[tuple[int, int, str]]:
    """(first hash, last hash, server) of each point's arc, the hashes closest to it (a tie goes
    to the point before, as in chash_get_server_hash), unwrapped into [0, 2^32)."""
    arcs: list[tuple[int, int, str]] = []
    n = len(points)
    for i, (key, name) in enumerate(points):
        before, after = points[i - 1][0], points[(i + 1) % n][0]
        first = (before + ((key - before) & _M32) // 2 + 1) & _M32 if n > 1 else 0
        last = (key + ((after - key) & _M32) // 2) & _M32 if n > 1 else _M32
        if first <= last:
            arcs.append((first, last, name))
        else:
            arcs += [(first, _M32, name), (0, last, name)]
    return arcs


def consistent_buckets(points: list[tuple[int, str]], dead: set[str]) -> dict[int, str]:
    """bucket -> server where a dead arc touches: the live owner of most of it, else the live ring's."""
    shift = 32 - BUCKET_BITS
    live_points = [(k, name) for k, name in points if name not in dead]
    if not live_points or not any(name in dead for _, name in points):
        return {}
    owned: dict[int, dict[str, int]] = {}
    dead_buckets: set[int] = set()
    for first, last, name in _arcs(points):
        for bucket in range(first >> shift, (last >> shift) + 1):
            low, high = max(first, bucket << shift), min(last, ((bucket + 1) << shift) - 1)
            owned.setdefault(bucket, {})
            owned[bucket][name] = owned[bucket].get(name, 0) + high - low + 1
            if name in dead:
                dead_buckets.add(bucket)
    keys = [k for k, _ in live_points]
    result: dict[int, str] = {}
    for bucket in sorted(dead_buckets):
        live = {name: size for name, size in owned[bucket].items() if name not in dead}
        if live:
            result[bucket] = max(sorted(live), key=lambda name: live[name])
        else:
            result[bucket] = lookup(live_points, keys, (bucket << shift) + (1 << (shift - 1)))
    return result


def lookup(points: list[tuple[int, str]], keys: list[int], h: int) -> str:
    """The server chash_get_server_hash() picks for hash `h` (no `avoid`, no balance factor)."""
    j = bisect.bisect_left(keys, h)
    after, before = points[j % len(points)], points[j - 1]
    return before[1] if ((h - before[0]) & _M32) <= ((after[0] - h) & _M32) else after[1]
