#!/usr/bin/env bash
# Installs the Debian packages the tests use: Prometheus and promtool (tests/test_prometheus_e2e.py
# and the other real-Prometheus tests) and strace (tests/test_killed_at_start.py stops a process
# at a system call). Idempotent: does nothing when all are already on PATH; runs `apt-get update`
# at most once.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 && command -v strace >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
else
    SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus strace >/dev/null
# The package enables a system service; the tests start their own Prometheus on a free port,
# so a packaged one is not needed (and where systemd is not running nothing was started).
command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v strace >/dev/null
