/*
 * comm.c: worlds, comms and groups, and the public collectives.
 *
 * Everything here is backend-independent.  A collective call is checked on the calling rank
 * (tensors present, holding data, on the backend's device, contiguous, equal dtypes, the
 * numel relation of the collective, the op, in-place forms), turned into an ms_coll and
 * handed to the backend's table (comm.h).  A rank whose arguments are rejected here has not
 * joined the collective: its comm stays usable and its peers keep waiting for it.  A
 * failure inside the backend (mismatch, timeout, peer gone) makes the comm unusable: later
 * calls return MS_ERR_STATE with the first failure's message.
 */
#include "comm.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------- names for messages */

static const char *const coll_name[] = {"all_gather", "reduce_scatter", "all_reduce",
                                        "broadcast", "all_to_all", "barrier"};

const char *ms__coll_name(ms_coll_kind kind) { return coll_name[kind]; }

const char *ms__coll_str(char *buf, size_t cap, const ms_coll *call) {
    const char *dt = ms_dtype_name(call->dtype);
    long long count = (long long)call->count;
    switch (call->kind) {
    case MS_COLL_ALL_GATHER:
    case MS_COLL_ALL_TO_ALL: snprintf(buf, cap, "in %lld x %s", count, dt); break;
    case MS_COLL_REDUCE_SCATTER:
        snprintf(buf, cap, "out %lld x %s %s", count, dt, ms_op_name(call->op));
        break;
    case MS_COLL_ALL_REDUCE: snprintf(buf, cap, "%lld x %s %s", count, dt, ms_op_name(call->op)); break;
    case MS_COLL_BROADCAST: snprintf(buf, cap, "%lld x %s root %d", count, dt, call->root); break;
    case MS_COLL_BARRIER: buf[0] = '\0'; break;
    }
    if (call->label_hash) {
        size_t len = strlen(buf);
        snprintf(buf + len, cap - len, "%sfor unit %s", len ? " " : "", call->label);
    }
    return buf;
}

const char *ms__group_str(char *buf, size_t cap, int n, const int *world_ranks) {
    size_t len = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, i ? " %d" : "%d", world_ranks[i]);
    if (len < cap) snprintf(buf + len, cap - len, "]");
    return buf;
}

/* ---------------------------------------------------------------- messages and agreement */

void ms__msg_add(ms_msg *m, const char *fmt, ...) {
    if (m->len >= sizeof m->s) return;
    va_list ap;
    va_start(ap, fmt);
    m->len += (size_t)vsnprintf(m->s + m->len, sizeof m->s - m->len, fmt, ap);
    va_end(ap);
}

void ms__msg_where(ms_msg *m, const ms_comm *c, ms_coll_kind kind) {
    char group[256];
    ms__msg_add(m, "%s on group %s", ms__coll_name(kind),
                ms__group_str(group, sizeof group, c->group->n, c->group->world_ranks));
}

double ms__now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static bool same_call(const ms_coll *a, const ms_coll *b) {
    return a->kind == b->kind && a->dtype == b->dtype && a->op == b->op && a->root == b->root &&
           a->count == b->count && a->label_hash == b->label_hash;
}

_Thread_local const char *ms__coll_label;

void ms__coll_set_label(ms_coll *call) {
    const char *name = ms__coll_label;
    call->label_hash = 0;
    call->label[0] = '\0';
    if (!name) return;
    uint64_t h = 14695981039346656037u;
    for (const char *p = name; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211u;
    call->label_hash = h | 1; /* never 0, the rank's own calls' */
    size_t n = strlen(name);
    if (n < MS_COLL_LABEL) snprintf(call->label, MS_COLL_LABEL, "%s", name);
    else snprintf(call->label, MS_COLL_LABEL, "...%s", name + n - (MS_COLL_LABEL - 4));
}

ms_status ms__calls_agree(const ms_comm *c, const ms_coll *calls, size_t stride) {
    const ms_group *g = c->group;
#define CALL(i) ((const ms_coll *)((const char *)calls + (size_t)(i) * stride))
    bool same = true, same_kind = true;
    for (int j = 1; j < g->n; j++) {
        same &= same_call(CALL(j), CALL(0));
        same_kind &= CALL(j)->kind == CALL(0)->kind;
    }
    if (same) return MS_OK;
    ms_msg m = {0};
    char group[256], args[160];
    if (same_kind) {
        ms__msg_where(&m, c, CALL(0)->kind);
        ms__msg_add(&m, ": ranks disagree: ");
    } else {
        ms__msg_add(&m, "collectives on group %s: ranks disagree on the collective: ",
                    ms__group_str(group, sizeof group, g->n, g->world_ranks));
    }
    bool first = true;
    for (int j = 0; j < g->n; j++) {
        bool seen = false;
        for (int i = 0; i < j && !seen; i++) seen = same_call(CALL(i), CALL(j));
        if (seen) continue;
        int count = 0;
        for (int i = j; i < g->n; i++) count += same_call(CALL(i), CALL(j));
        ms__msg_add(&m, "%s%s", first ? "" : "; ", count > 1 ? "ranks" : "rank");
        for (int i = j; i < g->n; i++)
            if (same_call(CALL(i), CALL(j))) ms__msg_add(&m, " %d", g->world_ranks[i]);
        ms__coll_str(args, sizeof args, CALL(j));
        if (same_kind)
            ms__msg_add(&m, ": %s", args);
        else
            ms__msg_add(&m, ": %s%s%s", ms__coll_name(CALL(j)->kind), *args ? " " : "", args);
        first = false;
    }
#undef CALL
    return ms__fail(MS_ERR_MISMATCH, "%s", m.s);
}

/* ---------------------------------------------------------------- point-to-point agreement */

int64_t ms__p2p_bytes(const ms_p2p_desc *d) {
    int64_t n = ms_dtype_size((ms_dtype)d->dtype);
    for (int i = 0; i < d->ndim && i < MS_MAX_DIMS; i++) n *= d->shape[i];
    return n;
}

void ms__keep_first(ms_first_error *f, ms_status st) {
    if (!st || f->st) return;
    f->st = st;
    snprintf(f->msg, sizeof f->msg, "%s", ms_last_error());
}

ms_status ms__first_error(const ms_first_error *f) { return f->st ? ms__fail(f->st, "%s", f->msg) : ms__ok(); }

void ms__p2p_header(const ms_p2p_batch *b, int i, ms_p2p_header *h) {
    const ms_p2p_peer *q = &b->peers[i];
    *h = (ms_p2p_header){.count = q->count};
    for (int k = 0; k < q->count && k < MS_P2P_INLINE; k++) h->desc[k] = b->descs[q->first + k];
}

const char *ms__rank_str(char *buf, size_t cap, const ms_comm *c, int group_rank) {
    const ms_group *g = c->group;
    bool first_ranks = true; /* the group is world ranks 0..n-1: its ranks are the world's */
    for (int i = 0; i < g->n; i++) first_ranks &= g->world_ranks[i] == i;
    if (first_ranks) snprintf(buf, cap, "rank %d", group_rank);
    else snprintf(buf, cap, "rank %d (group rank %d)", g->world_ranks[group_rank], group_rank);
    return buf;
}

void ms__p2p_where(ms_msg *m, const ms_comm *c, int peer) {
    char group[256], a[64], b[64];
    int lo = c->rank < peer ? c->rank : peer, hi = c->rank < peer ? peer : c->rank;
    ms__msg_add(m, "send/recv on group %s between %s and %s",
                ms__group_str(group, sizeof group, c->group->n, c->group->world_ranks),
                ms__rank_str(a, sizeof a, c, lo), ms__rank_str(b, sizeof b, c, hi));
}

/* "tag 0 [4, 8] f32" (a peer's descriptor: its ndim and dtype are not trusted). */
static const char *p2p_desc_str(char *buf, size_t cap, const ms_p2p_desc *d) {
    char shape[160];
    int ndim = d->ndim < 0 ? 0 : d->ndim > MS_MAX_DIMS ? MS_MAX_DIMS : d->ndim;
    const char *dt = ms_dtype_name((ms_dtype)d->dtype);
    snprintf(buf, cap, "tag %d %s %s", d->tag, ms__shape_str(shape, sizeof shape, ndim, d->shape), dt ? dt : "?");
    return buf;
}

static int count_kind(const ms_p2p_desc *d, int n, int kind) {
    int k = 0;
    for (int i = 0; i < n; i++) k += d[i].kind == kind;
    return k;
}

static int next_kind(const ms_p2p_desc *d, int n, int kind, int from) {
    while (from < n && d[from].kind != kind) from++;
    return from;
}

/* One direction of a pair: rank s's sends to rank r (among its ops with r) against r's
 * receives from s.  True when they pair up; else the first difference is added to m, after
 * sep. */
static bool p2p_direction(ms_msg *m, const char *sep, const ms_comm *c, int s, const ms_p2p_desc *s_ops, int s_n,
                          int r, const ms_p2p_desc *r_ops, int r_n) {
    char a[64], b[64], sent[200], got[200];
    const int nsend = count_kind(s_ops, s_n, MS_P2P_SEND), nrecv = count_kind(r_ops, r_n, MS_P2P_RECV);
    ms__rank_str(a, sizeof a, c, s);
    ms__rank_str(b, sizeof b, c, r);
    if (nsend != nrecv) {
        ms__msg_add(m, "%s%s sends %d tensor%s to %s, which receives %d from it", sep, a, nsend, nsend == 1 ? "" : "s",
                    b, nrecv);
        return false;
    }
    for (int i = 0, x = -1, y = -1; i < nsend; i++) {
        x = next_kind(s_ops, s_n, MS_P2P_SEND, x + 1);
        y = next_kind(r_ops, r_n, MS_P2P_RECV, y + 1);
        const ms_p2p_desc *d = &s_ops[x], *e = &r_ops[y];
        const bool tag = d->tag != e->tag, dtype = d->dtype != e->dtype;
        bool shape = d->ndim != e->ndim;
        for (int k = 0; !shape && k < d->ndim && k < MS_MAX_DIMS; k++) shape = d->shape[k] != e->shape[k];
        if (!tag && !dtype && !shape) continue;
        const char *what[3];
        int nwhat = 0;
        if (tag) what[nwhat++] = "tag";
        if (shape) what[nwhat++] = "shape";
        if (dtype) what[nwhat++] = "dtype";
        ms__msg_add(m, "%stensor %d of %d from %s to %s: sent as %s, received as %s (the %s%s%s%s%s %s)",
                    sep, i + 1, nsend, a, b, p2p_desc_str(sent, sizeof sent, d),
                    p2p_desc_str(got, sizeof got, e), what[0], nwhat == 3 ? ", " : nwhat == 2 ? " and " : "",
                    nwhat > 1 ? what[1] : "", nwhat == 3 ? " and " : "", nwhat == 3 ? what[2] : "",
                    nwhat > 1 ? "differ" : "differs");
        return false;
    }
    return true;
}

ms_status ms__p2p_agree(const ms_comm *c, int peer, const ms_p2p_desc *mine, int n_mine, const ms_p2p_desc *theirs,
                        int n_theirs) {
    const bool me_first = c->rank < peer;
    const int lo = me_first ? c->rank : peer, hi = me_first ? peer : c->rank;
    const ms_p2p_desc *lo_ops = me_first ? mine : theirs, *hi_ops = me_first ? theirs : mine;
    const int lo_n = me_first ? n_mine : n_theirs, hi_n = me_first ? n_theirs : n_mine;
    ms_msg m = {0};
    ms__p2p_where(&m, c, peer);
    ms__msg_add(&m, ": the sides disagree: ");
    const bool up = p2p_direction(&m, "", c, lo, lo_ops, lo_n, hi, hi_ops, hi_n);
    const bool down = p2p_direction(&m, up ? "" : "; ", c, hi, hi_ops, hi_n, lo, lo_ops, lo_n);
    if (up && down) return MS_OK;
    if (!count_kind(lo_ops, lo_n, MS_P2P_RECV) && !count_kind(hi_ops, hi_n, MS_P2P_RECV))
        ms__msg_add(&m, " (both send first: post each rank's send and receive in one batch)");
    return ms__fail(MS_ERR_MISMATCH, "%s", m.s);
}

static const char *const device_name[] = {[MS_DEVICE_CPU] = "cpu", [MS_DEVICE_META] = "meta",
                                          [MS_DEVICE_CUDA] = "cuda"};

/* "[4, 3] f32": a tensor in messages. */
static const char *tensor_str(char *buf, size_t cap, const ms_tensor *t) {
    char shape[160];
    snprintf(buf, cap, "%s %s", ms__shape_str(shape, sizeof shape, t->ndim, t->shape),
             ms_dtype_name(t->dtype));
    return buf;
}

/* ---------------------------------------------------------------- worlds */

enum { MS_DEFAULT_TIMEOUT_S = 300 };

/* The timeout of a new world and where it came from (for timeout messages). */
static ms_status resolve_timeout(ms_world *w, double timeout_s) {
    if (timeout_s > 0) {
        if (!isfinite(timeout_s))
            return ms__fail(MS_ERR_ARG, "world: timeout_s %g is not a finite number of seconds", timeout_s);
        w->timeout_s = timeout_s;
        snprintf(w->timeout_origin, sizeof w->timeout_origin, "timeout_s=%g given to the world", timeout_s);
        return MS_OK;
    }
    const char *env = getenv("MOONSHARD_TIMEOUT");
    if (!env || !*env) {
        w->timeout_s = MS_DEFAULT_TIMEOUT_S;
        snprintf(w->timeout_origin, sizeof w->timeout_origin,
                 "the default; set MOONSHARD_TIMEOUT to change it");
        return MS_OK;
    }
    char *end;
    double v = strtod(env, &end);
    while (*end == ' ' || *end == '\t') end++;
    if (end == env || *end || !isfinite(v) || v <= 0)
        return ms__fail(MS_ERR_ARG, "MOONSHARD_TIMEOUT='%s' is not a positive number of seconds", env);
    w->timeout_s = v;
    snprintf(w->timeout_origin, sizeof w->timeout_origin, "MOONSHARD_TIMEOUT=%.40s", env);
    return MS_OK;
}

static void group_free(const ms_backend *backend, ms_group *g) {
    if (g->impl) backend->group_free(g);
    free(g->world_ranks);
    free(g->comms);
    free(g);
}

/* A new group of the given world ranks with its backend state; the caller holds w->lock
 * (or owns w alone) and links it into the registry. */
static ms_status group_new(ms_world *w, int n, const int *world_ranks, int tag, ms_group **out) {
    ms_group *g = calloc(1, sizeof *g);
    if (!g) return ms__fail(MS_ERR_OOM, "out of memory creating a group of %d ranks", n);
    g->n = n;
    g->tag = tag;
    g->world_ranks = malloc((size_t)n * sizeof *g->world_ranks);
    g->comms = calloc((size_t)n, sizeof *g->comms);
    if (!g->world_ranks || !g->comms) {
        group_free(w->backend, g);
        return ms__fail(MS_ERR_OOM, "out of memory creating a group of %d ranks", n);
    }
    memcpy(g->world_ranks, world_ranks, (size_t)n * sizeof *world_ranks);
    for (int i = 0; i < n; i++) g->comms[i] = (ms_comm){.world = w, .group = g, .rank = i};
    ms_status st = w->backend->group_init(w, g);
    if (st) {
        group_free(w->backend, g);
        return st;
    }
    *out = g;
    return MS_OK;
}

static void world_free(ms_world *w) {
    ms__async_world_stop(w);
    for (ms_group *g = w->groups, *next; g; g = next) {
        next = g->next;
        group_free(w->backend, g);
    }
    pthread_mutex_destroy(&w->lock);
    free(w->rank_state);
    free(w);
}

ms_status ms__world_new(ms_world **out, const ms_backend *backend, int nranks, double timeout_s) {
    return ms__world_new_arg(out, backend, nranks, timeout_s, NULL);
}

ms_status ms__world_new_arg(ms_world **out, const ms_backend *backend, int nranks, double timeout_s,
                            const void *arg) {
    if (!out) return ms__fail(MS_ERR_ARG, "%s world: out is NULL", backend->name);
    if (nranks < 1) return ms__fail(MS_ERR_ARG, "%s world: nranks must be >= 1, got %d", backend->name, nranks);
    ms_world *w = calloc(1, sizeof *w);
    if (!w) return ms__fail(MS_ERR_OOM, "%s world: out of memory", backend->name);
    atomic_init(&w->refcount, 1);
    w->backend = backend;
    w->size = nranks;
    w->backend_arg = arg;
    pthread_mutex_init(&w->lock, NULL);
    ms_status st = resolve_timeout(w, timeout_s);
    int *all = malloc((size_t)nranks * sizeof *all);
    w->rank_state = calloc((size_t)nranks, sizeof *w->rank_state);
    if (!st && (!all || !w->rank_state)) st = ms__fail(MS_ERR_OOM, "%s world: out of memory", backend->name);
    if (!st) {
        for (int i = 0; i < nranks; i++) {
            all[i] = i;
            atomic_init(&w->rank_state[i], MS_RANK_RUNNING);
        }
        st = group_new(w, nranks, all, 0, &w->groups);
    }
    free(all);
    w->backend_arg = NULL;
    if (st) {
        world_free(w);
        return st;
    }
    *out = w;
    return ms__ok();
}

void ms_world_retain(ms_world *w) {
    if (w) atomic_fetch_add(&w->refcount, 1);
}

void ms_world_release(ms_world *w) {
    if (w && atomic_fetch_sub(&w->refcount, 1) == 1) world_free(w);
}

int ms_world_size(const ms_world *w) {
    MS_NOT_NULL_OR(w, -1);
    return w->size;
}
double ms_world_timeout(const ms_world *w) {
    MS_NOT_NULL_OR(w, -1.0);
    return w->timeout_s;
}

ms_status ms_world_comm(ms_world *w, int rank, ms_comm **out) {
    MS_NOT_NULL(w);
    MS_NOT_NULL(out);
    if (rank < 0 || rank >= w->size)
        return ms__fail(MS_ERR_ARG, "world_comm: rank %d is out of range for a world of %d ranks", rank, w->size);
    ms_world_retain(w);
    *out = &w->groups->comms[rank];
    return ms__ok();
}

ms_status ms_world_rank_done(ms_world *w, int rank, int failed) {
    MS_NOT_NULL(w);
    if (rank < 0 || rank >= w->size)
        return ms__fail(MS_ERR_ARG, "world_rank_done: rank %d is out of range for a world of %d ranks", rank,
                        w->size);
    atomic_store(&w->rank_state[rank], failed ? MS_RANK_FAILED : MS_RANK_FINISHED);
    return ms__ok();
}

/* ---------------------------------------------------------------- comms and groups */

void ms_comm_retain(ms_comm *c) {
    if (c) ms_world_retain(c->world);
}

void ms_comm_release(ms_comm *c) {
    if (c) ms_world_release(c->world);
}

int ms_comm_size(const ms_comm *c) {
    MS_NOT_NULL_OR(c, -1);
    return c->group->n;
}
int ms_comm_rank(const ms_comm *c) {
    MS_NOT_NULL_OR(c, -1);
    return c->rank;
}
int ms_comm_world_rank(const ms_comm *c, int group_rank) {
    MS_NOT_NULL_OR(c, -1);
    return group_rank >= 0 && group_rank < c->group->n ? c->group->world_ranks[group_rank] : -1;
}
const char *ms_comm_backend(const ms_comm *c) {
    MS_NOT_NULL_OR(c, NULL);
    return c->world->backend->name;
}
ms_status ms_comm_device(const ms_comm *c, ms_device_type *type, int *index) {
    MS_NOT_NULL(c);
    MS_NOT_NULL(type);
    MS_NOT_NULL(index);
    *type = c->world->backend->device;
    *index = *type == MS_DEVICE_CUDA ? ms_nccl_device() : -1;
    return ms__ok();
}

/* Checks a member list: strictly increasing world ranks that include `me`. */
static ms_status check_members(const ms_world *w, int me, int n, const int *ranks) {
    char list[256];
    if (n < 1 || n > w->size)
        return ms__fail(MS_ERR_ARG, "comm_group: %d ranks asked for in a world of %d", n, w->size);
    ms__group_str(list, sizeof list, n, ranks);
    bool has_me = false;
    for (int i = 0; i < n; i++) {
        if (ranks[i] < 0 || ranks[i] >= w->size)
            return ms__fail(MS_ERR_ARG, "comm_group %s: rank %d is out of range for a world of %d ranks", list,
                            ranks[i], w->size);
        if (i > 0 && ranks[i] <= ranks[i - 1])
            return ms__fail(MS_ERR_ARG, "comm_group %s: world ranks must be strictly increasing", list);
        has_me |= ranks[i] == me;
    }
    if (!has_me)
        return ms__fail(MS_ERR_ARG, "comm_group %s: the group does not contain the calling rank %d", list, me);
    return MS_OK;
}

/* ms_comm_group_tagged once its pointers are checked. */
static ms_status comm_group(ms_comm *c, int n, const int *world_ranks, int tag, ms_comm **out) {
    if (tag < 0 || tag > MS_GROUP_TAG_MAX)
        return ms__fail(MS_ERR_ARG, "comm_group: tag %d is outside 0..%d", tag, MS_GROUP_TAG_MAX);
    ms_world *w = c->world;
    int me = c->group->world_ranks[c->rank];
    ms_status st = check_members(w, me, n, world_ranks);
    if (st) return st;

    pthread_mutex_lock(&w->lock);
    ms_group *g = w->groups, *last = NULL;
    for (; g; last = g, g = g->next)
        if (g->n == n && g->tag == tag && !memcmp(g->world_ranks, world_ranks, (size_t)n * sizeof *world_ranks))
            break;
    if (!g && !(st = group_new(w, n, world_ranks, tag, &g))) last->next = g;
    pthread_mutex_unlock(&w->lock);
    if (st) return st;

    int rank = 0;
    while (g->world_ranks[rank] != me) rank++;
    ms_world_retain(w);
    *out = &g->comms[rank];
    return ms__ok();
}

ms_status ms_comm_group_tagged(ms_comm *world, int n, const int *world_ranks, int tag, ms_comm **out) {
    MS_NOT_NULL(world);
    MS_NOT_NULL(world_ranks);
    MS_NOT_NULL(out);
    return comm_group(world, n, world_ranks, tag, out);
}

ms_status ms_comm_group(ms_comm *world, int n, const int *world_ranks, ms_comm **out) {
    MS_NOT_NULL(world);
    MS_NOT_NULL(world_ranks);
    MS_NOT_NULL(out);
    return comm_group(world, n, world_ranks, 0, out);
}

/* ---------------------------------------------------------------- argument checks */

/* The comm is present and usable; writes "all_gather on group [0 1]" (name: the call) into where. */
static ms_status check_comm(ms_comm *c, const char *name, char *where, size_t cap) {
    if (!c) return ms__fail(MS_ERR_ARG, "%s: comm is NULL", name);
    char group[256];
    snprintf(where, cap, "%s on group %s", name,
             ms__group_str(group, sizeof group, c->group->n, c->group->world_ranks));
    if (c->unusable)
        return ms__fail(MS_ERR_STATE, "%s: the comm is unusable after an earlier failure: %s", where, c->failure);
    return MS_OK;
}

/* The tensor is present, holds data on the backend's device and is contiguous. */
static ms_status check_tensor(const ms_comm *c, const char *where, const char *name, const ms_tensor *t) {
    if (!t) return ms__fail(MS_ERR_ARG, "%s: %s is NULL", where, name);
    char desc[200];
    tensor_str(desc, sizeof desc, t);
    ms_device_type device = ms_tensor_device(t);
    if (device == MS_DEVICE_META)
        return ms__fail(MS_ERR_DEVICE, "%s: %s %s is a meta tensor; meta tensors hold no data", where, name, desc);
    if (device != c->world->backend->device && !(device == MS_DEVICE_CPU && c->world->backend->takes_cpu))
        return ms__fail(MS_ERR_DEVICE, "%s: %s %s is a %s tensor; the %s backend moves %s tensors", where, name,
                        desc, device_name[device], c->world->backend->name, device_name[c->world->backend->device]);
    if (!ms_tensor_is_contiguous(t)) {
        char strides[160];
        return ms__fail(MS_ERR_ARG, "%s: %s %s is not contiguous (strides %s)", where, name, desc,
                        ms__shape_str(strides, sizeof strides, t->ndim, t->stride));
    }
    return MS_OK;
}

static ms_status check_same_dtype(const char *where, const ms_tensor *out, const ms_tensor *in) {
    if (out->dtype == in->dtype) return MS_OK;
    char a[200], b[200];
    return ms__fail(MS_ERR_DTYPE, "%s: out %s and in %s must have the same dtype", where,
                    tensor_str(a, sizeof a, out), tensor_str(b, sizeof b, in));
}

/* The op exists and the dtype can be reduced with it. */
static ms_status check_op(const char *where, ms_op op, ms_dtype dtype) {
    if (!ms_op_name(op))
        return ms__fail(MS_ERR_ARG, "%s: invalid reduction op %d (expected sum, avg, max or min)", where, (int)op);
    if (op == MS_OP_AVG && !ms_dtype_is_float(dtype))
        return ms__fail(MS_ERR_DTYPE, "%s: avg needs a floating dtype, got %s", where, ms_dtype_name(dtype));
    if (dtype == MS_BOOL && op == MS_OP_SUM)
        return ms__fail(MS_ERR_DTYPE, "%s: bool reduces with max (logical or) and min (logical and) only, not sum",
                        where);
    return MS_OK;
}

/* `whole` has n times the elements of `part`. */
static ms_status check_n_times(const char *where, int n, const char *whole_name, const ms_tensor *whole,
                               const char *part_name, const ms_tensor *part) {
    int64_t part_numel = ms_tensor_numel(part), want;
    if (ms__mul_ok(part_numel, n, &want) && ms_tensor_numel(whole) == want) return MS_OK;
    char a[200], b[200];
    return ms__fail(MS_ERR_SHAPE, "%s: %s %s has %lld elements, expected %d x %lld (group size x %s's numel; %s %s)",
                    where, whole_name, tensor_str(a, sizeof a, whole), (long long)ms_tensor_numel(whole), n,
                    (long long)part_numel, part_name, part_name, tensor_str(b, sizeof b, part));
}

static bool bytes_overlap(const ms_tensor *a, const ms_tensor *b) {
    const char *pa = ms_tensor_data(a), *pb = ms_tensor_data(b);
    if (!pa || !pb) return false;
    return pa < pb + ms_tensor_nbytes(b) && pb < pa + ms_tensor_nbytes(a);
}

/* `part` is disjoint from `whole` or exactly its slice for this rank (the in-place form). */
static ms_status check_in_place(const ms_comm *c, const char *where, const char *whole_name,
                                const ms_tensor *whole, const char *part_name, const ms_tensor *part) {
    if (!bytes_overlap(whole, part)) return MS_OK;
    const char *slice = (const char *)ms_tensor_data(whole) + c->rank * ms_tensor_nbytes(part);
    if (ms_tensor_data(part) == slice) return MS_OK;
    char a[200], b[200];
    return ms__fail(MS_ERR_ARG, "%s: %s %s overlaps %s %s but is not its slice for group rank %d (the in-place form)",
                    where, part_name, tensor_str(a, sizeof a, part), whole_name, tensor_str(b, sizeof b, whole),
                    c->rank);
}

/* A checked call for the backend: a collective (call) or a batch of sends and receives. */
typedef struct queued_call {
    ms_comm *c;
    const ms_coll *call;
    const ms_p2p_batch *batch;
} queued_call;

static ms_status run_queued(void *p) {
    queued_call *q = p;
    const ms_backend *b = q->c->world->backend;
    return q->call ? b->collective(q->c, q->call) : b->p2p(q->c, q->batch);
}

/* Hands a checked call to the backend; a failure there makes the comm unusable.  Once the
 * rank has a communication thread (its shard units queue collectives there), a call on an
 * untagged group, which the units' groups are, queues behind theirs: the rank's collectives
 * then reach the group in program order, as on its peers, instead of racing the pending
 * ones.  Tagged groups (ms_comm_group_tagged) match apart and run at once. */
static ms_status dispatch(queued_call *q) {
    ms_comm *c = q->c;
    ms_status st;
    if (c->group->tag == 0 && ms__async_elsewhere(c->world, c->group->world_ranks[c->rank]))
        st = ms__async_run(c->world, c->group->world_ranks[c->rank], run_queued, q);
    else
        st = run_queued(q);
    if (st) {
        c->unusable = true;
        snprintf(c->failure, sizeof c->failure, "%s", ms_last_error());
        return st;
    }
    return ms__ok();
}

static ms_status run(ms_comm *c, const ms_coll *unlabelled) {
    ms_coll labelled = *unlabelled;
    ms__coll_set_label(&labelled);
    return dispatch(&(queued_call){.c = c, .call = &labelled});
}

/* ---------------------------------------------------------------- collectives */

ms_status ms_all_gather(ms_comm *c, ms_tensor *out, const ms_tensor *in) {
    MS_NOT_NULL(c);
    MS_NOT_NULL(out);
    MS_NOT_NULL(in);
    char where[320];
    ms_status st = check_comm(c, ms__coll_name(MS_COLL_ALL_GATHER), where, sizeof where);
    if (!st) st = check_tensor(c, where, "out", out);
    if (!st) st = check_tensor(c, where, "in", in);
    if (!st) st = check_same_dtype(where, out, in);
    if (!st) st = check_n_times(where, c->group->n, "out", out, "in", in);
    if (!st) st = check_in_place(c, where, "out", out, "in", in);
    if (st) return st;
    ms_coll call = {.kind = MS_COLL_ALL_GATHER, .dtype = in->dtype, .count = ms_tensor_numel(in),
                    .send = ms_tensor_data(in), .recv = ms_tensor_data(out)};
    return run(c, &call);
}

ms_status ms_reduce_scatter(ms_comm *c, ms_tensor *out, const ms_tensor *in, ms_op op) {
    MS_NOT_NULL(c);
    MS_NOT_NULL(out);
    MS_NOT_NULL(in);
    char where[320];
    ms_status st = check_comm(c, ms__coll_name(MS_COLL_REDUCE_SCATTER), where, sizeof where);
    if (!st) st = check_tensor(c, where, "out", out);
    if (!st) st = check_tensor(c, where, "in", in);
    if (!st) st = check_same_dtype(where, out, in);
    if (!st) st = check_op(where, op, in->dtype);
    if (!st) st = check_n_times(where, c->group->n, "in", in, "out", out);
    if (!st) st = check_in_place(c, where, "in", in, "out", out);
    if (st) return st;
    ms_coll call = {.kind = MS_COLL_REDUCE_SCATTER, .dtype = in->dtype, .op = op, .count = ms_tensor_numel(out),
                    .send = ms_tensor_data(in), .recv = ms_tensor_data(out)};
    return run(c, &call);
}

ms_status ms_all_reduce(ms_comm *c, ms_tensor *t, ms_op op) {
    MS_NOT_NULL(c);
    MS_NOT_NULL(t);
    char where[320];
    ms_status st = check_comm(c, ms__coll_name(MS_COLL_ALL_REDUCE), where, sizeof where);
    if (!st) st = check_tensor(c, where, "t", t);
    if (!st) st = check_op(where, op, t->dtype);
    if (st) return st;
    ms_coll call = {.kind = MS_COLL_ALL_REDUCE, .dtype = t->dtype, .op = op, .count = ms_tensor_numel(t),
                    .send = ms_tensor_data(t), .recv = ms_tensor_data(t)};
    return run(c, &call);
}

ms_status ms_broadcast(ms_comm *c, ms_tensor *t, int root) {
    MS_NOT_NULL(c);
    MS_NOT_NULL(t);
    char where[320];
    ms_status st = check_comm(c, ms__coll_name(MS_COLL_BROADCAST), where, sizeof where);
    if (!st) st = check_tensor(c, where, "t", t);
    if (!st && (root < 0 || root >= c->group->n))
        st = ms__fail(MS_ERR_ARG, "%s: root %d is not a group rank (0..%d)", where, root, c->group->n - 1);
    if (st) return st;
    ms_coll call = {.kind = MS_COLL_BROADCAST, .dtype = t->dtype, .root = root, .count = ms_tensor_numel(t),
                    .send = ms_tensor_data(t), .recv = ms_tensor_data(t)};
    return run(c, &call);
}

ms_status ms_all_to_all(ms_comm *c, ms_tensor *out, const ms_tensor *in) {
    MS_NOT_NULL(c);
    MS_NOT_NULL(out);
    MS_NOT_NULL(in);
    char where[320], a[200], b[200];
    ms_status st = check_comm(c, ms__coll_name(MS_COLL_ALL_TO_ALL), where, sizeof where);
    if (!st) st = check_tensor(c, where, "out", out);
    if (!st) st = check_tensor(c, where, "in", in);
    if (!st) st = check_same_dtype(where, out, in);
    if (st) return st;
    int64_t numel = ms_tensor_numel(in);
    if (ms_tensor_numel(out) != numel || numel % c->group->n)
        return ms__fail(MS_ERR_SHAPE, "%s: out %s and in %s must have equal numel divisible by the group size %d",
                        where, tensor_str(a, sizeof a, out), tensor_str(b, sizeof b, in), c->group->n);
    if (bytes_overlap(out, in))
        return ms__fail(MS_ERR_ARG, "%s: out %s and in %s overlap (all_to_all has no in-place form)", where,
                        tensor_str(a, sizeof a, out), tensor_str(b, sizeof b, in));
    ms_coll call = {.kind = MS_COLL_ALL_TO_ALL, .dtype = in->dtype, .count = numel,
                    .send = ms_tensor_data(in), .recv = ms_tensor_data(out)};
    return run(c, &call);
}

ms_status ms_barrier(ms_comm *c) {
    MS_NOT_NULL(c);
    char where[320];
    ms_status st = check_comm(c, ms__coll_name(MS_COLL_BARRIER), where, sizeof where);
    if (st) return st;
    ms_coll call = {.kind = MS_COLL_BARRIER};
    return run(c, &call);
}

/* ---------------------------------------------------------------- point-to-point */

/* Checks op i of a batch on the calling rank (i = -1: a lone send or receive, whose tensor
 * the messages call "t"; else "ops[i].t", and the op "ops[i]") and writes its descriptor. */
static ms_status check_p2p_op(const ms_comm *c, const char *where, int i, const ms_p2p_op *op, ms_p2p_desc *d) {
    char name[48] = "t", in[48] = "";
    if (i >= 0) snprintf(name, sizeof name, "ops[%d].t", i), snprintf(in, sizeof in, "ops[%d]: ", i);
    if (op->op != MS_P2P_SEND && op->op != MS_P2P_RECV)
        return ms__fail(MS_ERR_ARG, "%s: %sinvalid op %d (expected MS_P2P_SEND or MS_P2P_RECV)", where, in,
                        (int)op->op);
    ms_status st = check_tensor(c, where, name, op->t);
    if (st) return st;
    if (op->peer < 0 || op->peer >= c->group->n)
        return ms__fail(MS_ERR_ARG, "%s: %speer %d is not a group rank (0..%d)", where, in, op->peer, c->group->n - 1);
    if (op->peer == c->rank)
        return ms__fail(MS_ERR_ARG, "%s: %speer %d is this rank (a rank cannot %s itself)", where, in, op->peer,
                        op->op == MS_P2P_SEND ? "send to" : "receive from");
    if (op->tag < 0) return ms__fail(MS_ERR_ARG, "%s: %stag %d is negative", where, in, op->tag);
    *d = (ms_p2p_desc){.kind = op->op, .tag = op->tag, .dtype = op->t->dtype, .ndim = op->t->ndim};
    for (int k = 0; k < op->t->ndim; k++) d->shape[k] = op->t->shape[k];
    return MS_OK;
}

/* The public point-to-point calls once c and ops are known not to be NULL: each op checked on
 * the calling rank (a rank refused here has not joined: its comm stays usable), then the
 * batch grouped by peer (a counting sort that keeps each peer's ops in batch order) for the
 * backend.  one: a lone send or receive, whose tensor the messages call "t". */
static ms_status p2p(ms_comm *c, const char *name, const ms_p2p_op *ops, int n, bool one) {
    char where[320];
    ms_status st = check_comm(c, name, where, sizeof where);
    if (st) return st;
    if (n < 0) return ms__fail(MS_ERR_ARG, "%s: n %d is negative", where, n);
    if (n == 0) return ms__ok();
    const int g = c->group->n;
    /* one block: the descriptors as given and as sorted, the data pointers, the peers, and
     * pos (g + 1): the ops per peer, then where each peer's start */
    ms_p2p_desc *given = malloc(2 * (size_t)n * sizeof *given + (size_t)n * sizeof(void *) +
                                (size_t)n * sizeof(ms_p2p_peer) + ((size_t)g + 1) * sizeof(int));
    if (!given) return ms__fail(MS_ERR_OOM, "%s: out of memory for a batch of %d", where, n);
    ms_p2p_desc *sorted = given + n;
    void **data = (void **)(sorted + n);
    ms_p2p_peer *peers = (ms_p2p_peer *)(data + n);
    int *pos = (int *)(peers + n);
    for (int i = 0; i < n && !st; i++) st = check_p2p_op(c, where, one ? -1 : i, &ops[i], &given[i]);
    for (int i = 0; i < n && !st; i++) /* a received tensor overlaps no other tensor of the batch */
        for (int j = 0; j < n && !st; j++) {
            if (i == j || ops[i].op != MS_P2P_RECV || !bytes_overlap(ops[i].t, ops[j].t)) continue;
            char a[200], b[200];
            st = ms__fail(MS_ERR_ARG, "%s: ops[%d].t %s, received into, overlaps ops[%d].t %s", where, i,
                          tensor_str(a, sizeof a, ops[i].t), j, tensor_str(b, sizeof b, ops[j].t));
        }
    if (!st) {
        for (int p = 0; p <= g; p++) pos[p] = 0;
        for (int i = 0; i < n; i++) pos[ops[i].peer + 1]++;
        int npeers = 0;
        for (int p = 0; p < g; p++) {
            if (pos[p + 1]) peers[npeers++] = (ms_p2p_peer){.peer = p, .first = pos[p], .count = pos[p + 1]};
            pos[p + 1] += pos[p]; /* from count to where peer p + 1's ops start */
        }
        for (int i = 0; i < n; i++) {
            int k = pos[ops[i].peer]++;
            sorted[k] = given[i];
            data[k] = ms_tensor_data(ops[i].t);
        }
        ms_p2p_batch batch = {.n = n, .npeers = npeers, .descs = sorted, .data = data, .peers = peers};
        st = dispatch(&(queued_call){.c = c, .batch = &batch});
    }
    free(given);
    return st;
}

ms_status ms_send(ms_comm *c, const ms_tensor *t, int peer, int tag) {
    MS_NOT_NULL(c);
    MS_NOT_NULL(t);
    ms_p2p_op op = {.op = MS_P2P_SEND, .t = (ms_tensor *)t, .peer = peer, .tag = tag};
    return p2p(c, "send", &op, 1, true);
}

ms_status ms_recv(ms_comm *c, ms_tensor *t, int peer, int tag) {
    MS_NOT_NULL(c);
    MS_NOT_NULL(t);
    ms_p2p_op op = {.op = MS_P2P_RECV, .t = t, .peer = peer, .tag = tag};
    return p2p(c, "recv", &op, 1, true);
}

ms_status ms_batch_p2p(ms_comm *c, const ms_p2p_op *ops, int n) {
    MS_NOT_NULL(c);
    if (n != 0) MS_NOT_NULL(ops);
    return p2p(c, "batch_p2p", ops, n, false);
}
