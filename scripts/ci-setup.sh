#!/usr/bin/env bash
# What the tests need from the system that pip cannot give: sshd for the real-SSH test,
# systemd-analyze for the unit checks (tests/deploy). kubectl (with kustomize) for the
# manifest checks comes with the machine; Debian's kubernetes-client is too old for
# kustomize's current syntax, so without kubectl those tests skip and say why.
# Everything else (nats-server, ansible, molecule) comes from the project's venv.
set -euo pipefail
missing=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-setup: missing ${missing[*]} and no apt-get; the tests that need them skip and say why" >&2
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo -n"
install() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
install || { $sudo apt-get update -q >/dev/null && install; }
