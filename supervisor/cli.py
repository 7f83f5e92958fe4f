"""Command line: `run`, `check`, `render`, `status`. Exit 0 ok, 1 failure, 2 bad settings."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from . import __version__
from .binary import require_executable, with_resolved_binary
from .effective import RenderedConfigError, check_effective, load_effective, prepare_runtime_dir, write_slot_table
from .files import WriterBusy
from .settings import Settings, SettingsError, load_settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="haproxy-supervisor", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("run", "run the daemon in the foreground (systemd starts this)"),
        ("check", "render and validate the effective config with `haproxy -c`"),
        ("render", "print the effective config (rendered config + injections)"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--config", required=True, metavar="FILE", help="settings YAML")
    text = "show a running daemon's status (GET /status) as a table, or as JSON"
    p = sub.add_parser("status", help=text, description=text)
    p.add_argument("--url", metavar="URL", help="http://host:port or unix:/path (default: from --config, "
                   "else http://127.0.0.1:9180)")
    p.add_argument("--config", metavar="FILE", help="settings YAML: the URL comes from status.listen")
    p.add_argument("--json", action="store_true", help="print the raw /status JSON")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="give up after this long")
    return parser


def cmd_check(settings: Settings) -> int:
    effective = load_effective(settings)
    try:
        prepare_runtime_dir(settings)
        write_slot_table(effective.slot_table)
    except OSError as exc:
        print(f"haproxy-supervisor: {settings.haproxy.runtime_dir}: cannot prepare runtime_dir: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    h = settings.haproxy
    ok, message = asyncio.run(check_effective(h, effective))
    if ok:
        print(f"{h.config}: effective config is valid")
        return EXIT_OK
    print(f"{h.config}: effective config is invalid:\n{message}", file=sys.stderr)
    return EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    """GET /status from `--url`, else from `status.listen` of `--config`, else DEFAULT_URL."""
    from .statusclient import DEFAULT_URL, StatusFetchError, fetch_status, format_status, url_from_listen

    url = args.url
    if url is None and args.config is not None:
        url = url_from_listen(load_settings(args.config).status.listen)
    url = url or DEFAULT_URL
    try:
        document = asyncio.run(fetch_status(url, args.timeout))
    except StatusFetchError as exc:
        print(f"haproxy-supervisor: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return EXIT_OK
    try:
        sys.stdout.write(format_status(document))
    except (KeyError, TypeError, AttributeError) as exc:
        print(f"haproxy-supervisor: {url}: unexpected /status document (missing {exc}); try --json",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "status":
            return cmd_status(args)
        settings = with_resolved_binary(load_settings(args.config))
        if args.command == "render":
            sys.stdout.write(load_effective(settings).text)
            return EXIT_OK
        require_executable(settings)
        if args.command == "check":
            return cmd_check(settings)
        from .daemon import run_daemon

        return run_daemon(settings)
    except SettingsError as exc:
        print(f"haproxy-supervisor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RenderedConfigError as exc:
        print(f"haproxy-supervisor: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except WriterBusy as exc:
        print(f"haproxy-supervisor: {exc}: try again once it is written", file=sys.stderr)
        return EXIT_FAILED
