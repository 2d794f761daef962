#include "sockmap.hpp"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstring>

#include "log.hpp"
#include "relay.skel.h"

namespace zcrelay {
namespace {

// libbpf narrates every step on stderr by default; its warnings and errors become our log
// lines (the verifier's log among them), its chatter is dropped.
int libbpfPrint(libbpf_print_level level, const char* fmt, va_list args) {
    if (level == LIBBPF_DEBUG) return 0;
    char line[512];
    int n = vsnprintf(line, sizeof line, fmt, args);
    if (n > 0 && line[std::min<size_t>(n, sizeof line - 1) - 1] == '\n')
        line[std::min<size_t>(n, sizeof line - 1) - 1] = '\0';
    LOG_WARN("libbpf: %s", line);
    return 0;
}

std::string failure(const char* step, int err) {
    return std::string(step) + ": " + std::strerror(err < 0 ? -err : err);
}

uint32_t mapId(int fd) {
    bpf_map_info info{};
    uint32_t len = sizeof info;
    return bpf_obj_get_info_by_fd(fd, &info, &len) == 0 ? info.id : 0;
}

}  // namespace

tl::expected<std::unique_ptr<Sockmap>, std::string> Sockmap::load(uint32_t capacity, Attach attach,
                                                                  uint32_t workers,
                                                                  uint32_t records_per_worker) {
    libbpf_set_print(libbpfPrint);
    std::unique_ptr<Sockmap> s(new Sockmap());
    s->capacity_ = capacity;
    workers = std::max<uint32_t>(workers, 1);
    if (records_per_worker == 0) records_per_worker = (capacity + workers - 1) / workers;
    s->skel_ = relay_bpf::open();
    if (!s->skel_) return tl::unexpected(failure("opening the BPF object", errno));
    relay_bpf* skel = s->skel_;
    for (bpf_map* m : {skel->maps.zcr_socks, skel->maps.zcr_links, skel->maps.zcr_stats}) {
        if (int err = bpf_map__set_max_entries(m, capacity); err != 0)
            return tl::unexpected(failure("sizing the BPF maps", err));
    }
    for (bpf_map* m : {skel->maps.zcr_wake, skel->maps.zcr_wake_lost}) {
        if (int err = bpf_map__set_max_entries(m, workers); err != 0)
            return tl::unexpected(failure("sizing the BPF wake-up maps", err));
    }
    skel->rodata->zcr_records_per_worker = records_per_worker;
    if (int err = relay_bpf::load(skel); err != 0)
        return tl::unexpected(failure("loading the BPF program", err));
    s->socks_fd_ = bpf_map__fd(skel->maps.zcr_socks);
    s->links_fd_ = bpf_map__fd(skel->maps.zcr_links);

    // One ring per worker, put in the outer map before any socket can run the verdict.
    for (uint32_t w = 0; w < workers; ++w) {
        int fd = bpf_map_create(BPF_MAP_TYPE_RINGBUF, "zcr_wake_ring", 0, 0, ZCR_WAKE_RING_BYTES,
                                nullptr);
        if (fd < 0) return tl::unexpected(failure("creating a wake-up ring", errno));
        s->wake_fds_.push_back(fd);
        if (bpf_map_update_elem(bpf_map__fd(skel->maps.zcr_wake), &w, &fd, BPF_ANY) != 0)
            return tl::unexpected(failure("filling the wake-up rings' map", errno));
    }
    size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    s->wake_lost_bytes_ = (sizeof(uint64_t) * workers + page - 1) / page * page;
    void* lost = mmap(nullptr, s->wake_lost_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED,
                      bpf_map__fd(skel->maps.zcr_wake_lost), 0);
    if (lost == MAP_FAILED) return tl::unexpected(failure("mapping the wake-up counts", errno));
    s->wake_lost_ = static_cast<uint64_t*>(lost);

    // BPF_F_MMAPABLE: the array's pages are shared with us; the kernel rounds each value up
    // to 8 bytes, which zcr_sock_stats already is.
    static_assert(sizeof(zcr_sock_stats) % 8 == 0);
    s->records_bytes_ = (sizeof(zcr_sock_stats) * capacity + page - 1) / page * page;
    void* mem = mmap(nullptr, s->records_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED,
                     bpf_map__fd(skel->maps.zcr_stats), 0);
    if (mem == MAP_FAILED) return tl::unexpected(failure("mapping the BPF counters", errno));
    s->records_ = static_cast<zcr_sock_stats*>(mem);

    // libbpf 1.1 has no bpf_program__attach_sockmap(): the program is attached to the map
    // with the bare syscall, and detached the same way.
    s->attach_type_ =
        attach == Attach::StreamVerdict ? BPF_SK_SKB_STREAM_VERDICT : BPF_SK_SKB_VERDICT;
    if (bpf_prog_attach(bpf_program__fd(skel->progs.zcr_verdict), s->socks_fd_,
                        static_cast<bpf_attach_type>(s->attach_type_), 0) != 0) {
        s->attach_type_ = -1;
        return tl::unexpected(failure("attaching the verdict to the SOCKHASH", errno));
    }
    return s;
}

Sockmap::~Sockmap() {
    if (attach_type_ >= 0)
        bpf_prog_detach2(bpf_program__fd(skel_->progs.zcr_verdict), socks_fd_,
                         static_cast<bpf_attach_type>(attach_type_));
    if (records_) munmap(records_, records_bytes_);
    if (wake_lost_) munmap(wake_lost_, wake_lost_bytes_);
    for (int fd : wake_fds_) ::close(fd);
    // Closing the maps frees them only once no socket is left in them: a socket still inside
    // holds the SOCKHASH, and keeps redirecting with the verdict it was inserted with (the
    // detach above notwithstanding), until it leaves the map or closes (proxy/kernel.md, "A
    // SOCKHASH outlives its loader"). The workers take every socket out before they close it.
    if (skel_) relay_bpf::destroy(skel_);
}

Result<void> Sockmap::link(uint64_t cookie, uint64_t peer_cookie, uint32_t index, uint64_t limit,
                           uint64_t sent_before) {
    // No verdict runs for this record until the socket is inserted, after the update below.
    zcr_sock_stats& r = records_[index];
    storeRelaxed(r.redirected, __u64{0});
    storeRelaxed(r.passed, __u64{0});
    storeRelaxed(r.consumed, __u64{0});
    storeRelaxed(r.limit, __u64{limit});
    storeRelaxed(r.replayed, __u64{0});
    storeRelaxed(r.sent_before, __u64{sent_before});
    storeRelaxed(r.skip_head, __u32{0});
    storeRelaxed(r.skip_tail, __u32{0});
    storeRelaxed(r.next_seq, __u32{0});
    storeRelaxed(r.flags, __u32{0});
    storeRelaxed(r.stop, __u32{0});
    zcr_link l{peer_cookie, index, 0};
    if (bpf_map_update_elem(links_fd_, &cookie, &l, BPF_ANY) != 0)
        return sysError("bpf_map_update_elem(zcr_links)");
    return {};
}

Result<void> Sockmap::insert(int fd, uint64_t cookie) {
    uint64_t value = static_cast<uint64_t>(fd);
    if (bpf_map_update_elem(socks_fd_, &cookie, &value, BPF_NOEXIST) != 0)
        return sysError("bpf_map_update_elem(zcr_socks)");
    return {};
}

void Sockmap::remove(uint64_t cookie, bool inserted) {
    if (inserted) bpf_map_delete_elem(socks_fd_, &cookie);
    bpf_map_delete_elem(links_fd_, &cookie);
}

uint32_t Sockmap::socksMapId() const { return mapId(socks_fd_); }
uint32_t Sockmap::linksMapId() const { return mapId(links_fd_); }

Result<uint64_t> socketCookie(int fd) {
    uint64_t cookie = 0;
    socklen_t len = sizeof cookie;
    if (::getsockopt(fd, SOL_SOCKET, SO_COOKIE, &cookie, &len) != 0)
        return sysError("getsockopt(SO_COOKIE)");
    return cookie;
}

}  // namespace zcrelay
