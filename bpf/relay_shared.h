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
 * counters with plain loads and never a syscall. The program is the only writer of the
 * counters; `pass` is set by either side and never cleared while the socket is in the map. */
struct zcr_sock_stats {
	__u64 redirected; /* bytes received here and queued on the peer's egress */
	__u64 passed;     /* bytes received here and left on this socket for user space */
	__u32 pass;       /* sticky: every later skb is passed too, so the two never interleave */
	__u32 zero_len;   /* FIN-only skbs seen (they carry no byte and are not redirected) */
};

#endif
