#!/usr/bin/env bash
# Installs every Debian package zcrelay's build, tests and benches need. Idempotent: packages
# already present are left alone, and apt-get update runs once, only when something is missing.
# Nothing is fetched from anywhere but Debian's archive.
set -euo pipefail

packages=(
  # build
  build-essential cmake pkg-config
  liburing-dev libyaml-cpp-dev prometheus-cpp-dev libexpected-dev libmicrohttpd-dev
  # BPF (sockmap data path): clang -target bpf, bpftool skeletons, libbpf
  libbpf-dev bpftool clang llvm clang-format
  # tests
  libgtest-dev googletest netcat-openbsd socat iproute2 iptables procps curl
  # real bulk clients through mode auto (tests/integration/auto_mode_clients_test.cpp)
  iperf3
  # TLS peers of the SNI routing tests and bench: openssl s_server/s_client, certificates
  openssl wget
  # DNS discovery: the c-ares resolver library, and the real DNS server (dnsmasq) and dig the
  # discovery tests and bench run on loopback
  libc-ares-dev dnsmasq-base bind9-dnsutils
  # fuzz targets (tests/fuzz): libFuzzer and the ASan/UBSan runtimes for the clang above
  libclang-rt-dev
  # benches and peers
  haproxy nginx libnginx-mod-stream wrk prometheus linux-perf gnuplot-nox ministat python3 time
  # real services behind the relay (bench/fin-resets.sh, tests/integration/handover_test.cpp):
  # PostgreSQL, psql and pgbench, run as the postgres user in a data directory of their own;
  # sshd and scp, an sshd of the test's own on a loopback port (no system service is started)
  postgresql openssh-server openssh-client
  # failover behind the relay (tests/integration/patroni_test.cpp, bench/failover.sh): Patroni
  # managing PostgreSQL nodes of the test's own, with etcd as its store (started by the test on
  # loopback ports, never as system services)
  patroni etcd-server etcd-client python3-etcd
  # the suite's stress runs (tests/stress.sh): the cases again while both CPUs are busy
  stress-ng
  # packaging checks (tests/deploy): cpack's DEB generator (dpkg-shlibdeps, file),
  # systemd-analyze, the manifest checks' YAML parser
  dpkg-dev file systemd python3-yaml
)

if [[ $(id -u) -ne 0 ]]; then
  sudo=sudo
else
  sudo=
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
# haproxy, nginx and prometheus are peers the benches start by hand on loopback ports; their
# packages would otherwise start system services (nginx on :80, prometheus on :9090) at install.
# policy-rc.d answering 101 is Debian's documented way to say "do not start services now".
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  created_policy=1
fi
cleanup() { if ((created_policy)); then $sudo rm -f "$policy"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: done"
