#pragma once
// DNS service discovery: clusters whose backends are the addresses of a name (A/AAAA, at the
// cluster's port) or the targets of its SRV records (at their ports and weights), followed as
// the orchestrator changes them. Kubernetes headless Services, Consul's DNS interface and
// plain round-robin names all publish this way.
//
// One thread owns a c-ares channel and every query: workers never wait for DNS. Each name is
// asked again when its answer's TTL runs out, clamped to [refresh_min, refresh_max]:
//
//   asking --answer--> good set (refresh at TTL) --TTL--> asking
//      \--failure--> held: the last good set serves on, asked again after refresh_min;
//                    `hold` after the last good answer, after_hold: empty drops the set
//
// A failure is anything but a non-empty answer: timeout, SERVFAIL, REFUSED, NXDOMAIN, a name
// without records of the asked family.
//
// Not every address an answer names is used. Refused, per address (address.hpp, the `reason`
// of zcrelay_discovery_refused_total): 0.0.0.0 and :: (Linux connects those to the local
// host), 255.255.255.255, multicast, port 0, and `self`: an address:port the relay itself
// listens on (OwnEndpoints: its listeners, the metrics and health addresses, the runtime API;
// on a wildcard one, every local address at that port). A relay that connects to itself relays
// that connection to itself again, once per client connection, until its fds run out; health
// checks only connect, so they pass. It happens when a Service selects the relay's own pods.
// The rest of the answer is used; an answer with nothing left is `no_records`, a failure like
// an empty one: the last good set serves on for `hold`. What is refused is logged when it
// changes, not on every refresh. When a cluster's set changes, the thread publishes it
// (the caller's callback builds a new Runtime generation; runtime.hpp): backends that stay keep
// their state, new connections see the new set, live ones finish on the backend they have.
//
// c-ares does what resolv.conf promises: its search domains and ndots (Kubernetes' short
// names), its nameservers unless resolvers.nameservers lists others, and TCP when an answer
// comes back truncated (no EDNS is sent, so more than 512 bytes of records always does).
#include <array>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tl/expected.hpp>
#include <vector>

#include "address.hpp"
#include "config.hpp"

namespace zcrelay {

// How one resolution of a cluster's name ended: the `outcome` label.
#define ZCRELAY_DISCOVERY_OUTCOMES(X)                                                             \
    X(Success, "success")         /* a non-empty set of backends */                               \
    X(NxDomain, "nxdomain")       /* the name does not exist */                                   \
    X(NoData, "no_records")       /* it exists, without records of the family (or SRV targets) */ \
    X(ServFail, "servfail")       /* the server could not answer */                               \
    X(Refused, "refused")         /* the server refused to answer */                              \
    X(Timeout, "timeout")         /* no answer from any nameserver, every attempt */              \
    X(Unreachable, "unreachable") /* no nameserver gave a usable answer: see below */             \
    X(Error, "error")             /* anything else: a malformed answer, no nameserver, memory */

// `unreachable`: every nameserver refused the connection (nothing listens on its port) or, with
// c-ares before 1.20 (Debian 12 has 1.18.1), answered SERVFAIL or REFUSED: those versions drop
// such an answer to try the next nameserver and, with none left, end the query as "connection
// refused", so `servfail` and `refused` are counted only with c-ares 1.20 or later. Making
// c-ares hand them over (ARES_FLAG_NOCHECKRESP) would also turn off its check that an answer's
// question is the one asked, a guard against spoofed answers: a label is not worth that.
#define ZCRELAY_DISCOVERY_ITEM(name, label) name,
#define ZCRELAY_DISCOVERY_LABEL(name, label) label,
enum class DiscoveryOutcome : uint8_t { ZCRELAY_DISCOVERY_OUTCOMES(ZCRELAY_DISCOVERY_ITEM) kCount };
inline constexpr std::array<std::string_view, static_cast<size_t>(DiscoveryOutcome::kCount)>
    kDiscoveryOutcomeLabels{ZCRELAY_DISCOVERY_OUTCOMES(ZCRELAY_DISCOVERY_LABEL)};
#undef ZCRELAY_DISCOVERY_ITEM
#undef ZCRELAY_DISCOVERY_LABEL

// Where the relay itself listens, each with what sets it ("listeners[0].listen",
// "metrics.listen"): a DNS answer naming one of these is refused (`self`). Bound addresses: a
// port 0 is what the kernel picked.
struct OwnEndpoint {
    std::string what;
    SocketAddress address;
    bool operator==(const OwnEndpoint&) const = default;
};
using OwnEndpoints = std::vector<OwnEndpoint>;

// The backends each discovered cluster has now, by cluster name (Runtime::build takes them).
using DiscoveredSets = std::map<std::string, std::vector<BackendConfig>>;

// What one cluster's discovery looks like from outside the thread: metrics, the admin API.
struct DiscoveryView {
    DiscoveryConfig spec;
    std::vector<BackendConfig> backends;  // the set in use (sorted by address)
    bool answered = false;  // a first resolution ended (either way) since start or reload
    std::array<uint64_t, static_cast<size_t>(DiscoveryOutcome::kCount)> results{};
    int64_t last_success_unix_ms = 0;  // 0: never
    uint64_t changes = 0;              // times the set changed
    // Addresses answers named that were refused, by reason: summed over answers, and in the
    // last answer.
    std::array<uint64_t, static_cast<size_t>(BackendRefusal::kCount)> refused{};
    std::array<uint64_t, static_cast<size_t>(BackendRefusal::kCount)> refused_now{};
    DiscoveryOutcome last = DiscoveryOutcome::Success;
    // "resolving" (no answer yet), "ok", "holding" (failing, last good set in use), "expired"
    // (failing past hold: empty, or kept with after_hold: keep).
    std::string state = "resolving";
};

class Discovery {
  public:
    // Starts the thread and asks every discovered cluster of `config` at once; answers are
    // judged against `own` from the first. `changed` runs on the discovery thread after a
    // cluster's set changed (never with a lock held here).
    static tl::expected<std::unique_ptr<Discovery>, std::string> start(
        const Config& config, OwnEndpoints own, std::function<void()> changed);
    ~Discovery();
    Discovery(const Discovery&) = delete;
    Discovery& operator=(const Discovery&) = delete;

    // Waits until every cluster has its first answer or `bound` passed. Returns the errors of
    // clusters with startup: fail whose name did not resolve ("" when none), one per line:
    //   cluster web: discovery of web.test (A/AAAA) failed: nxdomain (startup: fail)
    std::string awaitFirstAnswers(Duration bound);
    // A reload: clusters whose name and settings are unchanged keep their set; new or changed
    // ones start over (asked at once); the channel is rebuilt from `config.resolvers` (and
    // resolv.conf read again). `own`: where the relay listens under `config`; a set backend
    // that is one of them now leaves the sets at once (sets() no longer has it).
    void reconfigure(const Config& config, OwnEndpoints own);
    // Where the relay listens changed without a reload (an endpoint bound at port 0 after
    // start): as in reconfigure(), and, when it changed, every name is asked again at once.
    // Any thread.
    void setOwnEndpoints(OwnEndpoints own);
    // The current sets; and a counter that moves with every change of them.
    DiscoveredSets sets() const;
    uint64_t version() const;
    // By cluster name.
    std::map<std::string, DiscoveryView> views() const;
    // The bound a first answer takes at most with these resolver settings.
    static Duration firstAnswerBound(const ResolversConfig& r);

  private:
    struct Entry;
    struct Query;
    class Channel;

    explicit Discovery(std::function<void()> changed);
    void run();
    void apply(const Config& config);
    void ask(Entry& e);
    void askTargets(Entry& e, std::vector<struct SrvTarget> targets, uint32_t ttl);
    void answered(Entry& e, DiscoveryOutcome outcome, std::vector<BackendConfig> found,
                  uint32_t ttl);
    void expireHolds(int64_t now_ms);
    // The set of `e` changes: logged, in its view, the version moves; publish() then tells
    // the callback. record() is publish() with mutex_ held and without the callback.
    void publish(Entry& e, std::vector<BackendConfig> set, const char* why);
    void record(Entry& e, std::vector<BackendConfig> set, const char* why);
    int64_t nextWakeMs() const;
    // Takes the addresses `own_` refuses out of every view's set. mutex_ held. True if any left.
    bool dropOwnLocked();
    // Removes the refused addresses from `found`, counts them in the view, logs them when they
    // differ from the last answer's.
    void refuse(Entry& e, std::vector<BackendConfig>& found);

    std::function<void()> changed_;
    mutable std::mutex mutex_;  // guards views_, version_, pending_, own_, reask_
    OwnEndpoints own_;
    uint64_t own_version_ = 0;  // moves with own_
    bool reask_ = false;        // setOwnEndpoints() -> the thread: ask every name again
    std::condition_variable answered_cv_;
    std::map<std::string, DiscoveryView> views_;
    uint64_t version_ = 0;
    std::unique_ptr<Config> pending_;  // reconfigure() -> the thread
    bool stop_ = false;
    int wake_fd_ = -1;

    // The thread's own.
    std::unique_ptr<Channel> channel_;
    std::vector<std::unique_ptr<Entry>> entries_;
    std::thread thread_;
};

std::string_view label(DiscoveryOutcome o);

}  // namespace zcrelay
