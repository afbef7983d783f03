/*
 * store.c: the rendezvous store of store.h, a TCP key-value store like PyTorch's TCPStore.
 *
 * Why: NCCL needs its unique id (a 128-byte blob made by one rank) on every rank of a
 * group before ncclCommInitRank.  Under torchrun-style launchers the only thing the ranks
 * share is MASTER_ADDR:MASTER_PORT, so rank 0 serves a store there and every rank talks to
 * it: the first member of a group sets "its" key, the others get it.
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
 * Server: one thread running poll() over the listening socket, a wake-up pipe and every
 * client socket, all non-blocking.  One thread rather than one per client because the
 * store's state (the keys, the waiting GETs, which ranks joined, closed or left) is then
 * owned by that thread alone, without locks, and a blocking GET is just a connection
 * parked with its key and deadline until a SET of that key (or the deadline, or a rank
 * leaving) answers it; it also scales to thousands of ranks without thousands of threads.
 * Replies too large for the socket buffer (values up to 1 MiB) are finished on POLLOUT, so
 * a slow reader never stalls the others.  Keys live in a chained hash table and are never
 * removed, so a reply can point at a stored value while it is being sent.
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
#include "store.h"

#include "comm.h" /* ms__now_s, ms_msg */

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- protocol */

#define STORE_MAGIC 0x4d535331u /* "MSS1": this protocol, version 1 */

enum { OP_HELLO = 1, OP_SET = 2, OP_GET = 3, OP_BYE = 4 };
enum {
    REQ_HDR = 20,        /* magic, op, arg, key_len, value_len */
    REP_HDR = 8,         /* status, len */
    TEXT_MAX = 512,      /* an error reply's text */
    WHERE_MAX = 300,     /* "host:port" */
};
/* How long a client waits for a GET's reply beyond the wait it asked the server for. */
static const double REPLY_GRACE_S = 2.0;
/* Pause between connection attempts: doubles from the first to the last. */
static const double RETRY_FIRST_S = 0.01, RETRY_MAX_S = 0.25;

static void put_u32(uint8_t *p, uint32_t v) {
    uint32_t be = htonl(v);
    memcpy(p, &be, 4);
}

static uint32_t get_u32(const uint8_t *p) {
    uint32_t be;
    memcpy(&be, p, 4);
    return ntohl(be);
}

static const char *op_name(uint32_t op) {
    switch (op) {
    case OP_HELLO: return "HELLO";
    case OP_SET: return "SET";
    case OP_GET: return "GET";
    case OP_BYE: return "BYE";
    }
    return "unknown";
}

/* ---------------------------------------------------------------- sockets, both sides */

static void set_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* latency only: best effort */
}

/* "10.0.0.2:41234" or "[::1]:41234" for a socket address. */
static void addr_str(const struct sockaddr *sa, char *buf, size_t cap) {
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
        port = ntohs(in->sin_port);
        snprintf(buf, cap, "%s:%d", host, port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
        port = ntohs(in6->sin6_port);
        snprintf(buf, cap, "[%s]:%d", host, port);
    } else {
        snprintf(buf, cap, "(address family %d)", sa->sa_family);
    }
}

/* getaddrinfo for TCP on host:port; on failure `why` says what went wrong. */
static struct addrinfo *resolve(const char *host, int port, bool passive, char *why, size_t cap) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(host, service, &hints, &res);
    if (rc != 0) {
        snprintf(why, cap, "resolving \"%s\": %s", host,
                 rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
        return NULL;
    }
    return res;
}

/* poll() on one fd until it is ready for `events` or the deadline passes (EINTR retried;
 * polled at least once, even past the deadline): 1 ready, 0 timed out, -1 with errno. */
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double ms = ceil((deadline - ms__now_s()) * 1e3);
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, ms <= 0 ? 0 : ms > INT_MAX ? INT_MAX : (int)ms);
        if (rc > 0) return 1;
        if (rc < 0 && errno != EINTR) return -1;
        if (rc == 0 && ms <= 0) return 0;
    }
}

static void sleep_s(double s) {
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - floor(s)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ================================================================ server */

enum { RANK_ABSENT = 0, RANK_JOINED, RANK_CLOSED, RANK_GONE };

/* A key and its value, or a request's key and value while it is being read. */
typedef struct item {
    struct item *next; /* hash chain */
    uint32_t hash, key_len, value_len;
    char data[];       /* key_len bytes of key, then value_len bytes of value */
} item;

typedef struct table {
    item **buckets; /* nbuckets, a power of two */
    size_t nbuckets, count;
} table;

typedef struct conn {
    int fd;
    int rank;                  /* -1 until its HELLO was accepted */
    char peer[64];             /* its address, for messages */
    uint8_t hdr[REQ_HDR];      /* the request being read: its header, */
    item *req;                 /* then its key and value (allocated once the header is in) */
    size_t got;                /* bytes of the request read so far */
    item *wait;                /* a GET parked until its key is set: the key */
    double wait_from, wait_until;
    uint8_t out_hdr[REP_HDR];  /* the reply being sent: its header, then out_body */
    const void *out_body;
    size_t out_len, out_off;   /* header + body bytes; bytes sent */
    char text[TEXT_MAX];       /* an error reply's text */
    bool close_after_reply;    /* a refused client */
    bool dead;                 /* to be closed and removed; `why` says why */
    char why[128];
} conn;

typedef struct server {
    int listen_fd;
    int wake[2];               /* a byte on wake[1] stops the server at once */
    int world;
    double timeout_s;
    char where[WHERE_MAX];
    unsigned char *rank_state; /* (world) RANK_* */
    conn **conns;
    size_t nconns, cap;
    struct pollfd *pfds;       /* (2 + cap) */
    table keys;
    bool broken;               /* a rank left without BYE: */
    char broken_msg[256];      /* "rank 2 left without closing the store (...)" */
    double linger_until;       /* > 0 once rank 0 said BYE: stop by then at the latest */
    pthread_t thread;
} server;

/* ---------------------------------------------------------------- the key table */

static uint32_t hash_key(const char *key, size_t len) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)key[i]) * 16777619u;
    return h;
}

static item *table_find(const table *t, const char *key, uint32_t len, uint32_t hash) {
    for (item *it = t->buckets[hash & (t->nbuckets - 1)]; it; it = it->next)
        if (it->hash == hash && it->key_len == len && memcmp(it->data, key, len) == 0) return it;
    return NULL;
}

/* Doubles the buckets when the table is fuller than one key per bucket; an allocation
 * failure only leaves the chains longer. */
static void table_grow(table *t) {
    if (t->count < t->nbuckets) return;
    size_t n = t->nbuckets * 2;
    item **b = calloc(n, sizeof *b);
    if (!b) return;
    for (size_t i = 0; i < t->nbuckets; i++) {
        for (item *it = t->buckets[i], *next; it; it = next) {
            next = it->next;
            it->next = b[it->hash & (n - 1)];
            b[it->hash & (n - 1)] = it;
        }
    }
    free(t->buckets);
    t->buckets = b;
    t->nbuckets = n;
}

static void table_insert(table *t, item *it) {
    table_grow(t);
    size_t i = it->hash & (t->nbuckets - 1);
    it->next = t->buckets[i];
    t->buckets[i] = it;
    t->count++;
}

static void table_free(table *t) {
    for (size_t i = 0; t->buckets && i < t->nbuckets; i++) {
        for (item *it = t->buckets[i], *next; it; it = next) {
            next = it->next;
            free(it);
        }
    }
    free(t->buckets);
    t->buckets = NULL;
}

/* ---------------------------------------------------------------- replies */

static void conn_kill(conn *c, const char *fmt, ...) MS_PRINTF(2, 3);
static void conn_kill(conn *c, const char *fmt, ...) {
    if (c->dead) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->why, sizeof c->why, fmt, ap);
    va_end(ap);
    c->dead = true;
}

/* Sends what is left of c's reply until done or the socket is full (POLLOUT resumes). */
static void conn_flush(conn *c) {
    while (!c->dead && c->out_off < c->out_len) {
        struct iovec iov[2];
        int n = 0;
        size_t body_len = c->out_len - REP_HDR;
        if (c->out_off < REP_HDR)
            iov[n++] = (struct iovec){c->out_hdr + c->out_off, REP_HDR - c->out_off};
        size_t body_off = c->out_off < REP_HDR ? 0 : c->out_off - REP_HDR;
        if (body_off < body_len)
            iov[n++] = (struct iovec){(char *)c->out_body + body_off, body_len - body_off};
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t sent = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
        if (sent >= 0) c->out_off += (size_t)sent;
        else if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        else if (errno != EINTR) conn_kill(c, "send: %s", strerror(errno));
    }
    if (c->out_off == c->out_len) {
        c->out_len = c->out_off = 0;
        if (c->close_after_reply) conn_kill(c, "refused");
    }
}

/* Queues a reply (body must outlive it: a stored value or c->text) and starts sending. */
static void reply(conn *c, ms_status status, const void *body, size_t len) {
    put_u32(c->out_hdr, (uint32_t)status);
    put_u32(c->out_hdr + 4, (uint32_t)len);
    c->out_body = body;
    c->out_len = REP_HDR + len;
    c->out_off = 0;
    conn_flush(c);
}

static void reply_text(conn *c, ms_status status, const char *fmt, ...) MS_PRINTF(3, 4);
static void reply_text(conn *c, ms_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->text, sizeof c->text, fmt, ap);
    va_end(ap);
    reply(c, status, c->text, strlen(c->text));
}

/* Refuses a client (wrong rank, broken protocol): the error, then the connection closes;
 * just the close when it has a request in flight (it sent another before the reply). */
static void refuse(conn *c, ms_status status, const char *fmt, ...) MS_PRINTF(3, 4);
static void refuse(conn *c, ms_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->text, sizeof c->text, fmt, ap);
    va_end(ap);
    if (c->wait || c->out_len) { /* mid-request: no reply, the connection just closes */
        conn_kill(c, "%s", c->text);
        return;
    }
    c->close_after_reply = true;
    reply(c, status, c->text, strlen(c->text));
}

/* ---------------------------------------------------------------- waiting GETs */

static void end_wait(conn *c) {
    free(c->wait);
    c->wait = NULL;
}

/* Answers every GET waiting for the key of `it` with its value. */
static void wake_waiters(server *srv, const item *it) {
    for (size_t i = 0; i < srv->nconns; i++) {
        conn *c = srv->conns[i];
        if (!c->wait || c->wait->hash != it->hash || c->wait->key_len != it->key_len ||
            memcmp(c->wait->data, it->data, it->key_len) != 0)
            continue;
        end_wait(c);
        reply(c, MS_OK, it->data + it->key_len, it->value_len);
    }
}

/* Ends c's waiting GET with an error when the store is broken or its deadline passed. */
static void fail_waiter(const server *srv, conn *c, double now) {
    const item *k = c->wait;
    if (!k || c->dead) return;
    if (srv->broken)
        reply_text(c, MS_ERR_PEER, "key \"%.*s\" is not set and %s", (int)k->key_len, k->data,
                   srv->broken_msg);
    else if (now >= c->wait_until)
        reply_text(c, MS_ERR_TIMEOUT, "key \"%.*s\" was not set within %.1f s", (int)k->key_len,
                   k->data, now - c->wait_from);
    else return;
    end_wait(c);
}

static void fail_waiters(server *srv, double now) {
    for (size_t i = 0; i < srv->nconns; i++) fail_waiter(srv, srv->conns[i], now);
}

/* ---------------------------------------------------------------- requests */

static const char *rank_state_str(unsigned char st) {
    switch (st) {
    case RANK_JOINED: return "has already joined the store (two processes with the same RANK?)";
    case RANK_CLOSED: return "has already joined and closed the store";
    case RANK_GONE: return "has already joined the store and left without closing it";
    }
    return "is absent";
}

static void on_hello(server *srv, conn *c, const item *req, uint32_t rank) {
    uint32_t world = req->value_len == 4 ? get_u32((const uint8_t *)req->data + req->key_len) : 0;
    if (c->rank >= 0) refuse(c, MS_ERR_INTERNAL, "HELLO sent twice by rank %d", c->rank);
    else if (req->value_len != 4)
        refuse(c, MS_ERR_INTERNAL, "HELLO carries %u bytes, not 4 (a world size)", req->value_len);
    else if (world != (uint32_t)srv->world)
        refuse(c, MS_ERR_MISMATCH, "rank %u says the world has %u ranks, the store's rank 0 says %d",
               rank, world, srv->world);
    else if (rank >= (uint32_t)srv->world)
        refuse(c, MS_ERR_ARG, "rank %u is out of range for a world of %d ranks", rank, srv->world);
    else if (srv->rank_state[rank] != RANK_ABSENT)
        refuse(c, MS_ERR_ARG, "rank %u %s", rank, rank_state_str(srv->rank_state[rank]));
    else {
        srv->rank_state[rank] = RANK_JOINED;
        c->rank = (int)rank;
        reply(c, MS_OK, NULL, 0);
    }
}

/* SET keeps the request's item as the stored key and value. */
static void on_set(server *srv, conn *c, item **req) {
    item *it = *req;
    if (table_find(&srv->keys, it->data, it->key_len, it->hash)) {
        reply_text(c, MS_ERR_ARG, "key \"%.*s\" is already set (keys are set once)",
                   (int)it->key_len, it->data);
        return;
    }
    *req = NULL;
    table_insert(&srv->keys, it);
    reply(c, MS_OK, NULL, 0);
    wake_waiters(srv, it);
}

/* GET answers at once when the key is set (or can no longer be), else parks the request. */
static void on_get(server *srv, conn *c, item **req, uint32_t wait_ms) {
    item *k = *req;
    const item *it = table_find(&srv->keys, k->data, k->key_len, k->hash);
    if (it) {
        reply(c, MS_OK, it->data + it->key_len, it->value_len);
        return;
    }
    *req = NULL;
    c->wait = k;
    c->wait_from = ms__now_s();
    c->wait_until = c->wait_from + wait_ms * 1e-3;
    fail_waiter(srv, c, c->wait_from); /* a broken store or no wait at all: answer now */
}

static void on_bye(server *srv, conn *c) {
    srv->rank_state[c->rank] = RANK_CLOSED;
    if (c->rank == 0) srv->linger_until = ms__now_s() + srv->timeout_s;
    reply(c, MS_OK, NULL, 0);
}

/* One complete request (header in c->hdr, key and value in c->req). */
static void on_request(server *srv, conn *c) {
    uint32_t op = get_u32(c->hdr + 4), arg = get_u32(c->hdr + 8);
    item *req = c->req;
    c->req = NULL;
    c->got = 0;
    if (c->wait || c->out_len)
        refuse(c, MS_ERR_INTERNAL, "%s sent before the reply to the previous request", op_name(op));
    else if (op == OP_HELLO) on_hello(srv, c, req, arg);
    else if (c->rank < 0 || srv->rank_state[c->rank] != RANK_JOINED)
        refuse(c, MS_ERR_STATE, "%s sent by a client that has not joined (or has closed)",
               op_name(op));
    else if (op == OP_SET) on_set(srv, c, &req);
    else if (op == OP_GET) on_get(srv, c, &req, arg);
    else on_bye(srv, c);
    free(req);
}

/* Checks a complete header and allocates the request's item: false when refused. */
static bool on_header(conn *c) {
    uint32_t magic = get_u32(c->hdr), op = get_u32(c->hdr + 4);
    uint32_t key_len = get_u32(c->hdr + 12), value_len = get_u32(c->hdr + 16);
    if (magic != STORE_MAGIC) {
        refuse(c, MS_ERR_ARG, "not a moonshard store client (magic 0x%08x)", magic);
        return false;
    }
    bool keyed = op == OP_SET || op == OP_GET;
    if (op < OP_HELLO || op > OP_BYE || key_len > MS_STORE_KEY_MAX || (keyed && key_len == 0) ||
        value_len > (op == OP_SET ? MS_STORE_VALUE_MAX : 4u)) {
        refuse(c, MS_ERR_ARG, "bad request: op %u, key %u bytes, value %u bytes", op, key_len,
               value_len);
        return false;
    }
    c->req = malloc(sizeof(item) + key_len + value_len);
    if (!c->req) {
        refuse(c, MS_ERR_OOM, "no memory for a %u-byte value", value_len);
        return false;
    }
    c->req->key_len = key_len;
    c->req->value_len = value_len;
    c->req->next = NULL;
    return true;
}

/* Reads whatever has arrived on c, handling each request as it completes. */
static void conn_read(server *srv, conn *c) {
    while (!c->dead && !c->close_after_reply) {
        bool in_hdr = c->got < REQ_HDR;
        size_t want = in_hdr ? REQ_HDR - c->got
                             : REQ_HDR + c->req->key_len + c->req->value_len - c->got;
        uint8_t *dst = in_hdr ? c->hdr + c->got : (uint8_t *)c->req->data + (c->got - REQ_HDR);
        ssize_t n = recv(c->fd, dst, want, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return; /* all read */
        if (n < 0) conn_kill(c, "recv: %s", strerror(errno));
        if (n == 0) conn_kill(c, "connection closed");
        if (n <= 0) return;
        c->got += (size_t)n;
        if (in_hdr && (c->got < REQ_HDR || !on_header(c))) continue;
        if (c->got == REQ_HDR + c->req->key_len + c->req->value_len) {
            c->req->hash = hash_key(c->req->data, c->req->key_len);
            on_request(srv, c);
        }
    }
}

/* ---------------------------------------------------------------- connections */

static void accept_all(server *srv) {
    for (;;) {
        struct sockaddr_storage sa;
        socklen_t len = sizeof sa;
        int fd = accept4(srv->listen_fd, (struct sockaddr *)&sa, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return; /* EAGAIN, or out of descriptors: the backlog keeps it for later */
        }
        if (srv->nconns == srv->cap) {
            size_t cap = srv->cap ? srv->cap * 2 : 16;
            conn **cs = realloc(srv->conns, cap * sizeof *cs);
            struct pollfd *ps = cs ? realloc(srv->pfds, (2 + cap) * sizeof *ps) : NULL;
            if (cs) srv->conns = cs;
            if (!ps) {
                close(fd);
                return;
            }
            srv->pfds = ps;
            srv->cap = cap;
        }
        conn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            return;
        }
        c->fd = fd;
        c->rank = -1;
        addr_str((struct sockaddr *)&sa, c->peer, sizeof c->peer);
        set_nodelay(fd);
        srv->conns[srv->nconns++] = c;
    }
}

static void conn_free(conn *c) {
    close(c->fd);
    free(c->req);
    free(c->wait);
    free(c);
}

/* Closes and removes dead connections.  A joined rank that dies without BYE breaks the
 * store: true when that just happened (its waiters must then be answered). */
static bool sweep(server *srv) {
    bool newly_broken = false;
    size_t kept = 0;
    for (size_t i = 0; i < srv->nconns; i++) {
        conn *c = srv->conns[i];
        if (!c->dead) {
            srv->conns[kept++] = c;
            continue;
        }
        if (c->rank >= 0 && srv->rank_state[c->rank] == RANK_JOINED) {
            srv->rank_state[c->rank] = RANK_GONE;
            if (!srv->broken) {
                snprintf(srv->broken_msg, sizeof srv->broken_msg,
                         "rank %d left without closing the store (its connection from %s: %s)",
                         c->rank, c->peer, c->why);
                srv->broken = newly_broken = true;
            }
        }
        conn_free(c);
    }
    srv->nconns = kept;
    return newly_broken;
}

/* ---------------------------------------------------------------- the loop */

/* True when every rank has closed or left; or rank 0 closed one timeout ago. */
static bool server_done(const server *srv, double now) {
    if (srv->linger_until <= 0) return false;
    if (now >= srv->linger_until) return true;
    for (int r = 0; r < srv->world; r++)
        if (srv->rank_state[r] != RANK_CLOSED && srv->rank_state[r] != RANK_GONE) return false;
    return true;
}

/* Milliseconds until the next deadline (a waiting GET, the linger), -1 for none. */
static int poll_timeout_ms(const server *srv, double now) {
    double next = srv->linger_until > 0 ? srv->linger_until : INFINITY;
    for (size_t i = 0; i < srv->nconns; i++)
        if (srv->conns[i]->wait && srv->conns[i]->wait_until < next) next = srv->conns[i]->wait_until;
    if (next == INFINITY) return -1;
    double ms = ceil((next - now) * 1e3);
    return ms <= 0 ? 0 : ms > INT_MAX ? INT_MAX : (int)ms;
}

static void *server_main(void *arg) {
    server *srv = arg;
    for (;;) {
        double now = ms__now_s();
        if (server_done(srv, now)) break;
        size_t n = srv->nconns;
        srv->pfds[0] = (struct pollfd){.fd = srv->wake[0], .events = POLLIN};
        srv->pfds[1] = (struct pollfd){.fd = srv->listen_fd, .events = POLLIN};
        for (size_t i = 0; i < n; i++) { /* a refused client is not read any more */
            const conn *c = srv->conns[i];
            short events = (short)((c->close_after_reply ? 0 : POLLIN) | (c->out_len ? POLLOUT : 0));
            srv->pfds[2 + i] = (struct pollfd){.fd = c->fd, .events = events};
        }
        int rc = poll(srv->pfds, 2 + n, poll_timeout_ms(srv, now));
        if (rc < 0 && errno != EINTR) break; /* the clients see their connections close */
        if (rc > 0 && srv->pfds[0].revents) break;
        for (size_t i = 0; rc > 0 && i < n; i++) {
            conn *c = srv->conns[i];
            short ev = srv->pfds[2 + i].revents;
            if (ev & POLLOUT) conn_flush(c);
            if ((ev & (POLLHUP | POLLERR)) && c->close_after_reply) conn_kill(c, "refused, hung up");
            else if (ev & (POLLIN | POLLHUP | POLLERR)) conn_read(srv, c);
        }
        if (rc > 0 && srv->pfds[1].revents) accept_all(srv);
        fail_waiters(srv, ms__now_s());
        while (sweep(srv)) fail_waiters(srv, ms__now_s());
    }
    return NULL;
}

/* ---------------------------------------------------------------- start and stop */

static void server_free(server *srv) {
    for (size_t i = 0; i < srv->nconns; i++) conn_free(srv->conns[i]);
    free(srv->conns);
    free(srv->pfds);
    table_free(&srv->keys);
    free(srv->rank_state);
    if (srv->listen_fd >= 0) close(srv->listen_fd);
    if (srv->wake[0] >= 0) close(srv->wake[0]);
    if (srv->wake[1] >= 0) close(srv->wake[1]);
    free(srv);
}

/* A listening socket on addr (or on addr's wildcard when `any`): fd, or -1 with `why` and
 * errno. */
static int listen_on(const struct addrinfo *ai, bool any, char *why, size_t cap) {
    struct sockaddr_storage sa;
    memcpy(&sa, ai->ai_addr, ai->ai_addrlen);
    if (any && sa.ss_family == AF_INET)
        ((struct sockaddr_in *)&sa)->sin_addr.s_addr = htonl(INADDR_ANY);
    if (any && sa.ss_family == AF_INET6) ((struct sockaddr_in6 *)&sa)->sin6_addr = in6addr_any;
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
        snprintf(why, cap, "socket: %s", strerror(errno));
        return -1;
    }
    int one = 1;
    const char *step;
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0)
        step = "setsockopt(SO_REUSEADDR)";
    else if (bind(fd, (struct sockaddr *)&sa, ai->ai_addrlen) != 0) step = "bind";
    else if (listen(fd, SOMAXCONN) != 0) step = "listen";
    else return fd;
    int err = errno;
    char addr[80];
    addr_str((struct sockaddr *)&sa, addr, sizeof addr);
    snprintf(why, cap, "%s on %s: %s", step, addr, strerror(err));
    close(fd);
    errno = err;
    return -1;
}

/* Listens on the first of host's addresses that this machine has; when it has none of
 * them, on the wildcard address instead (host reaches us through NAT or a service). */
static ms_status server_listen(server *srv, const char *host, int port) {
    char why[256] = "";
    struct addrinfo *res = resolve(host, port, true, why, sizeof why);
    if (!res) return ms__fail(MS_ERR_IO, "store %s: cannot serve: %s", srv->where, why);
    bool only_not_local = true;
    for (const struct addrinfo *ai = res; ai && srv->listen_fd < 0; ai = ai->ai_next) {
        srv->listen_fd = listen_on(ai, false, why, sizeof why);
        if (srv->listen_fd < 0 && errno != EADDRNOTAVAIL) only_not_local = false;
    }
    if (srv->listen_fd < 0 && only_not_local)
        srv->listen_fd = listen_on(res, true, why, sizeof why);
    freeaddrinfo(res);
    if (srv->listen_fd < 0) return ms__fail(MS_ERR_IO, "store %s: cannot serve: %s", srv->where, why);
    return MS_OK;
}

static ms_status server_start(server **out, const char *where, const char *host, int port,
                              int world, double timeout_s) {
    server *srv = calloc(1, sizeof *srv);
    if (!srv) return ms__fail(MS_ERR_OOM, "store %s: no memory for the server", where);
    srv->listen_fd = srv->wake[0] = srv->wake[1] = -1;
    srv->world = world;
    srv->timeout_s = timeout_s;
    snprintf(srv->where, sizeof srv->where, "%s", where);
    srv->rank_state = calloc((size_t)world, 1);
    srv->keys.nbuckets = 64;
    srv->keys.buckets = calloc(srv->keys.nbuckets, sizeof *srv->keys.buckets);
    srv->pfds = calloc(2, sizeof *srv->pfds);
    ms_status st = MS_OK;
    if (!srv->rank_state || !srv->keys.buckets || !srv->pfds)
        st = ms__fail(MS_ERR_OOM, "store %s: no memory for the server of %d ranks", where, world);
    if (st == MS_OK) st = server_listen(srv, host, port);
    if (st == MS_OK && pipe2(srv->wake, O_CLOEXEC) != 0)
        st = ms__fail(MS_ERR_IO, "store %s: pipe: %s", where, strerror(errno));
    int rc = st == MS_OK ? pthread_create(&srv->thread, NULL, server_main, srv) : 0;
    if (rc != 0)
        st = ms__fail(MS_ERR_IO, "store %s: cannot start the server thread: %s", where, strerror(rc));
    if (st != MS_OK) {
        server_free(srv);
        return st;
    }
    pthread_setname_np(srv->thread, "ms-store");
    *out = srv;
    return MS_OK;
}

/* Joins the server thread: at once when `now`, else when it is done serving. */
static void server_stop(server *srv, bool now) {
    if (now) {
        char b = 1;
        while (write(srv->wake[1], &b, 1) < 0 && errno == EINTR) {
        }
    }
    pthread_join(srv->thread, NULL);
    server_free(srv);
}

/* ================================================================ client */

struct ms_store {
    int fd;
    int rank, world;
    double timeout_s;
    char where[WHERE_MAX]; /* "host:port" */
    server *srv;           /* rank 0: the server it runs */
    bool torch;            /* a client of torchrun's own store (PyTorch's TCPStore protocol) */
    char prefix[160];      /* torch: what every key is prefixed with */
    const char *doing;     /* the call in progress, for messages: "join", "get \"k\"" */
    bool broken;           /* the connection failed: later calls repeat broken_msg */
    char broken_msg[1024];
};

/* The client's name in messages: "store 127.0.0.1:29500 (rank 1 of 4)". */
#define WHO_FMT "store %s (rank %d of %d)"
#define WHO(s) (s)->where, (s)->rank, (s)->world

/* A failure of the connection itself: every later call on s fails with the same message. */
static ms_status conn_failed(ms_store *s, ms_status st, const char *fmt, ...) MS_PRINTF(3, 4);
static ms_status conn_failed(ms_store *s, ms_status st, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(s->broken_msg, sizeof s->broken_msg, WHO_FMT ": %s: %s", WHO(s), s->doing, what);
    s->broken = true;
    return ms__fail(st, "%s", s->broken_msg);
}

#define SERVER_GONE "rank 0 stopped serving or died"

static ms_status io_failed(ms_store *s, const char *call, double waited_s) {
    if (errno == ETIMEDOUT)
        return conn_failed(s, MS_ERR_TIMEOUT, "no answer from the server within %.1f s", waited_s);
    if (errno == EPIPE || errno == ECONNRESET)
        return conn_failed(s, MS_ERR_PEER, "%s: %s: " SERVER_GONE, call, strerror(errno));
    return conn_failed(s, MS_ERR_IO, "%s: %s", call, strerror(errno));
}

/* Drops the first k bytes of iov[0..*n), and the empty buffers at its front. */
static struct iovec *iov_advance(struct iovec *iov, int *n, size_t k) {
    for (; *n > 0 && k >= iov->iov_len; iov++, (*n)--) k -= iov->iov_len;
    if (*n > 0) {
        iov->iov_base = (char *)iov->iov_base + k;
        iov->iov_len -= k;
    }
    return iov;
}

/* Waits for fd to become ready; on timeout or a poll failure, fails the connection. */
static ms_status wait_ready(ms_store *s, short events, double start, double deadline) {
    int rc = wait_fd(s->fd, events, deadline);
    if (rc > 0) return MS_OK;
    if (rc == 0) errno = ETIMEDOUT;
    return io_failed(s, "poll", ms__now_s() - start);
}

/* Sends iov[0..n) whole by the deadline. */
static ms_status send_all(ms_store *s, struct iovec *iov, int n, double deadline) {
    double start = ms__now_s();
    for (iov = iov_advance(iov, &n, 0); n > 0;) {
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t sent = sendmsg(s->fd, &msg, MSG_NOSIGNAL);
        if (sent >= 0) iov = iov_advance(iov, &n, (size_t)sent);
        else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            ms_status st = wait_ready(s, POLLOUT, start, deadline);
            if (st != MS_OK) return st;
        } else if (errno != EINTR) return io_failed(s, "send", 0);
    }
    return MS_OK;
}

/* Receives len bytes by the deadline, keeping the first `cap` in buf, dropping the rest. */
static ms_status recv_all(ms_store *s, void *buf, size_t cap, size_t len, double deadline) {
    double start = ms__now_s();
    char scratch[4096];
    for (size_t got = 0; got < len;) {
        char *dst = got < cap ? (char *)buf + got : scratch;
        size_t want = got < cap ? cap - got : sizeof scratch;
        if (want > len - got) want = len - got;
        ssize_t n = recv(s->fd, dst, want, 0);
        if (n == 0)
            return conn_failed(s, MS_ERR_PEER, "the server closed the connection: " SERVER_GONE);
        if (n > 0) {
            got += (size_t)n;
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            ms_status st = wait_ready(s, POLLIN, start, deadline);
            if (st != MS_OK) return st;
        } else if (errno != EINTR) return io_failed(s, "recv", 0);
    }
    return MS_OK;
}

/* One request and its reply.  A successful reply's body goes to out (up to cap bytes; its
 * length to *out_len); an error reply becomes this thread's message, after `what`. */
typedef struct request {
    uint32_t op, arg;
    const char *key;
    const void *value;
    size_t value_len;
    double send_by, reply_by; /* deadlines */
} request;

static ms_status call(ms_store *s, const request *rq, const char *what, void *out, size_t cap,
                      size_t *out_len) {
    if (s->broken)
        return ms__fail(MS_ERR_STATE, WHO_FMT ": %s: unusable after an earlier failure: %s", WHO(s),
                        what, s->broken_msg);
    s->doing = what;
    uint8_t hdr[REQ_HDR], rep[REP_HDR];
    size_t key_len = rq->key ? strlen(rq->key) : 0;
    uint32_t fields[5] = {STORE_MAGIC, rq->op, rq->arg, (uint32_t)key_len, (uint32_t)rq->value_len};
    for (int i = 0; i < 5; i++) put_u32(hdr + 4 * i, fields[i]);
    struct iovec iov[3] = {{hdr, sizeof hdr}, {(void *)rq->key, key_len},
                           {(void *)rq->value, rq->value_len}};
    ms_status st = send_all(s, iov, 3, rq->send_by);
    if (st == MS_OK) st = recv_all(s, rep, sizeof rep, sizeof rep, rq->reply_by);
    if (st != MS_OK) return st;
    uint32_t status = get_u32(rep), len = get_u32(rep + 4);
    if (status > MS_ERR_INTERNAL || len > MS_STORE_VALUE_MAX || (status != MS_OK && len >= TEXT_MAX))
        return conn_failed(s, MS_ERR_IO,
                           "malformed reply (status %u, %u bytes): not a moonshard store?", status,
                           len);
    if (status == MS_OK) {
        st = recv_all(s, out, cap, len, rq->reply_by);
        if (out_len) *out_len = len;
        return st == MS_OK ? ms__ok() : st;
    }
    char text[TEXT_MAX];
    st = recv_all(s, text, len, len, rq->reply_by);
    if (st != MS_OK) return st;
    text[len] = '\0';
    return ms__fail((ms_status)status, WHO_FMT ": %s: %s", WHO(s), what, text);
}

/* ---------------------------------------------------------------- joining */

/* One attempt on every address of host:port: a connected non-blocking fd, or -1 and why. */
static int connect_once(const char *host, int port, double deadline, char *why, size_t cap) {
    struct addrinfo *res = resolve(host, port, false, why, cap);
    int fd = -1;
    for (const struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            snprintf(why, cap, "socket: %s", strerror(errno));
            continue;
        }
        int err = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : errno;
        if (err == EINPROGRESS) {
            int rc = wait_fd(fd, POLLOUT, deadline);
            socklen_t len = sizeof err;
            if (rc <= 0) err = rc == 0 ? ETIMEDOUT : errno;
            else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        }
        if (err == 0) break;
        char addr[80];
        addr_str(ai->ai_addr, addr, sizeof addr);
        snprintf(why, cap, "connect to %s: %s", addr, strerror(err));
        close(fd);
        fd = -1;
    }
    if (res) freeaddrinfo(res);
    return fd;
}

/* Connects s->fd, retrying until the deadline (the server may not be up yet). */
static ms_status connect_retry(ms_store *s, const char *host, int port, double start, double deadline) {
    char why[256] = "no attempt made";
    for (double pause = RETRY_FIRST_S; s->fd < 0; pause = fmin(2 * pause, RETRY_MAX_S)) {
        s->fd = connect_once(host, port, deadline, why, sizeof why);
        double left = deadline - ms__now_s();
        if (s->fd >= 0) break;
        if (left <= 0)
            return ms__fail(MS_ERR_TIMEOUT, WHO_FMT ": could not connect within %.1f s (last try: %s)",
                            WHO(s), ms__now_s() - start, why);
        sleep_s(fmin(pause, left));
    }
    set_nodelay(s->fd);
    return MS_OK;
}

/* Connects and says HELLO. */
static ms_status join(ms_store *s, const char *host, int port, double start, double deadline) {
    ms_status st = connect_retry(s, host, port, start, deadline);
    if (st != MS_OK) return st;
    uint8_t world[4];
    put_u32(world, (uint32_t)s->world);
    request rq = {.op = OP_HELLO, .arg = (uint32_t)s->rank, .value = world, .value_len = 4,
                  .send_by = deadline, .reply_by = deadline};
    return call(s, &rq, "join", NULL, 0, NULL);
}

/* Frees s; on rank 0, stops its server (at once when `now`, else when it is done). */
static void store_free(ms_store *s, bool now) {
    if (s->fd >= 0) close(s->fd);
    if (s->srv) server_stop(s->srv, now);
    free(s);
}

ms_status ms__store_open(ms_store **out, const char *host, int port, int rank, int world,
                         double timeout_s) {
    if (!out) return ms__fail(MS_ERR_ARG, "ms__store_open: out is NULL");
    *out = NULL;
    if (!host || !host[0] || strlen(host) > 255)
        return ms__fail(MS_ERR_ARG,
                        "ms__store_open: host must be a non-empty name or address (<= 255 bytes)");
    if (port < 1 || port > 65535)
        return ms__fail(MS_ERR_ARG, "ms__store_open: port %d is not in 1..65535", port);
    if (world < 1 || rank < 0 || rank >= world)
        return ms__fail(MS_ERR_ARG, "ms__store_open: rank %d of world %d: need 0 <= rank < world",
                        rank, world);
    if (!(timeout_s > 0) || !isfinite(timeout_s))
        return ms__fail(MS_ERR_ARG,
                        "ms__store_open: timeout %g s is not a positive number of seconds", timeout_s);
    ms_store *s = calloc(1, sizeof *s);
    if (!s) return ms__fail(MS_ERR_OOM, "ms__store_open: no memory");
    *s = (ms_store){.fd = -1, .rank = rank, .world = world, .timeout_s = timeout_s};
    snprintf(s->where, sizeof s->where, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
    double start = ms__now_s();
    ms_status st = rank == 0 ? server_start(&s->srv, s->where, host, port, world, timeout_s) : MS_OK;
    if (st == MS_OK) st = join(s, host, port, start, start + timeout_s);
    if (st != MS_OK) {
        store_free(s, true);
        return st;
    }
    *out = s;
    return ms__ok();
}

/* ---------------------------------------------------------------- torchrun's store
 *
 * torchrun (torch.distributed.run) serves a store of its own on MASTER_ADDR:MASTER_PORT
 * from its agent and tells the workers so with TORCHELASTIC_USE_AGENT_STORE=True: there
 * rank 0 cannot serve ours (the port is taken), so every rank is a client of the agent's
 * store instead, in PyTorch's TCPStore protocol (torch/csrc/distributed/c10d/
 * TCPStoreBackend.hpp), of which moonshard needs four messages, every integer in the
 * host's byte order (little-endian here, as PyTorch sends it):
 *   VALIDATE  u8 0, u32 0x3C85F7CE                         first, once; no reply
 *   SET       u8 1, u64 key length, key, u64 length, value  no reply
 *   GET       u8 3, u64 key length, key                     u64 length, value
 *   WAIT      u8 6, u64 1, u64 key length, key              u8 0 once the key is set
 * Keys are prefixed with "moonshard/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>/",
 * since the agent's store outlives a restart of the workers.  What that store does not do:
 * refuse a second SET of a key (it overwrites), and tell a waiting rank that a peer died (a
 * get waits out the timeout instead). */

enum { T_VALIDATE = 0, T_SET = 1, T_GET = 3, T_WAIT = 6 };
static const uint32_t TORCH_MAGIC = 0x3C85F7CEu;

static size_t put_le(uint8_t *p, uint64_t v, size_t bytes) {
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
    return bytes;
}

static uint64_t get_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* One torch message: op, then (when key) the key's length and the prefixed key, then (when
 * `with_value`) the value's length and the value; WAIT carries its key count first. */
static ms_status torch_send(ms_store *s, uint8_t op, const char *key, const void *value, size_t len,
                            bool with_value, double deadline) {
    char full[sizeof s->prefix + MS_STORE_KEY_MAX + 1];
    size_t klen = key ? (size_t)snprintf(full, sizeof full, "%s%s", s->prefix, key) : 0;
    uint8_t head[1 + 8 + 8], tail[8];
    size_t h = put_le(head, op, 1);
    if (op == T_WAIT) h += put_le(head + h, 1, 8);
    if (key) h += put_le(head + h, klen, 8);
    put_le(tail, len, 8);
    struct iovec iov[4] = {{head, h}, {full, klen}, {tail, with_value ? 8 : 0},
                           {(void *)value, with_value ? len : 0}};
    return send_all(s, iov, 4, deadline);
}

static ms_status torch_set(ms_store *s, const char *key, const void *value, size_t len) {
    s->doing = "set";
    return torch_send(s, T_SET, key, value, len, true, ms__now_s() + s->timeout_s);
}

static ms_status torch_get(ms_store *s, const char *key, void *value, size_t cap, size_t *len,
                           double deadline) {
    char what[300];
    snprintf(what, sizeof what, "get \"%s\"", key);
    s->doing = what;
    uint8_t ready = 1, n[8];
    ms_status st = torch_send(s, T_WAIT, key, NULL, 0, false, deadline);
    if (st == MS_OK) st = recv_all(s, &ready, 1, 1, deadline);
    if (st == MS_ERR_TIMEOUT) /* io_failed's message says "no answer from the server" */
        return conn_failed(s, MS_ERR_TIMEOUT, "the key was not set within %.1f s (torchrun's store cannot tell "
                           "whether the rank that sets it died)", s->timeout_s);
    if (st == MS_OK && ready != 0)
        return conn_failed(s, MS_ERR_IO, "unexpected answer %u to a wait: not PyTorch's TCPStore?", ready);
    if (st == MS_OK) st = torch_send(s, T_GET, key, NULL, 0, false, deadline + REPLY_GRACE_S);
    if (st == MS_OK) st = recv_all(s, n, 8, 8, deadline + REPLY_GRACE_S);
    if (st != MS_OK) return st;
    uint64_t got = get_le64(n);
    if (got > MS_STORE_VALUE_MAX)
        return conn_failed(s, MS_ERR_IO, "a value of %llu bytes (at most %d): not PyTorch's TCPStore?",
                           (unsigned long long)got, MS_STORE_VALUE_MAX);
    *len = (size_t)got;
    st = recv_all(s, value, cap, (size_t)got, deadline + REPLY_GRACE_S);
    return st == MS_OK ? ms__ok() : st;
}

/* Joins torchrun's store at host:port as `rank` of `world`: connects (retrying until the
 * timeout) and validates; `run` and `restart` make the key prefix. */
static ms_status torch_open(ms_store **out, const char *host, int port, int rank, int world, double timeout_s,
                            const char *run, const char *restart) {
    ms_store *s = calloc(1, sizeof *s);
    if (!s) return ms__fail(MS_ERR_OOM, "ms__store_open: no memory");
    *s = (ms_store){.fd = -1, .rank = rank, .world = world, .timeout_s = timeout_s, .torch = true};
    snprintf(s->where, sizeof s->where, strchr(host, ':') ? "[%s]:%d (torchrun's)" : "%s:%d (torchrun's)", host,
             port);
    snprintf(s->prefix, sizeof s->prefix, "moonshard/%.100s/%.20s/", run, restart);
    const double start = ms__now_s(), deadline = start + timeout_s;
    s->doing = "join";
    uint8_t hello[5];
    put_le(hello, T_VALIDATE, 1);
    put_le(hello + 1, TORCH_MAGIC, 4);
    struct iovec iov[1] = {{hello, sizeof hello}};
    ms_status st = connect_retry(s, host, port, start, deadline);
    if (st == MS_OK) st = send_all(s, iov, 1, deadline);
    if (st != MS_OK) {
        store_free(s, true);
        return st;
    }
    *out = s;
    return ms__ok();
}

/* ---------------------------------------------------------------- from the environment */

/* Parses variable `name` as an integer in [lo, hi]; problems go to m. */
static bool env_int(ms_msg *m, const char *name, long lo, long hi, const char *expect, long *out) {
    const char *v = getenv(name);
    char *end = NULL;
    errno = 0;
    long x = v ? strtol(v, &end, 10) : 0;
    const char *sep = m->len ? "; " : "";
    if (!v) ms__msg_add(m, "%s%s is not set (expected %s)", sep, name, expect);
    else if (!v[0] || *end || errno)
        ms__msg_add(m, "%s%s=\"%s\" is not an integer (expected %s)", sep, name, v, expect);
    else if (x < lo || x > hi)
        ms__msg_add(m, "%s%s=%s is out of range (expected %s)", sep, name, v, expect);
    else {
        *out = x;
        return true;
    }
    return false;
}

ms_status ms__store_open_env(ms_store **out, double timeout_s) {
    if (out) *out = NULL;
    ms_msg m = {.len = 0};
    long rank = -1, world = -1, port = 0;
    bool rank_ok = env_int(&m, "RANK", 0, INT_MAX,
                           "this process's rank, an integer 0 <= RANK < WORLD_SIZE", &rank);
    bool world_ok =
        env_int(&m, "WORLD_SIZE", 1, INT_MAX, "the number of ranks, an integer >= 1", &world);
    const char *addr = getenv("MASTER_ADDR");
    if (!addr || !addr[0])
        ms__msg_add(&m, "%sMASTER_ADDR is %s (expected the host name or address of rank 0)",
                    m.len ? "; " : "", addr ? "empty" : "not set");
    env_int(&m, "MASTER_PORT", 1, 65535, "the port of rank 0's store, an integer 1..65535", &port);
    if (rank_ok && world_ok && rank >= world)
        ms__msg_add(&m, "%sRANK=%ld is not below WORLD_SIZE=%ld (expected 0 <= RANK < WORLD_SIZE)",
                    m.len ? "; " : "", rank, world);
    if (m.len) return ms__fail(MS_ERR_ARG, "store from the environment: %s", m.s);
    const char *agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (agent && strcmp(agent, "True") == 0) { /* torchrun serves its own store there */
        if (!(timeout_s > 0) || !isfinite(timeout_s))
            return ms__fail(MS_ERR_ARG, "ms__store_open: timeout %g s is not a positive number of seconds",
                            timeout_s);
        const char *run = getenv("TORCHELASTIC_RUN_ID"), *restart = getenv("TORCHELASTIC_RESTART_COUNT");
        return torch_open(out, addr, (int)port, (int)rank, (int)world, timeout_s, run && *run ? run : "none",
                          restart && *restart ? restart : "0");
    }
    return ms__store_open(out, addr, (int)port, (int)rank, (int)world, timeout_s);
}

/* ---------------------------------------------------------------- use */

int ms__store_rank(const ms_store *s) { return s ? s->rank : -1; }
int ms__store_world(const ms_store *s) { return s ? s->world : 0; }

/* What a key may be, checked before anything is sent. */
static ms_status check_key(const ms_store *s, const char *op, const char *key) {
    if (!s) return ms__fail(MS_ERR_ARG, "ms__store_%s: store is NULL", op);
    if (!key) return ms__fail(MS_ERR_ARG, WHO_FMT ": %s: key is NULL", WHO(s), op);
    size_t len = strlen(key);
    if (len == 0 || len > MS_STORE_KEY_MAX)
        return ms__fail(MS_ERR_ARG, WHO_FMT ": %s \"%.40s%s\": a key has 1..%d bytes, not %zu",
                        WHO(s), op, key, len > 40 ? "..." : "", MS_STORE_KEY_MAX, len);
    return MS_OK;
}

ms_status ms__store_set(ms_store *s, const char *key, const void *value, size_t len) {
    ms_status st = check_key(s, "set", key);
    if (st != MS_OK) return st;
    if (len > MS_STORE_VALUE_MAX || (len && !value))
        return ms__fail(MS_ERR_ARG,
                        WHO_FMT ": set \"%s\": the value has %zu bytes at %p (at most %d, not NULL)",
                        WHO(s), key, len, value, MS_STORE_VALUE_MAX);
    if (s->torch) return s->broken ? ms__fail(MS_ERR_STATE, WHO_FMT ": set: unusable after an earlier failure: %s",
                                              WHO(s), s->broken_msg)
                               : torch_set(s, key, value, len);
    double deadline = ms__now_s() + s->timeout_s;
    request rq = {.op = OP_SET, .key = key, .value = value, .value_len = len, .send_by = deadline,
                  .reply_by = deadline};
    char what[300];
    snprintf(what, sizeof what, "set \"%s\"", key);
    return call(s, &rq, what, NULL, 0, NULL);
}

/* Milliseconds from now until the deadline, for a GET's wait (0 when past). */
static uint32_t ms_until(double deadline) {
    double ms = ceil((deadline - ms__now_s()) * 1e3);
    return ms <= 0 ? 0 : ms >= UINT32_MAX ? UINT32_MAX : (uint32_t)ms;
}

/* GET with the server's wait ending at `deadline`. */
static ms_status get_until(ms_store *s, const char *key, void *value, size_t cap, size_t *len,
                           double deadline) {
    if (s->torch && s->broken)
        return ms__fail(MS_ERR_STATE, WHO_FMT ": get \"%s\": unusable after an earlier failure: %s", WHO(s), key,
                        s->broken_msg);
    if (s->torch) return torch_get(s, key, value, cap, len, deadline);
    request rq = {.op = OP_GET, .key = key, .arg = ms_until(deadline), .send_by = deadline,
                  .reply_by = deadline + REPLY_GRACE_S};
    char what[300];
    snprintf(what, sizeof what, "get \"%s\"", key);
    return call(s, &rq, what, value, cap, len);
}

ms_status ms__store_get(ms_store *s, const char *key, void *value, size_t cap, size_t *len) {
    ms_status st = check_key(s, "get", key);
    if (st != MS_OK) return st;
    if (!len || (cap && !value))
        return ms__fail(MS_ERR_ARG, WHO_FMT ": get \"%s\": len is NULL or value is NULL with cap %zu",
                        WHO(s), key, cap);
    return get_until(s, key, value, cap, len, ms__now_s() + s->timeout_s);
}

ms_status ms__store_barrier(ms_store *s, const char *name) {
    if (!s || !name) return ms__fail(MS_ERR_ARG, "ms__store_barrier: store or name is NULL");
    char key[MS_STORE_KEY_MAX + 1];
    double deadline = ms__now_s() + s->timeout_s;
    if (snprintf(key, sizeof key, "barrier/%s/%d", name, s->world - 1) > MS_STORE_KEY_MAX)
        return ms__fail(MS_ERR_ARG,
                        WHO_FMT ": barrier name of %zu bytes is too long for its keys "
                                "\"barrier/<name>/<rank>\" (at most %d bytes)",
                        WHO(s), strlen(name), MS_STORE_KEY_MAX);
    snprintf(key, sizeof key, "barrier/%s/%d", name, s->rank);
    ms_status st = ms__store_set(s, key, NULL, 0);
    for (int r = 0; r < s->world && st == MS_OK; r++) {
        size_t len;
        snprintf(key, sizeof key, "barrier/%s/%d", name, r);
        if (r != s->rank) st = get_until(s, key, NULL, 0, &len, deadline);
    }
    return st == MS_OK ? MS_OK : ms__wrap(st, "barrier \"%s\"", name);
}

void ms__store_close(ms_store *s) {
    if (!s) return;
    char saved[1024]; /* closing after a failure must not replace its message */
    snprintf(saved, sizeof saved, "%s", ms_last_error());
    double deadline = ms__now_s() + s->timeout_s;
    request rq = {.op = OP_BYE, .send_by = deadline, .reply_by = deadline};
    bool said_bye = s->fd >= 0 && !s->torch && call(s, &rq, "close", NULL, 0, NULL) == MS_OK;
    store_free(s, !said_bye);
    ms__fail(MS_OK, "%s", saved);
}
