"""End to end, the daemon and the real HAProxy: a render in the middle of Ray Serve's rebuild
of an app (the app's backend emptied, its frontend's metrics variable taken out) waits for the
next render, which puts both back, instead of being reloaded at once (reload.transient_hold_ms).
Control: with transient_hold_ms 0, the same two writes are two reloads."""

from __future__ import annotations

import asyncio

import pytest

from rigs.daemon import http_get
from rigs.harness import backends, free_port
from tests.test_transient_render import MOVED_REPLICAS, MOVED_VAR, RAY

pytestmark = pytest.mark.haproxy


def ray_shaped(front: int, ports: dict[str, int]) -> str:
    text = RAY.replace("    stats socket /tmp/x/admin.sock mode 666 level admin expose-fd listeners\n", "")
    text = text.replace("bind *:8000", f"bind 127.0.0.1:{front}").replace("timeout connect 5s", "timeout connect 1s")
    timeouts = "    timeout client 10s\n    timeout server 10s\n"
    text = text.replace("    balance leastconn\n", "    balance leastconn\n" + timeouts)
    for name, port in (("wide-Echo-a 127.0.0.1:30002", ports["w1"]), ("wide-Echo-b 127.0.0.1:30004", ports["w2"]),
                       ("moved-Echo-a 127.0.0.1:30001", ports["m1"]), ("moved-Echo-b 127.0.0.1:30003", ports["m2"])):
        text = text.replace(name, f"{name.split()[0]} 127.0.0.1:{port}")
    return text.replace("127.0.0.1:8500", f"127.0.0.1:{ports['fb']}")


def rebuilding(text: str, ports: dict[str, int]) -> str:
    replicas = MOVED_REPLICAS.replace("30001", str(ports["m1"])).replace("30003", str(ports["m2"]))
    assert MOVED_VAR in text and replicas in text
    return text.replace(MOVED_VAR, "").replace(replicas, "")


# Without the hold the rebuild's render is reloaded: `moved` goes to its backup (Ray's fallback
# proxy) until the next render is reloaded too.
@pytest.mark.parametrize(("hold_ms", "reloads", "meanwhile"), [(5000, 0, ("m1", "m2")), (0, 2, ("fb",))])
async def test_a_rebuild_render_undone_by_the_next_is_no_reload(make, hold_ms, reloads, meanwhile):
    front = free_port()
    with backends("w1", "w2", "m1", "m2", "fb") as started:
        ports = {name: b.port for name, b in started.items()}
        whole = ray_shaped(front, ports)
        d = make(whole, {"reload": {"transient_hold_ms": hold_ms, "debounce_ms": 100, "min_interval_ms": 200}})
        d.start()
        await d.wait_generation(1)
        before = d.count(r"reload ok generation=")
        d.write(rebuilding(whole, ports))
        await asyncio.sleep(1.5)  # Ray's next render came 2.4 s later in bench.ray_drain
        status, _, body = await http_get(front, "/moved/")
        assert status == 200 and body.strip() in meanwhile, (status, body)
        d.write(whole)
        await asyncio.sleep(2)
        if reloads:
            await d.wait_log(r"reload ok generation=3")
        else:
            await d.wait_log(r"reload held [0-9.]+s for the next render: http-moved lost every primary server")
        assert d.count(r"reload ok generation=") - before == reloads, d.log()
        status, _, body = await http_get(front, "/moved/")
        assert status == 200 and body.strip() in ("m1", "m2"), (status, body)
