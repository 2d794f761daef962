#pragma once
// The one owner of the loaded sockmap program (bpf/relay.bpf.c): its skeleton, its three maps,
// the attachment of the verdict to the SOCKHASH, and the mmap() of the per-socket counters.
// One per process, shared by the workers: map updates are syscalls, safe from any thread, and
// each worker only touches the records of its own range of indexes. A relay that adopted
// sockmap connections at a handover (handover.hpp) holds one more per relay it took them from:
// that relay's maps, adopted by their fds, with the program it loaded still attached.
//
// What the kernel does with a socket in the SOCKHASH is in pump/sockmap_kernel.hpp.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "result.hpp"
#include "unique_fd.hpp"

extern "C" {
#include "relay_shared.h"
}

struct relay_bpf;

namespace zcrelay {

class Sockmap {
  public:
    // Which attach point runs the verdict. With no stream parser both end up in the same
    // kernel path (sock_map_link() starts sk_psock_start_verdict() for either), so this only
    // exists to measure that they do; StreamVerdict is what ships.
    enum class Attach : uint8_t { StreamVerdict, SkbVerdict };

    // Opens, sizes (`capacity` sockets, two per connection), loads and attaches the program,
    // with one wake-up ring per worker: `workers` of them, worker w owning the records
    // [w * records_per_worker, (w + 1) * records_per_worker). Fails without CAP_BPF +
    // CAP_NET_ADMIN, or on a kernel without sockmap; the error names the step.
    static tl::expected<std::unique_ptr<Sockmap>, std::string> load(
        uint32_t capacity, Attach attach, uint32_t workers = 1, uint32_t records_per_worker = 0);
    // The maps of another relay's program, passed with SCM_RIGHTS (shareFds() there): its
    // sockets keep running the verdict they were inserted with, and this process reads and
    // writes their records as that relay did. `rings` wake-up rings, one per worker that relay
    // had, each records_per_worker records; the rings' fds come one by one (adoptRing). Fails,
    // naming the map, when a map is not what this build's program would have made (another
    // record layout: layout() differs).
    struct Fds {
        UniqueFd socks, links, stats, wake_lost;
    };
    static tl::expected<std::unique_ptr<Sockmap>, std::string> adopt(Fds fds, uint32_t rings,
                                                                     uint32_t records_per_worker);
    // Ring `ring`'s fd, for an adopted map set; false if it is not a ring buffer, or out of range.
    tl::expected<void, std::string> adoptRing(uint32_t ring, UniqueFd fd);
    ~Sockmap();
    Sockmap(const Sockmap&) = delete;
    Sockmap& operator=(const Sockmap&) = delete;

    uint32_t capacity() const { return capacity_; }
    // The worker ring whose range holds record `index`, and how many there are.
    uint32_t ringOf(uint32_t index) const { return index / records_per_worker_; }
    uint32_t recordsPerWorker() const { return records_per_worker_; }
    uint32_t rings() const { return static_cast<uint32_t>(wake_fds_.size()); }
    // What the records and links look like, for a handover: a relay adopts another's maps only
    // if this is the same in both builds.
    static std::string layout();
    // The maps' fds, to pass to another relay (adopt() there); they stay this process's.
    int linksFd() const { return links_fd_; }
    int statsFd() const { return stats_fd_; }
    int wakeLostFd() const { return wake_lost_fd_; }

    // Record `index` starts from zero and the socket `cookie` will redirect to `peer_cookie`,
    // with at most `limit` bytes in flight towards it, of which user space wrote `sent_before`
    // itself (relay_shared.h). Must precede insert(): the program finds its way through this
    // entry.
    Result<void> link(uint64_t cookie, uint64_t peer_cookie, uint32_t index, uint64_t limit,
                      uint64_t sent_before);
    // Puts the socket in the SOCKHASH. From here on every skb it receives runs the verdict.
    // Fails with EOPNOTSUPP unless the socket is ESTABLISHED (e.g. the peer already sent FIN).
    Result<void> insert(int fd, uint64_t cookie);
    // Takes the socket out of the SOCKHASH (if `inserted`) and drops its link. Before close():
    // the kernel would do the first at close too, but the link entry is ours to delete.
    void remove(uint64_t cookie, bool inserted);

    zcr_sock_stats& record(uint32_t index) { return records_[index]; }

    // Worker `w`'s wake-up ring (relay.bpf.c: a record index each time a socket starts passing
    // bytes or breaks): poll its fd for POLLIN, then read it with libbpf's ring_buffer.
    int wakeRingFd(uint32_t w) const { return wake_fds_[w].get(); }
    // Wake-ups the program could not write into worker `w`'s ring because it was full.
    uint64_t wakeLost(uint32_t w) const {
        return __atomic_load_n(&wake_lost_[w], __ATOMIC_RELAXED);
    }

    // Kernel-side ids: the SOCKHASH's names the map set in a handover; the rest are for tests
    // that inspect the maps from outside.
    uint32_t socksMapId() const;
    uint32_t linksMapId() const;
    // The SOCKHASH's fd: what another process must hold for the program to keep redirecting
    // once this one is gone (keepAttached()).
    int socksFd() const { return socks_fd_; }
    // Another process holds the SOCKHASH now (a dup of socksFd(), passed with SCM_RIGHTS): the
    // destructor closes this process's fds without detaching the verdict, which stays attached
    // while any fd of the SOCKHASH is open (proxy/kernel.md, "A SOCKHASH outlives its loader").
    // A process that exits without destructors (killed) leaves it attached the same way.
    // Any worker may call it, at a handover.
    void keepAttached() { attach_type_.store(-1); }

  private:
    Sockmap() = default;
    // Maps the records and the wake-up counts (both BPF_F_MMAPABLE arrays).
    tl::expected<void, std::string> mapShared(uint32_t workers);

    relay_bpf* skel_ = nullptr;  // null for an adopted map set, whose fds are owned_
    UniqueFd owned_[4];          // adopted: socks, links, stats, wake_lost
    zcr_sock_stats* records_ = nullptr;
    size_t records_bytes_ = 0;
    uint32_t capacity_ = 0;
    uint32_t records_per_worker_ = 1;
    std::atomic<int> attach_type_{-1};
    int socks_fd_ = -1;
    int links_fd_ = -1;
    int stats_fd_ = -1;
    int wake_lost_fd_ = -1;
    std::vector<UniqueFd> wake_fds_;
    uint64_t* wake_lost_ = nullptr;
    size_t wake_lost_bytes_ = 0;
};

// The socket's cookie (SO_COOKIE): the key the program knows a socket by.
Result<uint64_t> socketCookie(int fd);

// Relaxed loads and stores on the shared records: the program writes them from softirq on any
// CPU; a 64-bit aligned load never tears on the architectures Linux runs BPF on.
template <typename T>
inline T loadRelaxed(const T& v) {
    return __atomic_load_n(&v, __ATOMIC_RELAXED);
}
template <typename T>
inline void storeRelaxed(T& v, T x) {
    __atomic_store_n(&v, x, __ATOMIC_RELAXED);
}

}  // namespace zcrelay
