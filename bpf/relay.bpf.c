// SPDX-License-Identifier: GPL-2.0
/* The in-kernel data path of `mode: sockmap`, the Linux analogue of OpenBSD/FreeBSD SO_SPLICE.
 *
 * Both sockets of a relayed connection sit in zcr_socks. Every skb that arrives on either runs
 * zcr_verdict in softirq (or in the socket owner's release_sock), which queues it on the
 * peer's egress; a psock worker then sends it. User space sees none of these bytes: it reads
 * the counters in zcr_stats, and handles FIN, RST and teardown itself. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "relay_shared.h"

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 1); /* sized by user space before load */
	__type(key, __u64);     /* socket cookie */
	__type(value, __u64);   /* socket fd on update; the kernel keeps the socket */
} zcr_socks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, __u64);
	__type(value, struct zcr_link);
} zcr_links SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct zcr_sock_stats);
} zcr_stats SEC(".maps");

/* The peer's tcp_sock, only the field read here: CO-RE relocates the offset against the
 * running kernel's BTF at load time, so no vmlinux.h is needed. */
struct tcp_sock {
	__u64 bytes_acked;
} __attribute__((preserve_access_index));

/* Bytes sent towards the peer that its receiver has not acknowledged yet: the psock backlog
 * plus the peer's send queue. The lookup takes a reference on the socket, released at once. */
static __always_inline int peer_in_flight(struct zcr_link *link, struct zcr_sock_stats *st,
					  __u64 *in_flight)
{
	struct bpf_sock *peer = bpf_map_lookup_elem(&zcr_socks, &link->peer_cookie);
	if (!peer)
		return -1;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(peer);
	__u64 acked = tp ? tp->bytes_acked : 0;
	bpf_sk_release(peer);
	*in_flight = st->redirected + st->consumed - acked;
	return 0;
}

SEC("sk_skb")
int zcr_verdict(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	struct zcr_link *link = bpf_map_lookup_elem(&zcr_links, &cookie);
	/* Not a socket we relay (cannot happen: links go in first). Passing keeps the bytes. */
	if (!link)
		return SK_PASS;
	struct zcr_sock_stats *st = bpf_map_lookup_elem(&zcr_stats, &link->index);
	if (!st)
		return SK_PASS;
	/* A FIN-only skb carries no byte. Redirected, it reaches a peer that user space may
	 * already have shut down for writing, and the psock worker's failed send sets EPIPE
	 * on that peer. Dropping it loses nothing: TCP has already recorded the FIN. */
	if (skb->len == 0) {
		__sync_fetch_and_add(&st->zero_len, 1);
		return SK_DROP;
	}
	/* Every pass below keeps the bytes on this socket; an SK_DROP here would lose bytes TCP
	 * has already acknowledged. Once a byte is passed, the ones after it are passed too until
	 * user space has moved them all (consumed == passed), or they would overtake it. */
	__u64 in_flight = 0;
	if (st->consumed != st->passed || peer_in_flight(link, st, &in_flight) != 0 ||
	    in_flight > st->limit)
		goto pass;
	/* Fails only while the peer is not in zcr_socks: the insertion window, or teardown. */
	if (bpf_sk_redirect_hash(skb, &zcr_socks, &link->peer_cookie, 0) != SK_PASS)
		goto pass;
	__sync_fetch_and_add(&st->redirected, skb->len);
	return SK_PASS;
pass:
	__sync_fetch_and_add(&st->passed, skb->len);
	return SK_PASS;
}

char LICENSE[] SEC("license") = "GPL";
