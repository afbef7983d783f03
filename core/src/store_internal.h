/*
 * store_internal.h: what the rendezvous store's files share (store_socket.c, store_server.c,
 * store_client.c); private to these files.
 */
#ifndef MS_STORE_INTERNAL_H
#define MS_STORE_INTERNAL_H

#include "store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

/*
 * The rendezvous store of store.h, a TCP key-value store like PyTorch's TCPStore.
 *
 * Why: NCCL needs its unique id (a 128-byte blob made by one rank) on every rank of the
 * world before ncclCommInitRank (other groups are splits of the world's communicator).
 * Under torchrun-style launchers the only thing the ranks share is MASTER_ADDR:MASTER_PORT,
 * so rank 0 serves a store there and every rank talks to it: rank 0 sets the world's key,
 * the others get it.
 *
 * Protocol.  One TCP connection per client; every integer is a big-endian u32.  A client
 * sends one request and reads its reply before sending the next (no pipelining):
 *   request  magic "MSS1" (0x4d535331), op, arg, key_len, value_len, key bytes, value bytes
 *   reply    status (an ms_status), len, then len bytes: the value for a successful GET,
 *            the error's text for any other status, nothing for other successes
 *   op       arg                     key, value               reply
 *   HELLO 1  rank                    -, u32 world size        ok, or why the rank is refused
 *   SET   2  0                       key, value               ok, or the key is already set
 *   GET   3  longest wait in ms      key, -                   the value once set, timeout
 *                                                             or peer_failed
 *   BYE   4  0                       -, -                     ok
 * Keys are 1..255 bytes and values at most 1 MiB; the server checks the header before it
 * allocates anything, and drops a connection that breaks the framing.
 *
 * The server's design: the top of store_server.c.
 *
 * Failures: every client wait has a deadline (connect, send, reply; a GET's own wait is
 * timed by the server, which answers "timeout" at the deadline the client asked for, so
 * the connection stays usable).  A rank whose connection ends without BYE (its process
 * died) is "gone": every GET waiting for a key not yet set, and every later one, is
 * answered peer_failed naming that rank, so its peers fail at once instead of hanging.
 * When the server or the connection fails, the client reports it (server closed the
 * connection, no answer in time, errno text) and refuses later calls with that message.
 * Rank 0's close sends BYE and joins the server thread, which stops once every rank has
 * closed or left, or one timeout after rank 0's BYE.  Sends use MSG_NOSIGNAL (no SIGPIPE)
 * and every call that can see EINTR retries.  Name lookups (getaddrinfo) are retried like
 * connections, but a single lookup is bounded only by the resolver's own timeouts.
 * Nothing is global: several stores, servers included, live in one process.
 */

/* ---------------------------------------------------------------- protocol */

#define STORE_MAGIC 0x4d535331u /* "MSS1": this protocol, version 1 */

enum { OP_HELLO = 1, OP_SET = 2, OP_GET = 3, OP_BYE = 4 };
enum {
    REQ_HDR = 20,        /* magic, op, arg, key_len, value_len */
    REP_HDR = 8,         /* status, len */
    TEXT_MAX = 512,      /* an error reply's text */
    WHERE_MAX = 300,     /* "host:port" */
};

static inline void put_u32(uint8_t *p, uint32_t v) {
    uint32_t be = htonl(v);
    memcpy(p, &be, 4);
}

static inline uint32_t get_u32(const uint8_t *p) {
    uint32_t be;
    memcpy(&be, p, 4);
    return ntohl(be);
}

/* ---------------------------------------------------------------- store_socket.c, both sides */

void ms__sock_set_nodelay(int fd);
/* "10.0.0.2:41234" or "[::1]:41234" for a socket address. */
void ms__sock_addr_str(const struct sockaddr *sa, char *buf, size_t cap);
/* getaddrinfo for TCP on host:port; on failure `why` says what went wrong. */
struct addrinfo *ms__sock_resolve(const char *host, int port, bool passive, char *why, size_t cap);
/* poll() on one fd until it is ready for `events` or the deadline passes (EINTR retried;
 * polled at least once, even past the deadline): 1 ready, 0 timed out, -1 with errno. */
int ms__sock_wait_fd(int fd, short events, double deadline);
/* A listening socket on addr (or on addr's wildcard when `any`): fd, or -1 with `why` and
 * errno. */
int ms__sock_listen(const struct addrinfo *ai, bool any, char *why, size_t cap);
/* One attempt on every address of host:port: a connected non-blocking fd, or -1 and why. */
int ms__sock_connect(const char *host, int port, double deadline, char *why, size_t cap);
/* Drops the first k bytes of iov[0..*n), and the empty buffers at its front. */
struct iovec *ms__sock_iov_advance(struct iovec *iov, int *n, size_t k);

/* ---------------------------------------------------------------- store_server.c */

typedef struct server server;

/* Serves the store for `world` ranks on host:port from a thread of its own; `where`
 * ("host:port") names it in messages. */
ms_status ms__store_server_start(server **out, const char *where, const char *host, int port,
                                 int world, double timeout_s);
/* Joins the server thread: at once when `now`, else when it is done serving. */
void ms__store_server_stop(server *srv, bool now);

#endif
