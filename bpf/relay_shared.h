/* Types shared by the sk_skb verdict program (relay.bpf.c) and its C++ owner (proxy/sockmap.*).
 * Plain C with fixed-width kernel types: both clang -target bpf and g++ include it. */
#ifndef ZCRELAY_RELAY_SHARED_H
#define ZCRELAY_RELAY_SHARED_H

#include <linux/types.h>

/* zcr_links: socket cookie -> where its bytes go. Written by user space before the socket
 * enters zcr_socks, deleted after it left; the program only reads it. */
struct zcr_link {
	__u64 peer_cookie; /* key of the peer in zcr_socks: redirect target */
	__u32 index;       /* this socket's record in zcr_stats */
	__u32 pad;
};

/* zcr_stats: one record per relayed socket, in an mmap()ed array, so user space reads the
 * counters with plain loads and never a syscall. Written by the program: redirected, passed,
 * replayed, skip_at, skip_len, skip_tail, next_seq, flags. Written by user space: consumed,
 * limit, skip_head, stop (and all of it at link time, sent_before only then).
 *
 * The program redirects a socket's skb to its peer only while
 *   - the peer is in zcr_socks,
 *   - user space has queued on the peer every byte the program passed (consumed == passed), and
 *   - the bytes in flight towards the peer (sent_before + redirected + consumed - the peer's
 *     bytes_acked)
 *     stay within limit: an egress redirect is charged to no socket, so without this bound a
 *     fast sender and a slow peer pin unbounded kernel memory (712 MiB in 1 s, measured), and
 *   - user space has not set stop (the connection reached max_connection_duration).
 * Otherwise it passes the skb: it stays on this socket (charged to its receive buffer, so the
 * TCP window closes) until user space moves it, in order, behind everything redirected. */
/* Changes whenever a record's or a link's meaning changes: a relay adopts another's maps at a
 * handover only if this (and both sizes) are the same in both builds (Sockmap::layout()). */
#define ZCR_RECORD_LAYOUT 1

#define ZCR_SKIPS 4 /* replayed stretches user space may have pending at once (a power of 2) */

struct zcr_sock_stats {
	__u64 redirected; /* bytes received here and queued on the peer's egress */
	__u64 passed;     /* bytes received here and left on this socket for user space */
	__u64 consumed;   /* of those, bytes user space has queued on the peer (or skipped) */
	__u64 limit;      /* bytes in flight towards the peer before the program passes */
	__u64 replayed;   /* skbs the verdict saw a second time, whole (dropped) or in part */
	/* Bytes user space wrote to the peer before this socket entered the map (a PROXY header,
	 * early bytes, or what splice moved before the connection was promoted), which the peer's
	 * bytes_acked counts too. */
	__u64 sent_before;
	/* Replayed stretches to skip, in stream order: entry i % ZCR_SKIPS for skip_head <= i <
	 * skip_tail holds skip_len[i] bytes at offset skip_at[i] of the passed bytes. The
	 * program appends (skip_tail), user space consumes (skip_head). */
	__u64 skip_at[ZCR_SKIPS];
	__u32 skip_len[ZCR_SKIPS];
	__u32 skip_head;
	__u32 skip_tail;
	__u32 next_seq; /* TCP sequence number after the last byte the verdict handled */
	__u32 flags;    /* ZCR_SEQ_VALID, ZCR_BROKEN */
	/* Non-zero: every skb from now on is passed, none redirected, so redirected is final once
	 * the verdicts running when it was set have ended (see stopRedirecting). Its own field, not
	 * a bit of flags: the program updates flags without an atomic. */
	__u32 stop;
	__u32 pad;
};

/* Bytes of each worker's wake-up ring (zcr_wake): 4-byte record indexes in 16-byte entries,
 * 4,096 wake-ups a worker has not read yet before one is refused (and counted in
 * zcr_wake_lost). */
#define ZCR_WAKE_RING_BYTES (64 * 1024)

#define ZCR_SEQ_VALID 1u /* next_seq is set */
#define ZCR_BROKEN 2u    /* an skb skipped bytes, or too many replays pending: stream lost */

#endif
