#pragma once
// The ways a direction can move bytes: one table for the `path` label of zcrelay_bytes_total,
// zcrelay_datapath_switches_total, the access log and the tests; and the listener's `mode`,
// which names one of them or `auto`.
//   splice:  socket -> pipe -> socket with splice(2); the bytes never enter user space.
//   copy:    io_uring recv/send through a provided buffer ring (the baseline and the fallback).
//   sockmap: an eBPF sk_skb verdict redirects each socket's bytes to the other's egress inside
//            the kernel (bpf/relay.bpf.c): the low-latency path. Runs as splice where the
//            program cannot load (no CAP_BPF/CAP_NET_ADMIN).
#include <array>
#include <cstdint>
#include <string_view>

#include "reasons.hpp"

namespace zcrelay {

#define ZCRELAY_DATA_PATHS(X) \
    X(Splice, "splice")       \
    X(Copy, "copy")           \
    X(Sockmap, "sockmap")

enum class DataPath : uint8_t { ZCRELAY_DATA_PATHS(ZCRELAY_ENUM_ITEM) kCount };
inline constexpr std::array<std::string_view, idx(DataPath::kCount)> kDataPathLabels{
    ZCRELAY_DATA_PATHS(ZCRELAY_LABEL_ITEM)};
inline std::string_view label(DataPath p) { return kDataPathLabels[idx(p)]; }

// A listener's `mode`: the data path its connections ask for (the table above), or `auto`: each
// connection starts on splice and is promoted to sockmap when it turns out interactive
// (pump/paths.hpp). The path that runs may differ (sockmap and auto run splice where the
// program cannot load, and for unix backends).
#define ZCRELAY_MODES(X)  \
    X(Splice, "splice")   \
    X(Copy, "copy")       \
    X(Sockmap, "sockmap") \
    X(Auto, "auto")
enum class Mode : uint8_t { ZCRELAY_MODES(ZCRELAY_ENUM_ITEM) kCount };
inline constexpr std::array<std::string_view, idx(Mode::kCount)> kModeLabels{
    ZCRELAY_MODES(ZCRELAY_LABEL_ITEM)};
inline std::string_view modeName(Mode m) { return kModeLabels[idx(m)]; }
// The path a direction leaves when it switches for `r` (zcrelay_datapath_switches_total).
constexpr DataPath switchedFrom(SwitchReason r) {
    switch (r) {
        case SwitchReason::Interactive:
        case SwitchReason::kCount:
            break;
    }
    return DataPath::Splice;
}

// Whether the mode needs the sockmap program loaded.
inline bool usesSockmap(Mode m) { return m == Mode::Sockmap || m == Mode::Auto; }

}  // namespace zcrelay
