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

// "" if `fd` is a map of `type` with these sizes (value_size 0: any), else what differs.
std::string checkMap(const char* name, int fd, bpf_map_type type, uint32_t key_size,
                     uint32_t value_size, bpf_map_info& info) {
    uint32_t len = sizeof info;
    info = {};
    if (fd < 0 || bpf_obj_get_info_by_fd(fd, &info, &len) != 0)
        return std::string(name) + ": not a BPF map";
    if (info.type != static_cast<uint32_t>(type) || info.key_size != key_size ||
        (value_size != 0 && info.value_size != value_size))
        return std::string(name) + ": type " + std::to_string(info.type) + ", key " +
               std::to_string(info.key_size) + " and value " + std::to_string(info.value_size) +
               " bytes, not what this build's program makes";
    return "";
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
    s->stats_fd_ = bpf_map__fd(skel->maps.zcr_stats);
    s->wake_lost_fd_ = bpf_map__fd(skel->maps.zcr_wake_lost);
    s->records_per_worker_ = records_per_worker;

    // One ring per worker, put in the outer map before any socket can run the verdict.
    for (uint32_t w = 0; w < workers; ++w) {
        int fd = bpf_map_create(BPF_MAP_TYPE_RINGBUF, "zcr_wake_ring", 0, 0, ZCR_WAKE_RING_BYTES,
                                nullptr);
        if (fd < 0) return tl::unexpected(failure("creating a wake-up ring", errno));
        s->wake_fds_.emplace_back(fd);
        if (bpf_map_update_elem(bpf_map__fd(skel->maps.zcr_wake), &w, &fd, BPF_ANY) != 0)
            return tl::unexpected(failure("filling the wake-up rings' map", errno));
    }
    if (auto mapped = s->mapShared(workers); !mapped) return tl::unexpected(mapped.error());

    // libbpf 1.1 has no bpf_program__attach_sockmap(): the program is attached to the map
    // with the bare syscall, and detached the same way.
    const int type =
        attach == Attach::StreamVerdict ? BPF_SK_SKB_STREAM_VERDICT : BPF_SK_SKB_VERDICT;
    if (bpf_prog_attach(bpf_program__fd(skel->progs.zcr_verdict), s->socks_fd_,
                        static_cast<bpf_attach_type>(type), 0) != 0) {
        return tl::unexpected(failure("attaching the verdict to the SOCKHASH", errno));
    }
    s->attach_type_.store(type);
    return s;
}

tl::expected<void, std::string> Sockmap::mapShared(uint32_t workers) {
    size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    wake_lost_bytes_ = (sizeof(uint64_t) * workers + page - 1) / page * page;
    void* lost =
        mmap(nullptr, wake_lost_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, wake_lost_fd_, 0);
    if (lost == MAP_FAILED) return tl::unexpected(failure("mapping the wake-up counts", errno));
    wake_lost_ = static_cast<uint64_t*>(lost);

    // BPF_F_MMAPABLE: the array's pages are shared with us; the kernel rounds each value up
    // to 8 bytes, which zcr_sock_stats already is.
    static_assert(sizeof(zcr_sock_stats) % 8 == 0);
    records_bytes_ = (sizeof(zcr_sock_stats) * capacity_ + page - 1) / page * page;
    void* mem = mmap(nullptr, records_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, stats_fd_, 0);
    if (mem == MAP_FAILED) return tl::unexpected(failure("mapping the BPF counters", errno));
    records_ = static_cast<zcr_sock_stats*>(mem);
    return {};
}

tl::expected<std::unique_ptr<Sockmap>, std::string> Sockmap::adopt(Fds fds, uint32_t rings,
                                                                   uint32_t records_per_worker) {
    std::unique_ptr<Sockmap> s(new Sockmap());
    bpf_map_info info{};
    std::string wrong =
        checkMap("the SOCKHASH", fds.socks.get(), BPF_MAP_TYPE_SOCKHASH, 8, 0, info);
    if (wrong.empty())
        wrong =
            checkMap("the links", fds.links.get(), BPF_MAP_TYPE_HASH, 8, sizeof(zcr_link), info);
    if (wrong.empty())
        wrong = checkMap("the wake-up counts", fds.wake_lost.get(), BPF_MAP_TYPE_ARRAY, 4, 8, info);
    if (wrong.empty() && info.max_entries != rings)
        wrong = "the wake-up counts: " + std::to_string(info.max_entries) + " workers, not " +
                std::to_string(rings);
    if (wrong.empty())
        wrong = checkMap("the records", fds.stats.get(), BPF_MAP_TYPE_ARRAY, 4,
                         sizeof(zcr_sock_stats), info);
    if (wrong.empty() && !(info.map_flags & BPF_F_MMAPABLE)) wrong = "the records: not mappable";
    if (wrong.empty() && (rings == 0 || records_per_worker == 0 ||
                          uint64_t{rings} * records_per_worker < info.max_entries))
        wrong = "the rings do not cover the records";
    if (!wrong.empty()) return tl::unexpected(wrong);
    s->capacity_ = info.max_entries;
    s->records_per_worker_ = records_per_worker;
    s->socks_fd_ = fds.socks.get();
    s->links_fd_ = fds.links.get();
    s->stats_fd_ = fds.stats.get();
    s->wake_lost_fd_ = fds.wake_lost.get();
    s->owned_[0] = std::move(fds.socks);
    s->owned_[1] = std::move(fds.links);
    s->owned_[2] = std::move(fds.stats);
    s->owned_[3] = std::move(fds.wake_lost);
    s->wake_fds_.resize(rings);
    if (auto mapped = s->mapShared(rings); !mapped) return tl::unexpected(mapped.error());
    return s;
}

tl::expected<void, std::string> Sockmap::adoptRing(uint32_t ring, UniqueFd fd) {
    bpf_map_info info{};
    uint32_t len = sizeof info;
    if (ring >= wake_fds_.size())
        return tl::unexpected("ring " + std::to_string(ring) + " of " +
                              std::to_string(wake_fds_.size()));
    if (!fd || bpf_obj_get_info_by_fd(fd.get(), &info, &len) != 0 ||
        info.type != BPF_MAP_TYPE_RINGBUF)
        return tl::unexpected(std::string("ring ") + std::to_string(ring) + ": not a ring buffer");
    wake_fds_[ring] = std::move(fd);
    return {};
}

std::string Sockmap::layout() {
    return std::to_string(ZCR_RECORD_LAYOUT) + "/" + std::to_string(sizeof(zcr_sock_stats)) + "/" +
           std::to_string(sizeof(zcr_link));
}

Sockmap::~Sockmap() {
    if (const int type = attach_type_.load(); type >= 0)
        bpf_prog_detach2(bpf_program__fd(skel_->progs.zcr_verdict), socks_fd_,
                         static_cast<bpf_attach_type>(type));
    if (records_) munmap(records_, records_bytes_);
    if (wake_lost_) munmap(wake_lost_, wake_lost_bytes_);
    wake_fds_.clear();
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
