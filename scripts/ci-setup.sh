#!/usr/bin/env bash
# What the tests need from the system that pip cannot give:
#   openssh-server            sshd for the real-SSH test
#   systemd                   systemd-analyze for the unit checks (tests/deploy)
#   prometheus                a real Prometheus scraping a dcgm-exporter-format server
#                             (tests/integration/test_source_prometheus.py), and promtool
#                             to check gpuops's own alert rules
#   prometheus-alertmanager   a real Alertmanager delivering webhooks to gpuops
#   chromium, chromium-driver headless browser tests of the web console
#   slurmctld, slurmd,        a real Slurm controller and nodes on loopback, with munge,
#   slurm-client, munge       for the playbooks' drains, resumes and reboots (tests/peers/slurm.py)
#   openipmi, ipmitool        OpenIPMI's BMC simulator (ipmi_sim) and the real ipmitool that
#                             the playbooks drive it with (tests/peers/ipmi.py)
#   valgrind                  callgrind, which `gpuops bench instructions` counts a replay's
#                             instructions with (tests/e2e/test_bench_instructions.py)
# sushy-tools (the Redfish emulator) comes from PyPI with the venv's dev extras.
# kubectl (with kustomize) for the manifest checks comes with the machine; Debian's
# kubernetes-client is too old for kustomize's current syntax, so without kubectl those
# tests skip and say why. Everything else (nats-server, ansible, molecule) comes from the
# project's venv. Without apt-get (or root), the tests that need a package skip and say so.
set -euo pipefail
missing=()
need() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ] || missing+=("$2"); }
need sshd openssh-server
need systemd-analyze systemd
need prometheus prometheus
need promtool prometheus
need prometheus-alertmanager prometheus-alertmanager
need chromium chromium
need chromedriver chromium-driver
need slurmctld slurmctld
need slurmd slurmd
need sbatch slurm-client
need munged munge
need ipmi_sim openipmi
need ipmitool ipmitool
need valgrind valgrind
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-setup: missing ${missing[*]} and no apt-get; the tests that need them skip and say why" >&2
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo -n"
install() {
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}" >/dev/null
}
# Debian's prometheus packages start their services on install where an init system
# runs; the tests start their own on random ports, so stop the packaged ones.
stop_services() {
  for unit in prometheus prometheus-alertmanager prometheus-node-exporter slurmctld slurmd munge openipmi; do
    $sudo systemctl stop "$unit" >/dev/null 2>&1 || true
  done
}
if ! install; then
  $sudo apt-get update -q >/dev/null
  install || { echo "ci-setup: could not install ${missing[*]}; the tests that need them skip" >&2; exit 0; }
fi
stop_services
