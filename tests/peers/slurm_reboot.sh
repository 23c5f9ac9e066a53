#!/bin/sh
# RebootProgram of the test cluster (tests/peers/slurm.py): slurmd runs it (through
# `sh -c`) to reboot its node. There is no machine to reboot, so it records which node
# asked (the slurmd above it, from its -N) and restarts that slurmd in a time namespace
# whose clock says the machine booted a moment ago: slurmctld takes a node for rebooted
# when it registers with a later boot time, as after a real boot.
root="$1"
daemon=$PPID
node=""
while [ "$daemon" -gt 1 ]; do
  node=$(tr '\0' '\n' < "/proc/$daemon/cmdline" | sed -n '/^-N$/{n;p;}')
  [ -n "$node" ] && break
  daemon=$(cut -d' ' -f4 "/proc/$daemon/stat")
done
[ -n "$node" ] || { echo "no slurmd -N above $$" >&2; exit 1; }
echo "$node" >> "$root/reboots.log"
(
  sleep 1
  kill "$daemon"
  while kill -0 "$daemon" 2>/dev/null; do sleep 0.2; done
  up=$(cut -d. -f1 /proc/uptime)
  exec unshare --time --boottime "-$((up - 1))" /usr/sbin/slurmd -N "$node" -f "$root/slurm.conf"
) </dev/null >>"$root/log/reboot.log" 2>&1 &
