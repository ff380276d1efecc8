"""The `mooncake` tier (plugins/kv_mooncake) against a real Mooncake master on loopback.

`mooncake_master` (from the mooncake-transfer-engine-non-cuda wheel, which loads Debian's
libibverbs1 and librdmacm1; the README's test command installs all three) runs with its own
HTTP metadata server on free ports; the tier is a real store client over TCP.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from redis_server import _free_port
from tcp_proxy import TCPProxy
from test_kv_tiers import CODEC, LAYOUT, obj
from test_offload_engine import BS, GREEDY, NUM_SESSIONS, replay, session_turns, tight

try:
    import mooncake.store  # noqa: F401
except ImportError as e:  # a failure, not a skip: the README's test command installs it
    raise ImportError(f"Mooncake's store does not load ({e}): pip install -e "
                      "'plugins/kv_mooncake[store]'; apt-get install libibverbs1 librdmacm1") from e

from tokenmill.kv_connector.registry import make_tier, tier_context  # noqa: E402
from tokenmill.platforms.kv_tier import TierUnavailableError  # noqa: E402


class MooncakeMaster:
    def __init__(self, workdir: Path) -> None:
        import mooncake

        # the wheel's script lands in the bin/ of the environment it was installed into
        candidates = [shutil.which("mooncake_master"), Path(sys.executable).with_name("mooncake_master"),
                      Path(mooncake.__file__).resolve().parents[4] / "bin" / "mooncake_master"]
        binary = next((Path(c) for c in candidates if c and Path(c).exists()), None)
        if binary is None:
            pytest.fail("mooncake_master is missing: pip install mooncake-transfer-engine-non-cuda")
        self.rpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.log = (workdir / "mooncake_master.log").open("w")
        self.proc = subprocess.Popen(
            [str(binary), f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
             "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
             f"-http_metadata_server_port={self.http_port}", f"-metrics_port={self.metrics_port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        # ready when both its metadata server answers and its RPC port accepts: the two
        # come up separately, and a client (or the proxy) that connects between them fails
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{self.http_port}/metadata?key=probe", timeout=1)
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=1).close()
                break
            except (httpx.HTTPError, OSError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"mooncake_master did not start: see {self.log.name}") from None
                time.sleep(0.1)

    @property
    def url(self) -> str:
        return self.url_via(self.rpc_port)

    def url_via(self, rpc_port: int) -> str:
        """The tier's URL with the master's RPC reached at `rpc_port` (a proxy's)."""
        return (f"mooncake://127.0.0.1:{rpc_port}?metadata=http://127.0.0.1:"
                f"{self.http_port}/metadata&segment=64MiB&buffer=16MiB")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def master(tmp_path):
    m = MooncakeMaster(tmp_path)
    yield m
    m.kill()


@pytest.fixture
def proxy(master):
    """A TCP proxy in front of the master's RPC port, whose connections a test can drop."""
    p = TCPProxy(master.rpc_port)
    yield p
    p.close()


def test_tier_stores_checks_and_lists_objects(master):
    tier = make_tier("mooncake", {"url": master.url}, tier_context(LAYOUT, lambda: None))
    try:
        objects = [obj(i) for i in range(5)]
        assert tier.contains_many([k for k, _ in objects]) == [False] * 5
        assert all(tier.put(k, d) for k, d in objects)
        assert not tier.put(*objects[0])  # held: nothing shipped again
        assert tier.contains_many([k for k, _ in objects] + [obj(9)[0]]) == [True] * 5 + [False]
        for k, d in objects:
            assert bytes(CODEC.decode(k, tier.get(k))) == d[len(d) - LAYOUT.payload_bytes:]
        assert tier.get(obj(9)[0]) is None
        assert set(tier.keys()) == {k for k, _ in objects}
        assert tier.used_bytes() == sum(len(d) for _, d in objects)
    finally:
        tier.close()
    with pytest.raises(ValueError, match="unknown options"):
        make_tier("mooncake", {"url": master.url + "&colour=red"}, tier_context(LAYOUT, lambda: None))


def test_dropped_connections_are_tried_again_a_dead_master_is_not(master, proxy):
    """Every pooled connection to the master drops (the proxy resets them): the calls
    that meet a dead connection are tried again and succeed, the tier stays up. Then the
    master dies: the call fails, and the tier is skipped without waiting on it."""
    tier = make_tier("mooncake", {"url": master.url_via(proxy.port)}, tier_context(LAYOUT, lambda: None))
    try:
        objects = [obj(i) for i in range(10)]
        assert all(tier.put(k, d) for k, d in objects[:5])
        proxy.reset()
        assert all(tier.put(k, d) for k, d in objects[5:])
        assert tier.contains_many([k for k, _ in objects]) == [True] * 10
        assert tier.num_rpc_retries >= 1  # the dead connections were met, and routed around
        proxy.reset()  # a get that meets a dead connection reads b"", as a missing object
        retries = tier.num_rpc_retries
        for k, d in objects:
            assert bytes(CODEC.decode(k, tier.get(k))) == d[len(d) - LAYOUT.payload_bytes:]
        assert tier.num_rpc_retries > retries
        assert tier.get(obj(12)[0]) is None  # not held: no retry, no error
        master.kill()
        start = time.monotonic()
        with pytest.raises(TierUnavailableError, match="code -900"):
            tier.put(*obj(11))
        with pytest.raises(TierUnavailableError, match="down"):
            tier.contains_many([objects[0][0]])
        assert time.monotonic() - start < 15  # the pool's reconnects, once, not per call
    finally:
        tier.close()


def test_a_put_whose_end_was_lost_is_stored_all_the_same(master, proxy, capfd):
    """Links drop every few milliseconds while objects are put: some puts lose their
    PutEnd (the store logs "Failed to end put operation"), which leaves the key reserved
    and unreadable, and a plain second put reports success without storing. Every put
    the tier reports stored is readable all the same (it retries as an upsert)."""
    tier = make_tier("mooncake", {"url": master.url_via(proxy.port)}, tier_context(LAYOUT, lambda: None))
    stop = threading.Event()

    def drop_links() -> None:
        while not stop.wait(0.005):
            proxy.reset()

    dropper = threading.Thread(target=drop_links)
    dropper.start()
    stored, log, lost_ends = [], "", 0
    try:
        for i in range(3000):  # until a few PutEnds were lost (about 1 put in 100)
            k, d = obj(100 + i)
            try:
                if tier.put(k, d):
                    stored.append((k, d))
            except TierUnavailableError:  # every attempt met a dead link: not stored
                tier._down_until = 0.0  # noqa: SLF001 (no waiting out the back-off here)
            if i % 100 == 99:
                log += capfd.readouterr().err
                lost_ends = log.count("Failed to end put operation")
                if lost_ends >= 3:
                    break
    finally:
        stop.set()
        dropper.join()
    try:
        assert lost_ends >= 1, "no put lost its end: the case was not met"
        assert tier.contains_many([k for k, _ in stored]) == [True] * len(stored)
        for k, d in stored[-50:]:
            assert bytes(CODEC.decode(k, tier.get(k))) == d[len(d) - LAYOUT.payload_bytes:]
    finally:
        tier.close()


def test_sessions_load_from_mooncake_and_survive_its_loss(tiny_dirs, master, proxy):
    """3 sessions x 3 turns on a pool of one session, Mooncake the only tier: identical
    greedy output and later turns computing only their new tokens, even though every
    connection to the master drops after the first turns; with the master killed the
    rest still gives identical output (recomputed)."""
    from test_offload_engine import make_llm

    reference = replay(make_llm(tiny_dirs["llama"], num_kv_blocks=1024))
    llm = tight(tiny_dirs["llama"], kv_offload_remote=master.url_via(proxy.port))
    turns = list(session_turns())
    records = replay(llm, turns[:NUM_SESSIONS])
    history = {r["session"]: r["prompt"] + r["output"] for r in records}
    proxy.reset()  # the link to the master drops between turns
    for s, turn, user in turns[NUM_SESSIONS : 2 * NUM_SESSIONS]:
        prompt = history[s] + user
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference[turn * NUM_SESSIONS + s]["output"]
        new = len(prompt) - (len(history[s]) - 1)  # the last sampled token was never fed
        computed = len(prompt) - out.num_cached_tokens
        assert computed <= new + BS, (s, turn, computed, new)
        history[s] = prompt + out.outputs[0].token_ids
    tier = llm.engine.offload.stack.tier("mooncake")
    stats = llm.engine.offload.stack.stats["mooncake"]
    assert stats.tokens_loaded > 0 and stats.bytes_written > 0
    assert stats.errors == 0 and tier.num_rpc_retries >= 1
    master.kill()
    for s, turn, user in turns[2 * NUM_SESSIONS :]:
        out = llm.generate({"prompt_token_ids": history[s] + user}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference[turn * NUM_SESSIONS + s]["output"]
    assert stats.errors > 0  # the calls after the kill failed, and were routed around
    llm.engine.shutdown()


def test_unreachable_tier_raises_tier_unavailable(master):
    tier = make_tier("mooncake", {"url": master.url}, tier_context(LAYOUT, lambda: None))
    try:
        tier._down_until = time.monotonic() + 60  # as after a failed call
        with pytest.raises(TierUnavailableError, match="down"):
            tier.contains_many([obj(0)[0]])
    finally:
        tier.close()
