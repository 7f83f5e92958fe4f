"""Parse + render (and inject) a rendered config of 10,000 servers.

Target (issue 2): parse plus render under 200 ms on the 2-core CI machine.
Reports the median and p90 of repeated runs, in milliseconds.
"""

from __future__ import annotations

import statistics
import time

from bench._doc import markdown_table
from bench.displaced_push import rendered
from supervisor.effective import build_effective, effective_config_and_table
from supervisor.haproxy.config import Config
from supervisor.haproxy.lexer import ConfigCache
from supervisor.settings import ObserveSettings, OldWorkerSettings, Settings


def synthetic_config(servers: int, per_backend: int = 10) -> str:
    """A Ray-Serve-shaped config: one backend per app, `check` primaries and a backup each."""
    lines = [
        "global\n    close-spread-time 60s\n",
        "defaults\n    mode http\n    timeout connect 1s\n    timeout client 30s\n    timeout server 30s\n",
        "frontend http_frontend\n    bind 127.0.0.1:18080\n",
    ]
    apps = servers // per_backend
    for app in range(apps):
        lines.append(f"    use_backend app{app} if {{ path_beg /app{app}/ }}\n")
    for app in range(apps):
        lines.append(f"\nbackend app{app}\n    balance leastconn\n")
        for r in range(per_backend):
            port = 20000 + (app * per_backend + r) % 40000
            lines.append(f"    server app{app}_r{r} 127.0.{app % 250}.{r + 1}:{port} check inter 2s  # replica {r}\n")
        lines.append(f"    server fallback 127.0.0.1:{19000 + app % 1000} backup\n")
    return "".join(lines)


def timed(fn, repeat: int, before=None) -> list[float]:
    samples = []
    for _ in range(repeat):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, int(len(ordered) * 0.9) - 1)]


def report(label: str, samples: list[float]) -> None:
    print(f"{label:<44} median {statistics.median(samples):7.1f} ms   p90 {p90(samples):7.1f} ms   n={len(samples)}")


def measure(repeat: int = 15) -> list[tuple[str, list[float]]]:
    """Each row's label and its samples, milliseconds."""
    text = synthetic_config(10_000)
    # Every warm run after the first reuses the Lines and server flags of the one before, as
    # the daemon does from one rendered config to the next; a cold start (a fresh cache) has
    # none of them.
    kept = ConfigCache()

    def warm(text: str) -> Config:
        kept.new_generation()
        return Config.parse(text, kept)

    full = Settings(observe=ObserveSettings(enabled=True), old_workers=OldWorkerSettings(guard=True))
    # The reloader's step on the displaced-push benchmark's config, with the default settings
    # (guard and server state on, observe off): each run a new rendered config, one line changed.
    shape = rendered(10_000, 18080, {1: 1})
    versions = iter(range(1_000_000))

    def build(cache: ConfigCache) -> None:
        build_effective(Settings(), shape.replace("maxconn 2000", f"maxconn {2000 + next(versions)}"), cache)

    return [
        ("parse + render (10k servers)", timed(lambda: warm(text).render(), repeat)),
        ("parse + servers() (10k servers)", timed(lambda: warm(text).servers(), repeat)),
        (
            "parse + all injections + render (10k)",
            timed(lambda: effective_config_and_table(warm(text), full)[0].render(), repeat),
        ),
        ("cold: parse + servers() (10k)", timed(lambda: Config.parse(text).servers(), repeat)),
        (
            "cold: parse + all injections + render (10k)",
            timed(lambda: effective_config_and_table(Config.parse(text), full)[0].render(), repeat),
        ),
        ("build_effective, a new config each run", timed(lambda: build(kept), repeat)),
        ("cold: build_effective", timed(lambda: build(ConfigCache()), repeat)),
    ]


def section(quick: bool = False) -> str:
    """docs/benchmarks.md's table: median and p90 of 15 runs (3 when quick)."""
    rows = [
        (label, f"{statistics.median(s):.1f}", f"{p90(s):.1f}", len(s)) for label, s in measure(3 if quick else 15)
    ]
    return markdown_table(["10,000 servers", "median ms", "p90 ms", "runs"], rows)


def main() -> None:
    text = synthetic_config(10_000)
    servers = len(Config.parse(text).servers())
    print(f"config: {servers} servers, {len(text.splitlines())} lines, {len(text) // 1024} KiB")
    for label, samples in measure():
        report(label, samples)


if __name__ == "__main__":
    main()
