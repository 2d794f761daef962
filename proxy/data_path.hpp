#pragma once
// The ways a direction can move bytes: one table for the config's `mode`, the `path` label of
// zcrelay_bytes_total, zcrelay_datapath_info, the access log and the tests.
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

}  // namespace zcrelay
