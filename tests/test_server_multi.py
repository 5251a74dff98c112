"""``aiospec serve --api-servers N``: N server processes on one port and one engine's rings."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
import urllib.request
from typing import Any

import numpy as np
import openai
import pytest

import shm
from aiospec._codec import decode_frame, encode_frame
from aiospec._routing import Router
from aiospec.engine import HandleAllocator
from aiospec.engine._client import SERVER_SHIFT, server_of
from aiospec.server import ServerProcess

pytestmark = pytest.mark.timeout(240)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def _stream(url: str, seed: int, max_tokens: int) -> tuple[str, list[float], int]:
    """One streaming chat on a connection of its own: its text, logprobs and token count."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        s = client.chat.completions.create(
            model="aiospec-toy", messages=[{"role": "user", "content": "tell me"}], max_tokens=max_tokens,
            stream=True, logprobs=True, top_logprobs=3, seed=seed, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, lps = [], []
        for ch in s:
            if not ch.choices:
                continue
            c = ch.choices[0]
            text.append(c.delta.content or "")
            if c.logprobs and c.logprobs.content:
                lps += [t.logprob for t in c.logprobs.content]
                assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
        return "".join(text), lps, len(lps)
    finally:
        client.close()


# -- handles and the per-server routing ----------------------------------------------------------


def test_handles_carry_the_server_index_and_routers_skip_other_servers_rows() -> None:
    allocs = [HandleAllocator(i) for i in range(3)]
    hs = [a.acquire() for a in allocs for _ in range(4)]
    assert [server_of(h) for h in hs] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(0 <= h < 1 << 63 for h in hs)
    with pytest.raises(ValueError, match=rf"^handle = {hs[4]:#x}: not an acquired handle$"):
        allocs[0].release(hs[4])  # another server's handle
    with pytest.raises(ValueError, match=r"^server = 128: expected an int in 0\.\.127$"):
        HandleAllocator(128)
    # a frame with the servers' rows interleaved: each router routes exactly its own
    order = [hs[i] for i in (0, 4, 8, 1, 5, 9, 2)]
    counts = np.array([1, 2, 3, 1, 2, 3, 2])
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    f = decode_frame(encode_frame(np.array(order, np.uint64), offs, np.arange(int(offs[-1]), dtype=np.int32)))
    for server in range(3):
        r = Router((SERVER_SHIFT, server))
        units = r.plan([f, f])
        got = {h: [] for h in order if server_of(h) == server}
        for u in units:
            for i, h in enumerate(u.handles):
                a, b = u.roffs[u.groups[i]], u.roffs[u.groups[i + 1]]
                got[h] += u.src.token_ids[a:b].tolist()
        want = {
            h: 2 * list(range(int(offs[j]), int(offs[j + 1]))) for j, h in enumerate(order) if server_of(h) == server
        }
        assert got == want
        assert r.records_skipped == 2 * sum(1 for h in order if server_of(h) != server)


# -- N server processes --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("path", "pd"), [("ring", False), ("vllm", False), ("ring", True)], ids=["ring", "vllm", "pd"])
def test_openai_clients_spread_over_three_servers(path: str, pd: bool) -> None:
    args = ["--api-servers", "3", "--token-path", path, "--max-batch", "128", "--step-ms", "5"]
    srv = ServerProcess(args + (["--pd"] if pd else []))
    srv.start(timeout=180)
    try:
        with concurrent.futures.ThreadPoolExecutor(24) as ex:
            # every seed twice, on connections of their own: the kernel spreads them over the servers
            futs = [ex.submit(_stream, srv.url, 1 + i % 12, 24) for i in range(36)]
            results = [f.result() for f in futs]
        by_seed: dict[int, set[tuple[str, tuple[float, ...]]]] = {}
        for i, (text, lps, n) in enumerate(results):
            assert n == 24 and text, (i, n)
            by_seed.setdefault(1 + i % 12, set()).add((text, tuple(lps)))
        # the same seed gives the same tokens and logprobs whichever server routed them: no
        # server received rows of another server's request; under PD the first token (from the
        # prefill engine's ring) comes first even when the decode ring was read before it
        assert all(len(v) == 1 for v in by_seed.values()), by_seed
        assert len({next(iter(v))[0] for v in by_seed.values()}) > 1
        time.sleep(0.6)  # every process shares its figures every 0.25 s
        stats = _get(srv.url + "/stats")
        servers = stats["servers"]
        assert [s["index"] for s in servers] == [0, 1, 2] and all(s["alive"] for s in servers)
        assert len({s["pid"] for s in servers}) == 3 and srv.pid not in {s["pid"] for s in servers}
        assert all(s["tokens"] > 0 for s in servers), servers  # each server streamed some
        assert sum(s["tokens"] for s in servers) == 36 * 24
        # /metrics, whichever process answers, reports the whole server
        for _ in range(4):
            m = _get(srv.url + "/metrics")
            assert re.search(r"^aiospec_tokens_total 864$", m, re.M), m
            assert re.search(r'^aiospec_requests_total\{endpoint="chat",status="200"\} 36$', m, re.M)
            assert re.search(r'^aiospec_requests_finished_total\{endpoint="chat",finish_reason="length"\} 36$', m, re.M)
            assert re.search(r"^aiospec_time_to_first_token_seconds_count 36$", m, re.M)
            assert re.search(r"^aiospec_engine_up 1$", m, re.M)
            if path == "ring":
                lags = re.findall(r'^aiospec_ring_lag_bytes\{ring="[^"]+",server="\d"\}', m, re.M)
                assert len(lags) == 3 * (2 if pd else 1), m  # each server reads each ring
                assert re.search(r"^aiospec_hub_records_routed_total (\d+)$", m, re.M)
        if path == "ring":
            assert len(stats["hub"]["rings"]) == (2 if pd else 1) and len(stats["engine_pids"]) == len(
                stats["hub"]["rings"]
            )
            for info in stats["hub"]["rings"]:
                r = shm.Ring.attach(info["name"])
                try:
                    assert sum(1 for x in r.stats().readers if x.state == "active") == 3
                finally:
                    r.close()
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_a_killed_server_process_is_aborted_in_the_engine_and_the_others_go_on() -> None:
    srv = ServerProcess(["--api-servers", "3", "--max-batch", "256", "--step-ms", "5", "--num-draft", "0"])
    srv.start(timeout=180)
    try:
        stats = _get(srv.url + "/stats")
        victim = next(s for s in stats["servers"] if s["index"] == 0)
        ring = stats["hub"]["rings"][0]["name"]
        with concurrent.futures.ThreadPoolExecutor(30) as ex:
            # long streams (about 4 s each), 30 connections: some are served by server 0
            futs = [ex.submit(_stream, srv.url, 100 + i, 800) for i in range(30)]

            def all_admitted() -> bool:
                st = _get(srv.url + "/stats")
                v = next(s for s in st["servers"] if s["index"] == 0)
                return bool(st["engines"][0]["admitted"] == 30 and v["streams_open"] > 0)

            # every request reached the engine, and server 0 (its figures are shared every 0.25 s) has some
            _wait(all_admitted, 60, "30 requests admitted, some by server 0")
            os.kill(victim["pid"], signal.SIGKILL)
            done = [f.exception() or f.result() for f in futs]
        failed = [d for d in done if isinstance(d, BaseException)]
        ok = [d for d in done if not isinstance(d, BaseException)]
        assert failed and ok, (len(failed), len(ok))
        assert all(isinstance(e, openai.APIError) for e in failed), failed  # the connection dropped
        assert all(n == 800 for _, _, n in ok)  # the other servers' streams complete in full
        # the engine learnt at once: the dead server's requests are aborted (nothing decodes
        # for nobody), and its reader slot is free again
        eng = _get(srv.url + "/stats")["engines"][0]
        assert eng["running"] == 0 and eng["waiting"] == 0, eng
        # every request ends in the engine finished or aborted; a request of the dead server
        # that the engine finished just before the kill cannot be aborted (its client missed
        # only the last chunks), every other one of its requests is
        assert eng["finished"] + eng["aborted"] == 30 and eng["finished"] >= len(ok), eng
        assert eng["aborted"] >= len(failed) - (eng["finished"] - len(ok)), eng
        r = shm.Ring.attach(ring)
        try:
            _wait(lambda: sum(1 for x in r.stats().readers if x.state == "active") == 2, 10, "2 active readers")
            assert victim["pid"] not in {x.pid for x in r.stats().readers if x.state == "active"}
        finally:
            r.close()
        # new connections only reach the live servers
        for i in range(6):
            assert _stream(srv.url, 7 + i, 8)[2] == 8
        servers = _get(srv.url + "/stats")["servers"]
        assert [s["alive"] for s in sorted(servers, key=lambda s: s["index"])] == [False, True, True]
        assert _get(srv.url + "/health") == "ok"
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_a_stopped_server_process_is_killed_by_the_parent_and_the_others_go_on() -> None:
    # a server that stops making progress (SIGSTOP here) would hold the engine's ring (its
    # reader releases nothing) and keep taking new connections: the parent kills it once its
    # heartbeat is older than --api-server-timeout
    srv = ServerProcess(["--api-servers", "2", "--max-batch", "64", "--step-ms", "5", "--num-draft", "0",
                         "--api-server-timeout", "2"])  # fmt: skip
    srv.start(timeout=180)
    try:
        stats = _get(srv.url + "/stats")
        victim = next(s for s in stats["servers"] if s["index"] == 0)
        ring = stats["hub"]["rings"][0]["name"]
        with concurrent.futures.ThreadPoolExecutor(12) as ex:
            futs = [ex.submit(_stream, srv.url, 300 + i, 1200) for i in range(12)]

            def both_serve() -> bool:
                st = _get(srv.url + "/stats")
                return bool(st["engines"][0]["admitted"] == 12 and all(s["streams_open"] > 0 for s in st["servers"]))

            _wait(both_serve, 60, "12 requests admitted, some by each server")
            os.kill(victim["pid"], signal.SIGSTOP)
            t0 = time.monotonic()
            _wait(lambda: not _alive(victim["pid"]), 30, "the stopped server killed")
            killed_after = time.monotonic() - t0
            done = [f.exception() or f.result() for f in futs]
        assert 2.0 <= killed_after < 15.0, killed_after
        failed = [d for d in done if isinstance(d, BaseException)]
        ok = [d for d in done if not isinstance(d, BaseException)]
        assert failed and ok, (len(failed), len(ok))
        assert all(isinstance(e, openai.APIError) for e in failed), failed  # the connection dropped
        assert all(n == 1200 for _, _, n in ok)  # the other server's streams complete in full
        eng = _get(srv.url + "/stats")["engines"][0]
        assert eng["running"] == 0 and eng["aborted"] >= len(failed), eng
        r = shm.Ring.attach(ring)
        try:
            assert victim["pid"] not in {x.pid for x in r.stats().readers if x.state == "active"}
        finally:
            r.close()
        for i in range(6):  # new connections reach the live server only
            assert _stream(srv.url, 7 + i, 8)[2] == 8
        servers = _get(srv.url + "/stats")["servers"]
        assert [s["alive"] for s in sorted(servers, key=lambda s: s["index"])] == [False, True]
        assert _get(srv.url + "/health") == "ok"
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_engine_restart_reaches_every_server_and_sigterm_stops_all() -> None:
    srv = ServerProcess(["--api-servers", "2", "--max-batch", "64", "--step-ms", "5", "--restart-backoff", "0.2"])
    srv.start(timeout=180)
    try:
        stats = _get(srv.url + "/stats")
        engine, ring = stats["engine_pids"][0], stats["hub"]["rings"][0]["name"]
        servers = [s["pid"] for s in stats["servers"]]
        os.kill(engine, signal.SIGKILL)

        def new_engine() -> bool:
            try:
                st = _get(srv.url + "/stats")
            except OSError:
                return False
            return st["engine_state"] == "up" and st["engine_pids"] != [engine]

        _wait(new_engine, 60, "a new engine")

        # both servers read the new ring: requests on many connections all complete
        def healthy() -> bool:
            try:
                return bool(_get(srv.url + "/health") == "ok")
            except OSError:  # 503 from a server whose engine link is not up again yet
                return False

        for _ in range(8):  # on several connections: every server is up again
            _wait(healthy, 30, "health ok")
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            assert [n for _, _, n in ex.map(lambda i: _stream(srv.url, i + 1, 8), range(16))] == [8] * 16
        st = _get(srv.url + "/stats")
        new_ring = st["hub"]["rings"][-1]["name"]
        assert new_ring != ring and not os.path.exists(os.path.join(shm.SHM_DIR, ring))
        r = shm.Ring.attach(new_ring)
        try:
            assert sum(1 for x in r.stats().readers if x.state == "active") == 2
        finally:
            r.close()
        new_engines = st["engine_pids"]
        m = _get(srv.url + "/metrics")
        assert re.search(r"^aiospec_engine_restarts_total [1-9]", m, re.M), m
        # SIGTERM to the parent ends everything it started
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        for pid in [*servers, *new_engines]:
            _wait(lambda pid=pid: not _alive(pid), 10, f"pid {pid} gone")
        assert not os.path.exists(os.path.join(shm.SHM_DIR, new_ring))
    finally:
        srv.stop()


def test_a_killed_parent_leaves_no_directory_behind() -> None:
    # SIGKILL of the parent: no clean-up of its own, so its servers (which stop when it is
    # gone) remove its directory of heartbeats, shared metrics and engine sockets
    srv = ServerProcess(["--api-servers", "2", "--max-batch", "16"])
    srv.start(timeout=180)
    try:
        stats = _get(srv.url + "/stats")
        servers = [s["pid"] for s in stats["servers"]]
        with open(f"/proc/{servers[0]}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        run_dir = os.path.dirname(argv[argv.index("--heartbeat-file") + 1])
        assert os.path.basename(run_dir).startswith("aiospec-serve-") and os.path.isdir(run_dir)
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
        for pid in [*servers, *stats["engine_pids"]]:
            _wait(lambda pid=pid: not _alive(pid), 30, f"pid {pid} gone")
        _wait(lambda: not os.path.exists(run_dir), 10, f"{run_dir} removed")
    finally:
        srv.stop()


def test_api_servers_argument_is_checked() -> None:
    import subprocess
    import sys

    for argv, msg in (
        (["--api-servers", "0"], "--api-servers = 0: expected 1..16"),
        (["--api-servers", "17"], "--api-servers = 17: expected 1..16"),
        (["--api-servers", "2", "--token-path", "fastdeploy", "--raise-msg-limits"],
         "--api-servers = 2: several API servers take --token-path ring or vllm"),
    ):  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "aiospec.cli", "serve", *argv], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert r.returncode == 2 and msg in r.stderr, (argv, r.stderr)


@pytest.mark.slow
def test_demo_takes_api_servers(tmp_path: Any) -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "aiospec.cli", "demo", "--once", "--api-servers", "2", "-n", "8", "-c", "4",
         "--max-tokens", "4"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 API server processes" in " ".join(r.stdout.split()), r.stdout


def test_metrics_share_sums_counters_over_every_process_and_gauges_over_live_ones(tmp_path: Any) -> None:
    import msgspec

    from aiospec.server._metrics import Metrics, MetricsShare

    def extra(cpu: float, lag: int) -> list[Any]:
        return [("process_cpu_seconds_total", "counter", "CPU time of the server process.", cpu, None),
                ("aiospec_hub_records_routed_total", "counter", "Records routed to streams.", 10, None),
                ("aiospec_ring_lag_bytes", "gauge", "Bytes.", lag, {"ring": "r"})]  # fmt: skip

    ms = [Metrics() for _ in range(3)]
    shares = [MetricsShare(str(tmp_path), i, m, lambda i=i: extra(1.0 + i, 100 * i)) for i, m in enumerate(ms)]
    for i, m in enumerate(ms):
        m.tokens, m.streams_open = 100 * (i + 1), i + 1
        m.request_done("chat", 200)
        m.ttft.observe(0.01 * (i + 1))
        shares[i].write()
    # server 2 died: its counters still count, its gauges no longer do
    path = tmp_path / "server-2.msgpack"
    snap = msgspec.msgpack.decode(path.read_bytes())
    snap["pid"] = 2**22 + 12345  # no such process
    path.write_bytes(msgspec.msgpack.encode(snap))
    text = ms[0].render([*extra(1.0, 0), ("aiospec_engine_up", "gauge", "Up.", 1, None)])
    assert re.search(r"^aiospec_tokens_total 600$", text, re.M), text
    assert re.search(r'^aiospec_requests_total\{endpoint="chat",status="200"\} 3$', text, re.M)
    assert re.search(r"^aiospec_streams_open 3$", text, re.M)  # 1 + 2; the dead server's 3 left out
    assert re.search(r"^aiospec_time_to_first_token_seconds_count 3$", text, re.M)
    assert re.search(r"^process_cpu_seconds_total 6$", text, re.M)  # 1 + 2 + 3
    assert re.search(r"^aiospec_hub_records_routed_total 30$", text, re.M)
    assert re.findall(r'^aiospec_ring_lag_bytes\{ring="r",server="(\d)"\}', text, re.M) == ["0", "1"]
    assert re.findall(r"^aiospec_engine_up (\d)$", text, re.M) == ["1"]  # the engines' figures: not summed
    assert [(s["index"], s["alive"]) for s in shares[1].servers()] == [(0, True), (1, True), (2, False)]
    # a reset asked of one process reaches the others
    ms[1].loop_lag._n = 5
    ms[0].loop_lag.reset()
    assert shares[1]._reset_epoch() != shares[1]._reset_seen


def test_loop_lag_summary_is_numpys_percentile_to_the_bins_and_the_max_exact() -> None:
    from aiospec.server._metrics import LoopLag

    rng = np.random.default_rng(7)
    lag = LoopLag()
    assert lag.summary() == {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    # mostly short oversleeps, a tail past 100 ms (the coarse bins), one past the last bin
    x = np.concatenate([rng.exponential(0.002, 5000), rng.uniform(0.05, 0.3, 60), [12.5]])
    for v in x:
        lag.observe(float(v))
    s = lag.summary()
    p50, p99 = np.percentile(x * 1e3, (50, 99))
    assert s["n"] == len(x) and s["max_ms"] == pytest.approx(12_500.0)
    assert abs(s["p50_ms"] - p50) <= 0.005  # half a 10 us bin
    assert abs(s["p99_ms"] - p99) <= 0.5  # half a 1 ms bin (p99 falls in the tail)
    assert lag.hist.count == len(x)  # the Prometheus histogram sees every tick too
    lag.observe(0.0042)  # one tick more: the summary follows
    assert lag.summary()["n"] == len(x) + 1
    lag.reset(everywhere=False)
    lag.observe(0.0042)
    assert lag.summary() == {"n": 1, "p50_ms": 4.2, "p99_ms": 4.2, "max_ms": 4.2}  # at most the max


def test_metrics_share_writes_its_file_off_the_event_loop(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file write that waits (a disk's write-back) does not hold the event loop: the
    periodic snapshot is written by a thread while a 5 ms ticker keeps its pace."""
    import asyncio

    import msgspec

    from aiospec.server._metrics import Metrics, MetricsShare

    m = Metrics()
    share = MetricsShare(str(tmp_path), 0, m, lambda: [], interval=0.01)
    replace = os.replace

    def slow_replace(a: str, b: str) -> None:
        time.sleep(0.15)  # the disk
        replace(a, b)

    monkeypatch.setattr(os, "replace", slow_replace)

    async def main() -> float:
        share._task = asyncio.get_running_loop().create_task(share._run())
        m.tokens = 7
        worst, t = 0.0, time.perf_counter()
        for _ in range(60):
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            worst, t = max(worst, now - t), now
        await share.stop()
        return worst

    worst = asyncio.run(main())
    assert worst < 0.1, worst  # a write on the loop would hold it 150 ms
    assert msgspec.msgpack.decode((tmp_path / "server-0.msgpack").read_bytes())["tokens"] == 7


def test_the_server_processes_share_a_directory_on_tmpfs_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiospec.server import _multi

    expected = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else None
    assert _multi._runtime_dir() == expected
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    assert _multi._runtime_dir() is None  # the default temporary directory then
