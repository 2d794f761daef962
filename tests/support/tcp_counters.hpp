#pragma once
// The kernel's count of refused and reset connections, read from /proc/net/netstat and
// /proc/net/snmp. Both are per network namespace, and every case runs in one of its own
// (netns.hpp): nothing but the case moves them.
#include <map>
#include <string>

namespace zcrelay::test {

// TcpExt ListenDrops and ListenOverflows (a SYN or an ACK dropped at a full or closing listener)
// and Tcp OutRsts (every RST sent, a refused SYN's included), AttemptFails and EstabResets.
std::map<std::string, long long> tcpCounters();
// Which of those moved since `before`: "" when none did, else "Tcp:OutRsts +2 ...".
std::string refusalsSince(const std::map<std::string, long long>& before);

}  // namespace zcrelay::test
