/*
 * store_client.c: the store's client and the API of store.h (open, set, get, barrier, close),
 * in moonshard's protocol (store_internal.h) or in that of torchrun's own store.
 */
#include "store_internal.h"

#include "comm.h" /* ms__now_s, ms_msg */

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* How long a client waits for a GET's reply beyond the wait it asked the server for. */
static const double REPLY_GRACE_S = 2.0;
/* Pause between connection attempts: doubles from the first to the last. */
static const double RETRY_FIRST_S = 0.01, RETRY_MAX_S = 0.25;

static void sleep_s(double s) {
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - floor(s)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

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

/* Waits for fd to become ready; on timeout or a poll failure, fails the connection. */
static ms_status wait_ready(ms_store *s, short events, double start, double deadline) {
    int rc = ms__sock_wait_fd(s->fd, events, deadline);
    if (rc > 0) return MS_OK;
    if (rc == 0) errno = ETIMEDOUT;
    return io_failed(s, "poll", ms__now_s() - start);
}

/* Sends iov[0..n) whole by the deadline. */
static ms_status send_all(ms_store *s, struct iovec *iov, int n, double deadline) {
    double start = ms__now_s();
    for (iov = ms__sock_iov_advance(iov, &n, 0); n > 0;) {
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t sent = sendmsg(s->fd, &msg, MSG_NOSIGNAL);
        if (sent >= 0) iov = ms__sock_iov_advance(iov, &n, (size_t)sent);
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

/* Connects s->fd, retrying until the deadline (the server may not be up yet). */
static ms_status connect_retry(ms_store *s, const char *host, int port, double start, double deadline) {
    char why[256] = "no attempt made";
    for (double pause = RETRY_FIRST_S; s->fd < 0; pause = fmin(2 * pause, RETRY_MAX_S)) {
        s->fd = ms__sock_connect(host, port, deadline, why, sizeof why);
        double left = deadline - ms__now_s();
        if (s->fd >= 0) break;
        if (left <= 0)
            return ms__fail(MS_ERR_TIMEOUT, WHO_FMT ": could not connect within %.1f s (last try: %s)",
                            WHO(s), ms__now_s() - start, why);
        sleep_s(fmin(pause, left));
    }
    ms__sock_set_nodelay(s->fd);
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
    if (s->srv) ms__store_server_stop(s->srv, now);
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
    ms_status st =
        rank == 0 ? ms__store_server_start(&s->srv, s->where, host, port, world, timeout_s) : MS_OK;
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
