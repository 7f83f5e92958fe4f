"""bench/ray_drain.py's own logic: the nftables rules of a vanished node, and its per-app counts."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from bench.drain import Answer, Result
from bench.ray_drain import by_app, drop_rules


def test_drop_rules_drop_both_ways_and_nft_accepts_them():
    rules = drop_rules({30001, 6379})
    assert "elements = { 6379, 30001 }" in rules
    assert rules.count("tcp dport @gone drop; tcp sport @gone drop;") == 2
    nft = shutil.which("nft") or "/usr/sbin/nft"
    if not shutil.which(nft):
        pytest.skip("nftables is not installed: `make ray-serve` installs it")
    # -c: checked only, nothing applied.
    check = subprocess.run([nft, "-c", "-f", "-"], input=rules.encode(), capture_output=True, check=False)
    assert check.returncode == 0, check.stderr.decode()


def test_by_app_counts_failed_with_their_statuses_and_slow():
    result = Result("stock", [Answer("wide", 200, 5.0), Answer("moved", 500, 0.01), Answer("moved", 200, 1.0)])
    assert by_app(result) == "wide failed 0 slow 1, moved failed 1 [500] slow 1"
