#pragma once
// The named outcomes that logs and metric labels share. Each list is written once (X-macro)
// so an enum value cannot exist without its label.
#include <array>
#include <cstdint>
#include <string_view>

namespace zcrelay {

// Why a connection ended.
#define ZCRELAY_CLOSE_REASONS(X)                                                                \
    X(Done, "done")                           /* both directions finished with a FIN */         \
    X(ClientReset, "client_reset")            /* RST or socket error on the client side */      \
    X(UpstreamReset, "upstream_reset")        /* RST or socket error on the upstream side */    \
    X(ConnectFailed, "connect_failed")        /* every connect attempt failed */                \
    X(NoBackend, "no_backend")                /* no backend of the cluster was up */            \
    X(ProxyProtocol, "proxy_protocol")        /* a bad, slow or oversized PROXY header */       \
    X(SourceLimit, "source_limit")            /* max_connections_per_source reached */          \
    X(IdleTimeout, "idle_timeout")            /* no byte either way for idle_timeout */         \
    X(NoRoute, "no_route")                    /* routes: none took the client (see inspect) */  \
    X(ClientFinTimeout, "client_fin_timeout") /* FIN passed to the client, then silence */      \
    X(ServerFinTimeout, "server_fin_timeout") /* FIN passed to the backend, then silence */     \
    X(MaxDuration, "max_duration")            /* ended at max_connection_duration */            \
    X(AdminShutdown, "admin_shutdown")   /* the runtime API ended its backend's connections */  \
    X(BackendDown, "backend_down")       /* checks took its backend down: on_marked_down */     \
    X(BackupShutdown, "backup_shutdown") /* a primary came up: on_marked_up, backups' */        \
    X(QueueFull, "queue_full")           /* every backend at max_connections, the queue full */ \
    X(QueueTimeout, "queue_timeout")     /* queued for a backend past queue_timeout */          \
    X(Loop, "loop")                      /* accepted from one of our own upstream sockets */    \
    X(Drain, "drain")                    /* still open when drain_timeout ran out */            \
    X(HandedOver, "handed_over")         /* passed live to the relay that took over */          \
    X(Error, "error")                    /* a local failure: fd limit, pipe, ring */

// Why an upstream connect failed.
#define ZCRELAY_CONNECT_FAILURES(X)   \
    X(Refused, "refused")             \
    X(Timeout, "timeout")             \
    X(Unreachable, "unreachable")     \
    X(AddrNotAvail, "addr_not_avail") \
    X(Other, "other")

// Why a direction that wanted a pipe moved its bytes by copy instead.
#define ZCRELAY_PIPE_FALLBACKS(X)                                                              \
    X(PoolExhausted, "pool_exhausted") /* the worker's share of max_pipes is in use */         \
    X(PipeLimit, "pipe_limit")         /* pipe-user-pages-soft: the kernel gave a tiny pipe */ \
    X(Emfile, "emfile")                /* no fd left for the pipe's two ends */

// Why a sockmap connection is relayed by another data path.
#define ZCRELAY_SOCKMAP_FALLBACKS(X)                                                       \
    X(NotEstablished, "not_established") /* a socket had its FIN or RST already: splice */ \
    X(InsertFailed, "insert_failed")     /* the kernel refused it: splice, or copy one way */\
    X(NoRecord, "no_record")             /* the slot has no counter record (maps full) */   \
    X(PartlyRead, "partly_read")         /* a segment the relay read in part is queued */

// Why a direction of a live connection changed its data path (zcrelay_datapath_switches_total).
#define ZCRELAY_SWITCH_REASONS(X) \
    X(Interactive, "interactive") /* mode auto: request/response seen, splice -> sockmap */

// Why inspecting a client's first bytes for a route found no condition to match on, or no
// route whose condition held; the default route, if any, then takes the client.
#define ZCRELAY_INSPECT_FAILURES(X)                                                           \
    X(Timeout, "timeout")      /* no complete ClientHello within inspect_timeout */            \
    X(NotTls, "not_tls")       /* the first bytes are not a TLS handshake record */            \
    X(TooLarge, "too_large")   /* the ClientHello would exceed inspect_max_size */             \
    X(Malformed, "malformed")  /* a TLS handshake that breaks the ClientHello's structure */   \
    X(NoSni, "no_sni")         /* a ClientHello without server_name, no route matched */       \
    X(NoRoute, "no_route")     /* a ClientHello with server_name that no route matched */      \
    X(Closed, "closed")        /* the client closed before its ClientHello was complete */

// What became of a copy send large enough for send_zerocopy (pump/copy_pump.hpp), counted when
// its notification comes, or when it went plain.
#define ZCRELAY_ZEROCOPY_SENDS(X)                                                              \
    X(Zerocopy, "zerocopy")     /* the skbs carried the buffer's own pages */                  \
    X(Copied, "copied")         /* the kernel copied after all (loopback always does) */       \
    X(Unreported, "unreported") /* notified; the kernel cannot say which (before Linux 6.2) */   \
    X(Plain, "plain")           /* sent plainly: the direction's or the worker's holds were taken */

#define ZCRELAY_ENUM_ITEM(name, label) name,
#define ZCRELAY_LABEL_ITEM(name, label) label,

enum class CloseReason : uint8_t { ZCRELAY_CLOSE_REASONS(ZCRELAY_ENUM_ITEM) kCount };
enum class ConnectFailure : uint8_t { ZCRELAY_CONNECT_FAILURES(ZCRELAY_ENUM_ITEM) kCount };
enum class PipeFallback : uint8_t { ZCRELAY_PIPE_FALLBACKS(ZCRELAY_ENUM_ITEM) kCount };
enum class SockmapFallback : uint8_t { ZCRELAY_SOCKMAP_FALLBACKS(ZCRELAY_ENUM_ITEM) kCount };
enum class SwitchReason : uint8_t { ZCRELAY_SWITCH_REASONS(ZCRELAY_ENUM_ITEM) kCount };
enum class InspectFailure : uint8_t { ZCRELAY_INSPECT_FAILURES(ZCRELAY_ENUM_ITEM) kCount };
enum class ZerocopySend : uint8_t { ZCRELAY_ZEROCOPY_SENDS(ZCRELAY_ENUM_ITEM) kCount };

inline constexpr std::array<std::string_view, static_cast<size_t>(CloseReason::kCount)>
    kCloseReasonLabels{ZCRELAY_CLOSE_REASONS(ZCRELAY_LABEL_ITEM)};
inline constexpr std::array<std::string_view, static_cast<size_t>(ConnectFailure::kCount)>
    kConnectFailureLabels{ZCRELAY_CONNECT_FAILURES(ZCRELAY_LABEL_ITEM)};
inline constexpr std::array<std::string_view, static_cast<size_t>(PipeFallback::kCount)>
    kPipeFallbackLabels{ZCRELAY_PIPE_FALLBACKS(ZCRELAY_LABEL_ITEM)};
inline constexpr std::array<std::string_view, static_cast<size_t>(SockmapFallback::kCount)>
    kSockmapFallbackLabels{ZCRELAY_SOCKMAP_FALLBACKS(ZCRELAY_LABEL_ITEM)};
inline constexpr std::array<std::string_view, static_cast<size_t>(SwitchReason::kCount)>
    kSwitchReasonLabels{ZCRELAY_SWITCH_REASONS(ZCRELAY_LABEL_ITEM)};
inline constexpr std::array<std::string_view, static_cast<size_t>(InspectFailure::kCount)>
    kInspectFailureLabels{ZCRELAY_INSPECT_FAILURES(ZCRELAY_LABEL_ITEM)};
inline constexpr std::array<std::string_view, static_cast<size_t>(ZerocopySend::kCount)>
    kZerocopySendLabels{ZCRELAY_ZEROCOPY_SENDS(ZCRELAY_LABEL_ITEM)};

template <typename E>
constexpr size_t idx(E e) {
    return static_cast<size_t>(e);
}

inline std::string_view label(CloseReason r) { return kCloseReasonLabels[idx(r)]; }
inline std::string_view label(ConnectFailure r) { return kConnectFailureLabels[idx(r)]; }
inline std::string_view label(PipeFallback r) { return kPipeFallbackLabels[idx(r)]; }
inline std::string_view label(SockmapFallback r) { return kSockmapFallbackLabels[idx(r)]; }
inline std::string_view label(SwitchReason r) { return kSwitchReasonLabels[idx(r)]; }
inline std::string_view label(InspectFailure r) { return kInspectFailureLabels[idx(r)]; }

}  // namespace zcrelay
