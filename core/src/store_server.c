/*
 * store_server.c: the store's server, which rank 0 runs (store_internal.h).
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
 */
#include "store_internal.h"

#include "comm.h" /* ms__now_s */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static const char *op_name(uint32_t op) {
    switch (op) {
    case OP_HELLO: return "HELLO";
    case OP_SET: return "SET";
    case OP_GET: return "GET";
    case OP_BYE: return "BYE";
    }
    return "unknown";
}

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
        ms__sock_addr_str((struct sockaddr *)&sa, c->peer, sizeof c->peer);
        ms__sock_set_nodelay(fd);
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

/* Listens on the first of host's addresses that this machine has; when it has none of
 * them, on the wildcard address instead (host reaches us through NAT or a service). */
static ms_status server_listen(server *srv, const char *host, int port) {
    char why[256] = "";
    struct addrinfo *res = ms__sock_resolve(host, port, true, why, sizeof why);
    if (!res) return ms__fail(MS_ERR_IO, "store %s: cannot serve: %s", srv->where, why);
    bool only_not_local = true;
    for (const struct addrinfo *ai = res; ai && srv->listen_fd < 0; ai = ai->ai_next) {
        srv->listen_fd = ms__sock_listen(ai, false, why, sizeof why);
        if (srv->listen_fd < 0 && errno != EADDRNOTAVAIL) only_not_local = false;
    }
    if (srv->listen_fd < 0 && only_not_local)
        srv->listen_fd = ms__sock_listen(res, true, why, sizeof why);
    freeaddrinfo(res);
    if (srv->listen_fd < 0) return ms__fail(MS_ERR_IO, "store %s: cannot serve: %s", srv->where, why);
    return MS_OK;
}

ms_status ms__store_server_start(server **out, const char *where, const char *host, int port,
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
void ms__store_server_stop(server *srv, bool now) {
    if (now) {
        char b = 1;
        while (write(srv->wake[1], &b, 1) < 0 && errno == EINTR) {
        }
    }
    pthread_join(srv->thread, NULL);
    server_free(srv);
}
