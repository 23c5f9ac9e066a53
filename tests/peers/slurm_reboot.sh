#!/bin/sh
# RebootProgram of the test cluster (tests/peers/slurm.py): slurmd runs it (through
# `sh -c`) to reboot its node. There is no machine to reboot, so it records which node
# asked (the slurmd above it, from its -N) and restarts that slurmd in a time namespace
# whose clock says the machine booted a moment ago: slurmctld takes a node for rebooted
# when it registers with a boot time no earlier than its reboot request, as after a real
# boot, and ignores it otherwise until ResumeTimeout says "reboot timed out".
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
# The request came before this script started. The new boot is put 2 s after the start
# (in whole seconds of the host's uptime, rounded up), which leaves room for slurmctld's
# whole-second sums (now - reported uptime, each rounded its own way), and the slurmd
# starts no sooner than 1 s after that boot: a namespace's clock cannot read before it.
start=$(cut -d' ' -f1 /proc/uptime)
boot=$(( ${start%.*} + 3 ))
(
  sleep 1
  kill "$daemon"
  while kill -0 "$daemon" 2>/dev/null; do sleep 0.2; done
  while [ "$(cut -d. -f1 /proc/uptime)" -le "$boot" ]; do sleep 0.2; done
  exec unshare --time --boottime "-$boot" /usr/sbin/slurmd -N "$node" -f "$root/slurm.conf"
) </dev/null >>"$root/log/reboot.log" 2>&1 &
