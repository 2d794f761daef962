#include "support/tcp_counters.hpp"

#include <fstream>
#include <sstream>

namespace zcrelay::test {

std::map<std::string, long long> tcpCounters() {
    std::map<std::string, long long> out;
    for (const char* file : {"/proc/net/netstat", "/proc/net/snmp"}) {
        std::ifstream in(file);
        std::string names, values;
        while (std::getline(in, names) && std::getline(in, values)) {
            std::istringstream n(names), v(values);
            std::string prefix, name, value;
            n >> prefix;
            v >> value;
            while (n >> name && v >> value) out[prefix + name] = std::stoll(value);
        }
    }
    return out;
}

std::string refusalsSince(const std::map<std::string, long long>& before) {
    std::map<std::string, long long> now = tcpCounters();
    std::string out;
    for (const char* key : {"TcpExt:ListenDrops", "TcpExt:ListenOverflows", "Tcp:OutRsts",
                            "Tcp:AttemptFails", "Tcp:EstabResets"}) {
        const auto was = before.find(key);
        const long long delta = now[key] - (was == before.end() ? 0 : was->second);
        if (delta != 0) out += std::string(key) + " +" + std::to_string(delta) + " ";
    }
    return out;
}

}  // namespace zcrelay::test
