import asyncio
import time

import pytest

from fedrl.credentials import new_secret, node_principal, token_for
from fedrl.patch_store import PatchStoreServer, StoreState
from fedrl.sim.link import LinkProfile, ShapedLink, VirtualLink
from fedrl.store_client import PatchStoreClient


def test_virtual_link_time_is_exact_arithmetic():
    profile = LinkProfile(up_bytes_s=1000.0, down_bytes_s=4000.0, latency_s=0.05)
    assert profile.seconds(500, "up") == 0.05 + 0.5
    assert profile.seconds(2000, "down") == 0.05 + 0.5
    link = VirtualLink(profile)
    asyncio.run(link.send(3000))
    assert link.virtual_s == 3.0 and link.bytes_up == 3000


def test_bad_profile_is_rejected():
    with pytest.raises(ValueError):
        LinkProfile(up_bytes_s=0)


@pytest.mark.parametrize("direction", ["up", "down"])
def test_shaped_link_holds_loopback_transfers_to_its_rate(direction):
    secret = new_secret()
    server = PatchStoreServer(StoreState(secret)).start()
    rate, size = 2_000_000.0, 1_500_000  # 2 MB/s, 0.75 s expected
    data = bytes(size)

    async def go():
        async with PatchStoreClient(server.url, node_principal(1), token_for(secret, node_principal(1))) as c:
            digest = await c.put(data)  # unshaped: only the timed transfer goes through the link
            c.link = ShapedLink(LinkProfile(up_bytes_s=rate, down_bytes_s=rate))
            start = time.perf_counter()
            if direction == "up":
                await c.put(data)
            else:
                await c.get(digest)
            return time.perf_counter() - start

    try:
        elapsed = asyncio.run(go())
    finally:
        server.stop()
    achieved = size / elapsed
    # a shaped link can never beat its rate (one banked chunk aside); load can only slow it, so the
    # lower bound is generous
    assert 0.5 * rate < achieved < 1.1 * rate, f"{achieved / 1e6:.2f} MB/s vs {rate / 1e6:.2f} MB/s"
