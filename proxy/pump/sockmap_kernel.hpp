#pragma once
// The in-kernel data path, its kernel side: both sockets of a connection in the SOCKHASH of
// bpf/relay.bpf.c, the bytes redirected from one's receive path to the other's egress without
// waking user space, and the questions user space asks the kernel about those sockets. What
// the kernel does that forces each step (measured on 6.18, checked by tests/kernel/sockmap_*;
// bpf/relay_shared.h has the records; sockmap_pump.hpp is the state machine on top):
//
// Set-up (setUpPair):
//   - Only ESTABLISHED sockets may enter the map, so a client that already sent its FIN (a
//     request and SHUT_WR before the upstream answered) is relayed by splice instead.
//   - Links go in before sockets, the client's socket before the upstream's. A verdict runs
//     only on a socket already in the map; if its peer is not in yet, the program passes the
//     bytes instead (see "passed bytes"). The client's early bytes are meant to take that way:
//     see setUpPair() for the window update a redirect from the kick fails to send.
//   - Bytes that arrived before insertion sit in the receive queue and run through the
//     verdict only when the next segment arrives: a request waiting for its answer would wait
//     forever. A recv(MSG_PEEK) runs the queue through the verdict in order
//     (tcp_bpf_recvmsg_parser() calls tcp_data_ready()) and, since it takes the socket lock,
//     also waits out a verdict still running in softirq.
// Relaying: the worker watches each source for POLLRDHUP only. POLLIN would wake it once per
//   redirected skb (every redirect still calls the socket's saved data_ready): ~0.7 CPU s/GiB
//   of wake-ups that find nothing to read.
// Passed bytes: when the peer is missing or too much is in flight towards it, the program
//   leaves bytes on their socket, in order, and keeps doing so until user space has moved them
//   all (record.consumed == record.passed). The worker notices (the program writes the record's
//   index into the worker's wake-up ring as it starts passing, or the peek at EOF), waits until
//   the peer has queued everything redirected before
//   them (checkQueued), then moves them by copy; the kernel path resumes on its own after.
// FIN: a FIN is not redirected. After POLLRDHUP, a peek returning 0 confirms the end of the
//   stream (checkEof); shutdown(dst, SHUT_WR) must then wait until every byte src received
//   has left the psock's backlog for dst's send queue (checkFinBarrier). Shutting down at once
//   delivered 28-83 MB of 100 MiB.
// max_connection_duration: shutdown(SHUT_RD) does not stop TCP from taking what the peer still
//   sends, and the program would go on redirecting it, so "every byte src received" never
//   stops growing and the FIN barrier may never be met, or be met between two skbs and drop
//   the next, already counted (the download test, 2 runs in 15 under ASan before
//   stopRedirecting). stopRedirecting() makes the program pass from then on; the FIN then
//   waits for what was redirected and copied instead (checkQueued).
// Teardown: both sockets leave the map before close(). A read that returns EPIPE on a socket
//   whose writing side is already shut down is the psock's failed late send, not an error.
// Mid-stream: a connection relayed by splice may enter the map (mode auto's promotion: the
//   set-up above, with the records starting from what splice wrote, queuedOn()), but never
//   leave it while it relays: passed bytes are invisible to splice(), and a socket taken out
//   mid-stream keeps a stale read sequence or loses an skb to a verdict running meanwhile
//   (proxy/kernel.md, "Sockmap: leaving and entering mid-stream").
#include <cstdint>

#include "data_path.hpp"
#include "reasons.hpp"
#include "sockmap.hpp"

namespace zcrelay {

// A connection's two sockets as the maps know them: [0] the client's, [1] the upstream's.
struct SockmapPair {
    Sockmap* map = nullptr;           // the maps they are in (setUpPair's, or adopted ones)
    uint64_t cookie[2] = {0, 0};      // SO_COOKIE of each socket, its key in the maps
    bool linked[2] = {false, false};  // the socket has an entry in zcr_links
    bool in_map[2] = {false, false};  // the socket is in the SOCKHASH
    uint32_t record = 0;              // the index of the client socket's record; +1 upstream's

    bool any() const { return linked[0] || linked[1]; }
};

struct PairSetUp {
    bool fell_back = false;  // reason says why; path[] is set either way
    SockmapFallback reason = SockmapFallback::NotEstablished;
    DataPath path[2] = {DataPath::Sockmap, DataPath::Sockmap};  // per direction
};

// Links and inserts the sockets fd[0] (client) and fd[1] (upstream) (records index_base,
// index_base + 1, each allowing `limit` bytes in flight) and says each direction's path:
// Sockmap, or Splice/Copy where the kernel would not take it. `sent_before[d]`: bytes user
// space already wrote on direction d's destination (fd[1 - d]): a PROXY header, early bytes,
// or everything a connection promoted from splice moved before. Every socket it linked is
// marked in pair.linked / pair.in_map and must go through tearDownPair() before close().
PairSetUp setUpPair(Sockmap& map, SockmapPair& pair, const int (&fd)[2], uint32_t index_base,
                    uint64_t limit, const uint64_t (&sent_before)[2] = {0, 0});

// Takes the pair's sockets out of the maps. Idempotent.
void tearDownPair(Sockmap& map, SockmapPair& pair);

// Whether the program marked the stream of the socket with record `index` beyond repair
// (ZCR_BROKEN).
inline bool recordBroken(Sockmap& map, uint32_t index) {
    return (loadRelaxed(map.record(index).flags) & ZCR_BROKEN) != 0;
}
// The same for a pair's linked sockets; `side` gets which socket's (0 client, 1 upstream).
bool pairBroken(Sockmap& map, const SockmapPair& pair, int& side);

struct SockmapEof {
    enum Kind : uint8_t {
        Eof,     // src's stream ended; every byte before the FIN went through the verdict
        Passed,  // src has passed bytes waiting for user space: move them first
        Again,   // the receive queue could not be run through the verdict yet: ask again
        Failed,  // error, an errno
    };
    Kind kind = Eof;
    int error = 0;
};

// After POLLRDHUP on src. `src_write_shut`: src's own writing side is already shut down, so
// an EPIPE there is the teardown artefact, not a broken stream.
SockmapEof checkEof(int src, bool src_write_shut);

struct SockmapBarrier {
    enum Kind : uint8_t { Done, Wait, Failed };
    Kind kind = Wait;
    bool on_src = false;     // Failed: which socket
    int error = 0;           // Failed: errno
    uint64_t remaining = 0;  // Wait: bytes not queued on dst yet
};

// What `fd` has queued so far: bytes sent - retransmitted + not yet sent (0 if TCP_INFO fails).
uint64_t queuedOn(int fd);
// Whether dst has queued (sent - retransmitted + not yet sent) at least `bytes`. One
// getsockopt(TCP_INFO); a reset dst fails at once rather than waiting for the idle timeout.
SockmapBarrier checkQueued(int dst, uint64_t bytes);
// After checkEof said Eof: whether dst has queued every byte src received, so a FIN written
// now comes after all of them. bytes_received is the kernel's count, independent of ours;
// `src_skipped` of them never went to dst, and dst carries `dst_extra` bytes of our own before
// them (the PROXY headers taken and sent).
SockmapBarrier checkFinBarrier(int src, int dst, uint64_t src_skipped = 0, uint64_t dst_extra = 0);
// Sets the stop field of src's record (`index`): the program passes every skb of src from now
// on. When it returns, no verdict that missed the field is still running, so the record's
// redirected count is final.
void stopRedirecting(Sockmap& map, uint32_t index, int src);

}  // namespace zcrelay
