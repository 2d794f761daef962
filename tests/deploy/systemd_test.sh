#!/usr/bin/env bash
# deploy/systemd/zcrelay.service: `systemd-analyze verify` (alone, with the socket unit and with
# the sockmap drop-in), its hardening score, that its syscall filter lets io_uring through, and
# the settings the relay's signals and fd budget depend on. verify checks that ExecStart's binary
# exists, so it runs on a copy of the unit whose /usr/bin/zcrelay is the built binary; nothing
# else is changed.
# Usage: systemd_test.sh ZCRELAY_BINARY SOURCE_DIR SCRATCH
set -euo pipefail
binary=$1 src=$2 scratch=$3
fail() { echo "FAIL: $*" >&2; exit 1; }
unit_src=$src/deploy/systemd/zcrelay.service
dropin_src=$src/deploy/systemd/zcrelay-sockmap.conf

rm -rf "$scratch" && mkdir -p "$scratch"
unit=$scratch/zcrelay.service
sed "s#/usr/bin/zcrelay#$binary#g" "$unit_src" >"$unit"

# verify exits 0 on unknown keys and bad values too (it only warns): any line it prints fails.
verify() {
  local out
  out=$(systemd-analyze verify "$unit" 2>&1) || fail "systemd-analyze verify: $out"
  [[ -z $out ]] || fail "systemd-analyze verify warns: $out"
}
verify
# Exposure 0.0 (locked down) .. 10.0 (unsafe); threshold in tenths. 1.8 when written.
systemd-analyze security --offline=true --threshold=20 --no-pager "$unit" >"$scratch/security.txt" 2>&1 ||
  { cat "$scratch/security.txt"; fail "exposure above 2.0"; }
grep -q 'CAP_BPF.*may not load BPF' "$scratch/security.txt" || fail "the unit alone may load BPF programs"

# The socket unit beside it (socket activation): systemd pairs zcrelay.socket with zcrelay.service.
cp "$src/deploy/systemd/zcrelay.socket" "$scratch/zcrelay.socket"
out=$(systemd-analyze verify "$scratch/zcrelay.socket" 2>&1) || fail "systemd-analyze verify zcrelay.socket: $out"
[[ -z $out ]] || fail "systemd-analyze verify zcrelay.socket warns: $out"

# The sockmap drop-in, where systemd reads drop-ins: it adds to the capabilities and the filter.
mkdir -p "$scratch/zcrelay.service.d"
cp "$dropin_src" "$scratch/zcrelay.service.d/sockmap.conf"
verify
systemd-analyze security --offline=true --threshold=25 --no-pager "$unit" >"$scratch/security-sockmap.txt" 2>&1 ||
  { cat "$scratch/security-sockmap.txt"; fail "exposure with the sockmap drop-in above 2.5"; }
grep -q 'CAP_BPF.*may load BPF' "$scratch/security-sockmap.txt" || fail "the drop-in does not allow CAP_BPF"
for cap in CAP_BPF CAP_NET_ADMIN CAP_PERFMON; do
  grep -Eq "^AmbientCapabilities=.*\b$cap\b" "$dropin_src" || fail "drop-in: $cap not ambient"
  grep -Eq "^CapabilityBoundingSet=.*\b$cap\b" "$dropin_src" || fail "drop-in: $cap not in the bounding set"
done

# The syscall filter: every group it allows, expanded by this systemd, must hold what the relay
# calls; bpf() must be the drop-in's to add.
# `syscall-filter @group` lists syscalls and nested groups: expand those until none is left.
expand() {
  local todo=("$@") seen=" " g
  while ((${#todo[@]})); do
    g=${todo[0]} todo=("${todo[@]:1}")
    [[ $seen == *" $g "* ]] && continue
    seen+="$g "
    if [[ $g == @* ]]; then
      # shellcheck disable=SC2207
      todo+=($(systemd-analyze syscall-filter --no-pager "$g" | sed -E 's/^ +//' | grep -Ev '^(#|$)' | tail -n +2))
    else
      echo "$g"
    fi
  done
}
# shellcheck disable=SC2046
allowed=$(expand $(grep '^SystemCallFilter=' "$unit_src" | sed 's/^SystemCallFilter=//' | tr ' ' '\n' | grep -v '^~'))
[[ -n $allowed ]] || fail "no SystemCallFilter allow-list"
for sc in io_uring_setup io_uring_enter io_uring_register splice pipe2 socket accept4 connect setsockopt \
  getsockopt eventfd2 mmap prlimit64 rt_sigtimedwait clone3 kill; do
  grep -qx "$sc" <<<"$allowed" || fail "SystemCallFilter does not allow $sc"
done
! grep -qx bpf <<<"$allowed" || fail "bpf() is allowed without the drop-in"
grep -qx 'SystemCallFilter=bpf' "$dropin_src" || fail "the drop-in does not allow bpf()"

# Settings the relay's behaviour depends on.
has() { grep -qx "$1" "$unit_src" || fail "$unit_src: no line '$1'"; }
has 'Type=notify'
# A SIGUSR2 upgrade's new process says MAINPID=: systemd takes it from a non-main pid only so.
has 'NotifyAccess=all'
has 'ExecStart=/usr/bin/zcrelay -c /etc/zcrelay/zcrelay.yaml'
has 'ExecReload=/bin/kill -HUP $MAINPID'
has 'KillSignal=SIGTERM'
has 'Restart=on-failure'
has 'LimitNOFILE=1048576'
has 'AmbientCapabilities=CAP_NET_BIND_SERVICE'
# SIGTERM drains for drain_timeout: systemd must wait longer before its SIGKILL.
seconds() {  # 30s, 2min, 45 -> seconds
  local v=$1
  case $v in
    *min) echo $((${v%min} * 60)) ;; *m) echo $((${v%m} * 60)) ;; *s) echo "${v%s}" ;; *) echo "$v" ;;
  esac
}
drain=$(sed -n 's/^drain_timeout: *\([0-9]*[a-z]*\).*/\1/p' "$src/config/zcrelay.example.yaml")
stop=$(sed -n 's/^TimeoutStopSec=//p' "$unit_src")
[[ -n $drain && -n $stop ]] || fail "drain_timeout '$drain' or TimeoutStopSec '$stop' not found"
(($(seconds "$stop") > $(seconds "$drain"))) || fail "TimeoutStopSec=$stop is not above drain_timeout $drain"
echo "systemd unit OK ($(grep -o 'Overall exposure level.*' "$scratch/security.txt"))"
