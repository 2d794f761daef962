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
	if (st->pass) {
		__sync_fetch_and_add(&st->passed, skb->len);
		return SK_PASS;
	}
	/* Fails only while the peer is not (yet, or any more) in zcr_socks: the insertion
	 * window, or teardown. bpf_sk_redirect_hash() then returns SK_DROP, and returning it would
	 * lose bytes TCP has already acknowledged. Pass instead, and keep passing: this socket's
	 * bytes now all go through user space, in order. */
	if (bpf_sk_redirect_hash(skb, &zcr_socks, &link->peer_cookie, 0) != SK_PASS) {
		st->pass = 1;
		__sync_fetch_and_add(&st->passed, skb->len);
		return SK_PASS;
	}
	__sync_fetch_and_add(&st->redirected, skb->len);
	return SK_PASS;
}

char LICENSE[] SEC("license") = "GPL";
