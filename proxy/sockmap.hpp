#pragma once
// The one owner of the loaded sockmap program (bpf/relay.bpf.c): its skeleton, its three maps,
// the attachment of the verdict to the SOCKHASH, and the mmap() of the per-socket counters.
// One per process, shared by the workers: map updates are syscalls, safe from any thread, and
// each worker only touches the records of its own range of indexes.
//
// What the kernel does with a socket in the SOCKHASH is in pump/sockmap_kernel.hpp.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "result.hpp"

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
    ~Sockmap();
    Sockmap(const Sockmap&) = delete;
    Sockmap& operator=(const Sockmap&) = delete;

    uint32_t capacity() const { return capacity_; }

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
    int wakeRingFd(uint32_t w) const { return wake_fds_[w]; }
    // Wake-ups the program could not write into worker `w`'s ring because it was full.
    uint64_t wakeLost(uint32_t w) const {
        return __atomic_load_n(&wake_lost_[w], __ATOMIC_RELAXED);
    }

    // Kernel-side ids, for tests that inspect the maps from outside.
    uint32_t socksMapId() const;
    uint32_t linksMapId() const;
    // The SOCKHASH's fd: what another process must hold for the program to keep redirecting
    // once this one is gone (keepAttached()).
    int socksFd() const { return socks_fd_; }
    // Another process holds the SOCKHASH now (a dup of socksFd(), passed with SCM_RIGHTS): the
    // destructor closes this process's fds without detaching the verdict, which stays attached
    // while any fd of the SOCKHASH is open (proxy/kernel.md, "A SOCKHASH outlives its loader").
    // A process that exits without destructors (killed) leaves it attached the same way.
    void keepAttached() { attach_type_ = -1; }

  private:
    Sockmap() = default;

    relay_bpf* skel_ = nullptr;
    zcr_sock_stats* records_ = nullptr;
    size_t records_bytes_ = 0;
    uint32_t capacity_ = 0;
    int attach_type_ = -1;
    int socks_fd_ = -1;
    int links_fd_ = -1;
    std::vector<int> wake_fds_;
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
