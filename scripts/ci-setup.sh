#!/usr/bin/env bash
# What the tests need from the system that pip cannot give: sshd for the real-SSH test.
# Everything else (nats-server, ansible, molecule) comes from the project's venv.
set -euo pipefail
if command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-setup: no sshd and no apt-get; the SSH test will skip and say why" >&2
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo -n"
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server >/dev/null \
  || { $sudo apt-get update -q >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server >/dev/null; }
