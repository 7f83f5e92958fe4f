"""The bytes haproxytech's kubernetes-ingress controller writes to HAProxy's sockets.

Derived by reading its code, not copied from it:
- haproxytech/kubernetes-ingress pkg/haproxy/api/runtime.go (commit 1250866516278ae6770006576960b719acbb8306):
  SyncBackendSrvs makes, per changed slot, a disable (IP 127.0.0.1, port 0, state maint) or an
  enable (the endpoint's IP and port, state ready); SetServerAddrAndState writes each as
  `set server B/S addr IP[ port P];set server B/S state S;` (the port only when > 0), all of a
  backend's slots on one line (cut at BufferSize), and runRaw takes an answer starting
  `[0]:`..`[3]:` after its first byte as a failure.
  SetMapContent: `prepare map`, then `add map @<ver> <path> <<\\n<payload>\\n` per chunk, then `commit map`.
- haproxytech/client-native runtime/runtime_single_client.go (commit 01819906e4b355780c9857cc94f1656b0955fe4e):
  every command goes on a fresh unix connection as `set severity-output number;<command>\\n`, and the
  answer is read until EOF.
- The issue (#23) quotes the disable with `port 1`, as other releases send it.
"""

from __future__ import annotations

PREFIX = b"set severity-output number;"


def wrap(command: bytes) -> bytes:
    """The line client-native writes for one command (a worker socket, not the master)."""
    return PREFIX + command + b"\n"


def disable(backend: str, server: str, port: int = 0) -> bytes:
    addr = f"set server {backend}/{server} addr 127.0.0.1" + (f" port {port}" if port > 0 else "")
    return f"{addr};set server {backend}/{server} state maint;".encode()


def enable(backend: str, server: str, ip: str, port: int) -> bytes:
    return f"set server {backend}/{server} addr {ip} port {port};set server {backend}/{server} state ready;".encode()


def sync_line(*slots: bytes) -> bytes:
    """One SyncBackendSrvs line: the slots' pairs, one after the other."""
    return wrap(b"".join(slots))


def add_map_payload(version: str, path: str, payload: str) -> bytes:
    return wrap(f"add map @{version} {path} <<\n{payload}\n".encode())
