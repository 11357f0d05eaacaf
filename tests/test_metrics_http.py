"""The metrics endpoint under hostile input: only GET on /metrics and /, 405 for other methods,
garbage and oversized request lines answered without harming the server, many clients at once,
silent clients that do not block others, and a failing collector answered with 500."""

import http.client
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from ascend_pool.metrics import PoolCollector, start_http_server


class _Boom:
    def __init__(self):
        self.fail = False

    def collect(self):
        if self.fail:
            raise RuntimeError("collector exploded")
        yield GaugeMetricFamily("test_ok", "always 1", value=1)

    def describe(self):
        return []


@pytest.fixture
def server(pool):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(pools=lambda: [pool]))
    boom = _Boom()
    registry.register(boom)
    pool.malloc(1 << 20)
    srv = start_http_server(0, registry=registry)
    srv.boom = boom
    yield srv
    srv.close()


def _request(port, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def _raw(port, data, read=True):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        if not read:
            return b""
        s.shutdown(socket.SHUT_WR)  # no more requests: the server closes after answering
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)


def _status(raw):
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else None


def _assert_alive(port):
    status, headers, body = _request(port, "GET", "/metrics")
    assert status == 200
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "ascend_pool_reserved_bytes" in names


def test_get_metrics_and_index(server):
    status, headers, body = _request(server.port, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    from ascend_pool.metrics.node import node_name

    got = {(s.name, frozenset(s.labels.items())): s.value
           for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    key = frozenset({"device": "0", "pool": "large", "tenant": "default", "node": node_name()}.items())
    assert got[("ascend_pool_requested_bytes", key)] == 1 << 20
    status, _, body = _request(server.port, "GET", "/metrics?x=1")
    assert status == 200
    status, headers, body = _request(server.port, "GET", "/")
    assert status == 200 and b'href="/metrics"' in body and headers["Content-Type"].startswith("text/html")
    assert _request(server.port, "GET", "/nope")[0] == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "BREW"])
def test_other_methods_are_405(server, method):
    status, headers, _ = _request(server.port, method, "/metrics", body=b"x" * 100 if method in ("POST", "PUT") else None)
    assert status == 405
    assert headers.get("Allow") == "GET"
    _assert_alive(server.port)


def test_post_body_is_not_read_as_next_request(server):
    # A body that looks like a request must not be answered: the connection closes after the 405.
    raw = _raw(server.port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 26\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n")
    assert _status(raw) == 405
    assert raw.count(b"HTTP/1.") == 1


@pytest.mark.parametrize("garbage", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n",  # a TLS hello
    b"GARBAGE\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET /metrics HTTP/9.9\r\n\r\n",
    b"\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\n" + b"X-Long: " + b"a" * 70000 + b"\r\n\r\n",
])
def test_garbage_requests(server, garbage):
    raw = _raw(server.port, garbage)
    assert _status(raw) in (None, 400, 405, 414, 431, 505)
    _assert_alive(server.port)


def test_malformed_header_line_is_tolerated(server):
    # The stdlib header parser skips what it cannot read; the request itself is still valid.
    raw = _raw(server.port, b"GET /metrics HTTP/1.1\r\nthis is not a header\r\n\r\n")
    assert _status(raw) in (200, 400)
    _assert_alive(server.port)


def test_oversized_request_line_is_414(server):
    raw = _raw(server.port, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n")
    assert _status(raw) == 414
    _assert_alive(server.port)


def test_client_that_disconnects_at_once(server):
    for _ in range(20):
        _raw(server.port, b"GET /metr", read=False)
    _assert_alive(server.port)


def test_keep_alive_serves_several_requests(server):
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for _ in range(3):
            c.request("GET", "/metrics")
            r = c.getresponse()
            assert r.status == 200 and r.read()
    finally:
        c.close()


def test_each_scrape_is_answered_without_waiting_for_the_clients_delayed_ack(server, monkeypatch):
    """Headers and body go out as two writes; with Nagle's algorithm on the connection the body
    waited for the client's delayed ACK of the headers: 43 ms per keep-alive scrape (0.6 ms with
    TCP_NODELAY). Checked on the socket each request is served on, not by timing."""
    from ascend_pool.metrics.http import MetricsHandler
    nodelay = []
    setup = MetricsHandler.setup

    def spy(self):
        setup(self)
        nodelay.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(MetricsHandler, "setup", spy)
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for _ in range(2):
            c.request("GET", "/metrics")
            assert c.getresponse().read()
    finally:
        c.close()
    assert nodelay and all(nodelay), nodelay


def test_fifty_concurrent_clients_while_silent_ones_wait(server):
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(5)]  # never send
    results, errors = [], []

    def client():
        try:
            for _ in range(3):
                status, _, body = _request(server.port, "GET", "/metrics")
                results.append((status, b"ascend_pool_reserved_bytes" in body))
        except Exception as e:  # collected, asserted below
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(50)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - t0
    for s in silent:
        s.close()
    assert not errors
    assert len(results) == 150 and all(r == (200, True) for r in results)
    # served beside the silent ones, not after them (5 x the 10 s head timeout); slack for load
    assert elapsed < 40, elapsed


def test_failing_collector_is_500_and_server_survives(server):
    server.boom.fail = True
    status, _, body = _request(server.port, "GET", "/metrics")
    assert status == 500 and b"failed" in body
    server.boom.fail = False
    _assert_alive(server.port)


def test_a_client_sending_its_request_a_byte_at_a_time_is_dropped_after_the_timeout(server, monkeypatch):
    # Each byte came within the socket's timeout, so every read succeeded: such a client held its
    # server thread for as long as it liked (500 of them held 500 threads). The whole request
    # head now has the timeout; the server goes on answering others meanwhile.
    from ascend_pool.metrics.http import MetricsHandler
    monkeypatch.setattr(MetricsHandler, "timeout", 1.0)
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        t0 = time.monotonic()
        dropped = False
        for i in range(len(head)):  # a byte every 0.1 s, for up to 10 x the timeout (slack for load)
            try:
                s.sendall(head[i:i + 1])
            except OSError:  # reset: dropped
                dropped = True
                break
            time.sleep(0.1)
            if time.monotonic() - t0 > 10:
                break
        if not dropped:
            s.settimeout(0.2)  # less than the per-read timeout the server had before
            try:
                dropped = s.recv(100) == b""
            except ConnectionResetError:
                dropped = True
            except (TimeoutError, socket.timeout):
                pass
        assert dropped, "still being served after 10 x the timeout"
    _assert_alive(server.port)


def test_a_request_sent_in_pieces_within_the_timeout_is_answered_and_the_next_one_too(server):
    # the head is read across several packets, and what follows it (a pipelined request) is kept
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        for piece in (b"GET /heal", b"thz HTTP/1.1\r\nHo", b"st: x\r\n", b"\r\nGET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"):
            s.sendall(piece)
            time.sleep(0.05)
        got = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
    assert got.count(b"HTTP/1.1 200") == 2 and b"ok\n" in got and b"ascend_pool metrics" in got, got


def test_the_name_filter_serves_the_named_series_only(server):
    # prometheus_client's handler honours ?name[]=...; ours served every series to such a request
    path = "/metrics?name[]=ascend_pool_reserved_bytes&name%5B%5D=ascend_pool_allocations_total&name[]=nope"
    for accept in ({}, {"Accept": "application/openmetrics-text; version=1.0.0"}):
        status, headers, body = _request(server.port, "GET", path, headers=accept)
        assert status == 200
        lines = [line for line in body.decode().splitlines() if line and not line.startswith("#")]
        assert {line.split("{")[0].split(" ")[0] for line in lines} == {
            "ascend_pool_reserved_bytes", "ascend_pool_allocations_total"}
    status, _, body = _request(server.port, "GET", "/metrics?name[]=nope")
    assert status == 200 and not [line for line in body.decode().splitlines() if line and line[0] != "#"]
    _assert_alive(server.port)  # no filter (and an empty one): everything
    assert b"test_ok" in _request(server.port, "GET", "/metrics?name[]=")[2]
