#!/usr/bin/env bash
# Installs Prometheus and promtool from Debian's packages for tests/test_prometheus_e2e.py.
# Idempotent: does nothing when both are already on PATH; runs `apt-get update` at most once.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
else
    SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package enables a system service; the tests start their own Prometheus on a free port,
# so a packaged one is not needed (and where systemd is not running nothing was started).
command -v prometheus >/dev/null && command -v promtool >/dev/null
