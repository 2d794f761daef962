// SPDX-License-Identifier: GPL-2.0
/* The in-kernel data path of `mode: sockmap`, the Linux analogue of OpenBSD/FreeBSD SO_SPLICE.
 *
 * Both sockets of a relayed connection sit in zcr_socks. Every skb that arrives on either runs
 * zcr_verdict in softirq (or in the socket owner's release_sock), which queues it on the
 * peer's egress; a psock worker then sends it. User space sees none of these bytes: it reads
 * the counters in zcr_stats, and handles FIN, RST and teardown itself. */
#include <linux/bpf.h>
#include <stdbool.h>
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

/* Wake-ups for user space: one ring buffer per worker (sized and filled in by user space before
 * the sockets come), into which the program writes a socket's record index when that socket
 * needs the worker: it starts passing bytes, or its stream is marked broken. A worker polls its
 * ring's fd and sleeps otherwise, so an idle connection costs it nothing. */
struct zcr_wake_ring {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, ZCR_WAKE_RING_BYTES);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 1); /* one per worker, sized by user space before load */
	__type(key, __u32);
	__array(values, struct zcr_wake_ring);
} zcr_wake SEC(".maps");

/* Wake-ups a full ring refused, per worker: the worker then looks at all its records. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} zcr_wake_lost SEC(".maps");

/* Records per worker: record index / this = the worker whose ring is woken. Set before load. */
const volatile __u32 zcr_records_per_worker = 1;

static __always_inline void wake(__u32 index)
{
	__u32 worker = index / zcr_records_per_worker;
	void *ring = bpf_map_lookup_elem(&zcr_wake, &worker);
	if (ring && bpf_ringbuf_output(ring, &index, sizeof(index), 0) == 0)
		return;
	__u64 *lost = bpf_map_lookup_elem(&zcr_wake_lost, &worker);
	if (lost)
		__sync_fetch_and_add(lost, 1);
}

/* A tcp_sock, only the fields read here: CO-RE relocates the offsets against the running
 * kernel's BTF at load time, so no vmlinux.h is needed. */
struct tcp_sock {
	__u64 bytes_acked;
	__u32 copied_seq;
} __attribute__((preserve_access_index));

/* The kernel's skb behind the program's context, for TCP_SKB_CB(skb)->seq: the first 4 bytes
 * of cb[] in struct tcp_skb_cb, untouched by the sockmap's own use of cb. */
struct sk_buff {
	char cb[48];
} __attribute__((preserve_access_index));

extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

/* A load the compiler may not merge with an earlier one or move before the atomic add above it. */
#define READ_ONCE_U64(x) (*(volatile __u64 *)&(x))

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
	/* bytes_acked counts the peer's SYN (and later its FIN) as one byte each. */
	__u64 sent = st->sent_before + st->redirected + st->consumed + 1;
	*in_flight = sent > acked ? sent - acked : 0;
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
	if (skb->len == 0)
		return SK_DROP;
	/* On 6.18, once bytes have been passed to a socket, the verdict sometimes gets an skb
	 * whose first bytes it already handled: a larger skb (built when the receive queue is
	 * collapsed) starting at the last passed skb's sequence number, so 65483 bytes arrived
	 * twice at the peer in 1 connection of ~150 with heavy passing (measured). Verdicts of one
	 * socket run one at a time, in stream order, so the sequence number tells. A whole
	 * replay is dropped. A partial one is passed, and user space skips its first skip_len
	 * bytes at offset skip_at of the passed bytes. A gap, or a second overlap before the
	 * first was skipped, cannot be made exact: the stream is marked broken and reset. */
	struct sk_buff *kskb = bpf_cast_to_kern_ctx(skb);
	__u32 seq = 0;
	bool overlap = false;
	bpf_probe_read_kernel(&seq, sizeof(seq), kskb->cb);
	if (!(st->flags & ZCR_SEQ_VALID)) {
		/* The first verdict. User space may have read bytes before the socket entered the
		 * map (a PROXY header it took), and tcp_read_skb() hands over the whole skb at the
		 * head of the receive queue, the part already read included. Starting from the
		 * socket's read position makes those bytes a replay, which user space skips. */
		struct bpf_sock *self = bpf_map_lookup_elem(&zcr_socks, &cookie);
		if (self) {
			struct tcp_sock *tp = bpf_skc_to_tcp_sock(self);
			if (tp) {
				__u32 copied = tp->copied_seq;
				if ((__s32)(copied - seq) > 0) {
					st->next_seq = copied;
					st->flags |= ZCR_SEQ_VALID;
				}
			}
			bpf_sk_release(self);
		}
	}
	if (st->flags & ZCR_SEQ_VALID) {
		__s32 gap = (__s32)(seq - st->next_seq);
		if (gap < 0) {
			__u32 seen = (__u32)(-gap);
			__sync_fetch_and_add(&st->replayed, 1);
			if (seen >= skb->len)
				return SK_DROP;
			__u32 tail = st->skip_tail;
			if (tail - st->skip_head >= ZCR_SKIPS) {
				st->flags |= ZCR_BROKEN;
				wake(link->index);
			} else {
				st->skip_at[tail & (ZCR_SKIPS - 1)] = st->passed;
				st->skip_len[tail & (ZCR_SKIPS - 1)] = seen;
				__sync_fetch_and_add(&st->skip_tail, 1); /* after the entry */
			}
			overlap = true;
		} else if (gap > 0) {
			st->flags |= ZCR_BROKEN;
			wake(link->index);
		}
	}
	st->next_seq = seq + skb->len;
	st->flags |= ZCR_SEQ_VALID;
	if (overlap)
		goto pass;

	/* Every pass below keeps the bytes on this socket; an SK_DROP here would lose bytes TCP
	 * has already acknowledged. Once a byte is passed, the ones after it are passed too until
	 * user space has moved them all (consumed == passed), or they would overtake it. */
	__u64 in_flight = 0;
	if (st->consumed != st->passed || peer_in_flight(link, st, &in_flight) != 0 ||
	    in_flight > st->limit)
		goto pass;
	/* Past max_connection_duration user space has shut this socket's reading side: what still
	 * arrives stays here, where it reads what is queued until it finds none, as the copy path
	 * does, and the count of redirected bytes stops moving, so the FIN can wait for exactly
	 * those. Redirecting on would hand the peer a stream with no end to wait for. */
	if (st->stop)
		goto pass;
	/* Fails only while the peer is not in zcr_socks: the insertion window, or teardown. */
	if (bpf_sk_redirect_hash(skb, &zcr_socks, &link->peer_cookie, 0) != SK_PASS)
		goto pass;
	__sync_fetch_and_add(&st->redirected, skb->len);
	return SK_PASS;
pass: {
	/* The first byte passed since user space last caught up wakes its worker; later ones find
	 * it moving them already. The add comes before the look at consumed: user space stores
	 * consumed, fences, then looks at passed before it goes back to waiting
	 * (SockmapPump::redirect), so either it sees this add or this look sees its store. Looking
	 * first lost the race: both read the old values, and 1 MB waited, passed, for a wake-up
	 * that never came (an nc upload of 1 GiB in bench/run). */
	__u64 before = __sync_fetch_and_add(&st->passed, skb->len);
	if (READ_ONCE_U64(st->consumed) == before)
		wake(link->index);
	return SK_PASS;
}
}

char LICENSE[] SEC("license") = "GPL";
