"""start_http_server(port, addr) refuses a port that is not an int from 0 to 65535 and an addr that
is not a host with ascend_pool's ConfigError naming the value (before: a built-in OverflowError for
99999, TypeError for 'abc'); the bad call leaves no socket behind, and port 0 still works."""

import subprocess
import sys

import numpy as np
import pytest

from ascend_pool.errors import ConfigError
from ascend_pool.metrics import start_http_server


@pytest.mark.parametrize("port", [99999, 65536, -1, "abc", "9464", 1.5, None, True])
def test_bad_port_is_a_config_error_naming_it(port):
    with pytest.raises(ConfigError, match=r"^port: expected a port number, an int from 0 to 65535 .*got " +
                       repr(port).replace(".", r"\.")):
        start_http_server(port)


@pytest.mark.parametrize("addr", [5, None, b"127.0.0.1", "127.0.0.1\0x"])
def test_bad_addr_is_a_config_error_naming_it(addr):
    with pytest.raises(ConfigError, match=r"^addr: expected a host name or IP address \(str\), got "):
        start_http_server(0, addr)


@pytest.mark.parametrize("addr", ["", " "])
def test_an_empty_addr_is_refused_not_every_interface(addr):
    # "" was every interface (the socket layer's INADDR_ANY): an unset variable given as the
    # address (`--host "$HOST"`) exposed the endpoint where the default serves only 127.0.0.1
    with pytest.raises(ConfigError, match=r"^addr: expected a host name or IP address, got .*every interface is 0\.0\.0\.0"):
        start_http_server(0, addr)
    out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "serve", "--host", addr, "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--host: expected a host name or IP address" in out.stderr, out.stderr


def test_unresolvable_host_is_a_config_error_and_good_ports_still_serve():
    with pytest.raises(ConfigError, match="cannot resolve the address 'nosuch.invalid'"):
        start_http_server(0, "nosuch.invalid")
    for port in (0, np.int64(0)):
        srv = start_http_server(port)
        try:
            assert 0 < srv.port <= 65535
        finally:
            srv.close()


@pytest.mark.parametrize("registry", ["x", 5, object()])
def test_a_registry_without_collect_is_refused_at_the_call(registry):
    # accepted before: every scrape was then a 500, the AttributeError in the log alone
    from ascend_pool.errors import ConfigTypeError

    with pytest.raises(ConfigTypeError, match=r"^registry: expected None or a prometheus_client registry"):
        start_http_server(0, registry=registry)


@pytest.mark.parametrize("kwargs, match", [({"pools": "x"}, "pools must be None or a callable"),
                                           ({"pools": [1]}, "pools must be None or a callable"),
                                           ({"ledger": "no"}, "ledger must be True or False")])
def test_pool_collector_refuses_bad_arguments_at_the_call(kwargs, match):
    # PoolCollector(pools=[pool]) was taken and failed at each scrape ("'list' object is not
    # callable"), ledger="no" read as true
    from ascend_pool.errors import ConfigTypeError
    from ascend_pool.metrics import PoolCollector

    with pytest.raises(ConfigTypeError, match=match):
        PoolCollector(**kwargs)
