"""A small, defensive HTTP endpoint for metrics: GET /metrics, GET /healthz (and / with a short page), nothing else.

Used by start_http_server() in-process and by `ascend-pool serve`. Why not prometheus_client's own
server: we want 405 for every other method (its server answers many), errors logged instead of
tracebacks on stderr, idle or slow clients timed out so they cannot pin threads, and one
request body never read as the next request.
"""

import logging
import operator
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.exposition import choose_encoder

from .. import registry as reg
from ..errors import ConfigError, ConfigTypeError
from .collector import PoolCollector
from .node import BuildInfo, NodeLabelled

log = logging.getLogger(__name__)

MAX_REQUEST_LINE = 8192  # bytes; a scrape's request line is ~30
LINGER_BYTES = 1 << 20  # what a refused client may still send before its connection is dropped
LINGER_S = 2.0          # seconds of silence after which it is dropped anyway
INDEX = (b"<!doctype html><html><head><title>ascend_pool</title></head><body>"
         b"<h1>ascend_pool metrics</h1><p><a href=\"/metrics\">/metrics</a></p></body></html>\n")


class _HeadReader:
    """The handler's rfile: lines read from the socket with one deadline for a whole request head
    (its line and headers), not a timeout per read: a client sending a byte every few seconds
    answered every read in time and held its thread for as long as it liked (500 such clients,
    500 threads). Only the head is read from it (a request body is never read: see
    handle_one_request); what follows a head stays buffered for the next request."""

    def __init__(self, sock):
        self._sock = sock
        self._buf = b""
        self._deadline = None
        self.closed = False

    def start(self, seconds):
        """The next head must have arrived within `seconds` from now."""
        self._seconds = seconds
        self._deadline = time.monotonic() + seconds

    def readline(self, limit=-1):
        while True:
            end = self._buf.find(b"\n") + 1
            if end == 0 and 0 <= limit <= len(self._buf):
                end = limit
            elif end and 0 <= limit < end:
                end = limit
            if end:
                line, self._buf = self._buf[:end], self._buf[end:]
                return line
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request head did not arrive in time")
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(65536)
            finally:
                self._sock.settimeout(self._seconds)  # an answer's writes have their own time (sendall: in all)
            if not chunk:  # the client closed its side: what came is all
                line, self._buf = self._buf, b""
                return line
            self._buf += chunk

    def close(self):
        self.closed = True


class MetricsHandler(BaseHTTPRequestHandler):
    """Serves the registry of its server (server.registry)."""

    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection between scrapes
    server_version = "ascend-pool"
    sys_version = ""
    timeout = 10  # seconds a request head may take in all (a silent client: as long), then it is dropped
    # TCP_NODELAY: the headers and the body go out as two writes; with Nagle's algorithm the body
    # waited for the client's delayed ACK of the headers, 40 ms on every keep-alive scrape.
    disable_nagle_algorithm = True

    def setup(self):
        super().setup()
        self.rfile.close()
        self.rfile = _HeadReader(self.connection)

    def handle_one_request(self):
        # BaseHTTPRequestHandler.handle_one_request, with our own dispatch: every method other than
        # GET is 405 (the stock one answers 501 for unknown methods and needs a do_X per method).
        try:
            self.rfile.start(self.timeout)  # silent for `timeout` s, or a head that takes longer: dropped
            self.raw_requestline = self.rfile.readline(MAX_REQUEST_LINE + 1)
            if len(self.raw_requestline) > MAX_REQUEST_LINE:
                self.requestline, self.request_version, self.command = "", "", ""
                self.send_error(414)
                self.close_connection = True
                self._lingering_close()
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():  # has answered 400/505 itself
                self.close_connection = True
                return
            if self.command == "GET":
                self._get()
            else:
                # A body we do not read must not be parsed as the next request: close.
                self.close_connection = True
                self._reply(405, b"method not allowed: only GET\n", "text/plain; charset=utf-8", [("Allow", "GET")])
            self.wfile.flush()
        except (TimeoutError, socket.timeout, ConnectionError):
            self.close_connection = True

    def _lingering_close(self):
        """Closing a socket with unread input makes the kernel send a reset, which can destroy the
        answer just written before the client reads it. So: flush, stop writing, and discard what
        the client still sends (bounded in bytes and time) until it closes its side."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            left = LINGER_BYTES
            while left > 0:
                chunk = self.connection.recv(min(left, 65536))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    def _get(self):
        path, _, query = self.path.partition("?")
        if path == "/metrics":
            try:
                encoder, content_type = choose_encoder(self.headers.get("Accept"))
                body = encoder(_only_named(self.server.registry, query))
            except Exception:  # a collector failed: say so, keep serving
                log.exception("collecting metrics failed")
                self._reply(500, b"collecting metrics failed; see the exporter's log\n", "text/plain; charset=utf-8")
                return
            self._reply(200, body, content_type)
        elif path == "/healthz":
            self._healthz()
        elif path == "/":
            self._reply(200, INDEX, "text/html; charset=utf-8")
        else:
            self._reply(404, b"not found: try /metrics\n", "text/plain; charset=utf-8")

    def _healthz(self):
        # 200 "ok", or 503 with the reason the server's health check gave (probes log the body).
        check = getattr(self.server, "health", None)
        try:
            reason = check() if check is not None else None
        except Exception as e:  # a failing check is itself a reason, never a crash
            log.exception("health check failed")
            reason = f"health check failed: {e}"
        if reason:
            self._reply(503, f"unhealthy: {reason}\n".encode(), "text/plain; charset=utf-8")
        else:
            self._reply(200, b"ok\n", "text/plain; charset=utf-8")

    def _reply(self, code, body, content_type, headers=()):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (stdlib's name)
        log.debug("%s - %s", self.address_string(), format % args)


def _only_named(registry, query):
    """registry, or only its series named by the query's name[] values (?name[]=a&name[]=b), as
    prometheus_client's own handler serves: a scraper or a curl asking for a few series got all."""
    names = parse_qs(query).get("name[]")
    if not names:
        return registry
    # Not registry.restricted_registry(): it finds collectors by the names their describe() gives,
    # and ours (auto_describe=False, collectors named at collect time) give none: it served nothing.
    return _Restricted(registry, set(names))


class _Restricted:
    """What registry.collect() yields, with only the samples named in `names` (sample names, as
    prometheus_client's: ascend_pool_allocations_total, not the family's ascend_pool_allocations)."""

    def __init__(self, registry, names):
        self._registry, self._names = registry, names

    def collect(self):
        for metric in self._registry.collect():
            samples = [s for s in metric.samples if s.name in self._names]
            if samples:
                kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                kept.samples = samples
                yield kept


PORT_MAX = 65535


def check_address(addr, port, names=("addr", "port")):
    """ConfigError naming the bad value unless addr is a host (str) and port an int 0..65535 (0
    picks a free port); returns the port as an int. names: what the message calls them (the
    CLI's --host and --port)."""
    try:
        number = None if isinstance(port, bool) else operator.index(port)  # int, numpy ints
    except TypeError:
        number = None
    if number is None or not 0 <= number <= PORT_MAX:
        raise ConfigError(f"{names[1]}: expected a port number, an int from 0 to {PORT_MAX} "
                          f"(0 picks a free one), got {port!r}")
    if not isinstance(addr, str) or "\0" in addr:
        raise ConfigError(f"{names[0]}: expected a host name or IP address (str), got {addr!r}")
    if not addr.strip():
        # the socket layer takes "" for every interface: an unset variable (--host "$HOST") would
        # expose the endpoint on all of them, where the default is 127.0.0.1
        raise ConfigError(f"{names[0]}: expected a host name or IP address, got {addr!r} (every interface is "
                          "0.0.0.0, or :: for IPv6)")
    return number


class MetricsServer(ThreadingHTTPServer):
    """ThreadingHTTPServer serving `registry` on (addr, port). port 0 picks a free port; see .port.
    health: a callable returning None when healthy, else the reason (a str) /healthz answers 503 with.
    Raises ConfigError naming a bad port or address (check_address; a host name that does not
    resolve), OSError naming the address when it cannot listen (e.g. the port is in use)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, registry, health=None):
        address = (address[0], check_address(*address))
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.registry = registry
        self.health = health
        try:
            super().__init__(address, MetricsHandler)
        except socket.gaierror as e:
            raise ConfigError(f"cannot resolve the address {address[0]!r}: {e.strerror or e}") from None
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {address[0]} port {address[1]}: {e.strerror or e}") from None

    @property
    def port(self):
        return self.server_address[1]

    def handle_error(self, request, client_address):
        # A client that vanished mid-reply is not the server's problem; log, do not print a traceback.
        log.debug("request from %s failed", client_address, exc_info=True)

    def close(self):
        """Stops serving and closes the listening socket."""
        self.shutdown()
        self.server_close()


def serve_in_thread(server):
    """Runs server.serve_forever() in a daemon thread; returns the thread."""
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                         name=f"ascend-pool-metrics:{server.port}", daemon=True)
    t.start()
    return t


_backends_used = set()  # every backend this process has had a pool of


def _backend_in_use():
    # The backends used so far, not those open at this scrape: a process closing its pools
    # between jobs flipped its build_info series between backend="sim" and "none".
    _backends_used.update({str(getattr(getattr(p, "backend", None), "name", "")) for p in reg.live_pools()} - {""})
    return ",".join(sorted(_backends_used)) or "none"


def start_http_server(port, addr="127.0.0.1", registry=None):
    """Serves this process's pools (or `registry`) on http://addr:port/metrics from a daemon thread.
    Returns the MetricsServer (.port is the bound port, useful with port=0; .close() stops it).
    A port that is not an int from 0 to 65535, or an addr that is not a host, raises ConfigError;
    a registry without collect(), ConfigTypeError."""
    if registry is not None and not callable(getattr(registry, "collect", None)):
        # checked here, not at the first scrape (a 500 at each one, the cause in the log alone)
        raise ConfigTypeError(f"registry: expected None or a prometheus_client registry (an object with "
                              f"collect()), got {type(registry).__name__} {registry!r}")
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(PoolCollector())
        registry.register(NodeLabelled(BuildInfo(_backend_in_use)))
    server = MetricsServer((addr, port), registry)
    serve_in_thread(server)
    return server
