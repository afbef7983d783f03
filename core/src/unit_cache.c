/*
 * unit_cache.c: the shard units' buffers: buf_new and buf_free, the rank's cache of
 * transient buffers behind them, and the memory accounting over both (ms_unit_bytes,
 * ms_unit_rank_allocated).
 */
#include "unit_internal.h"

#include <stdlib.h>
#include <string.h>

/*
 * The buffer cache.  A step makes and drops the same transient buffers again and again:
 * the flat gather and reduce buffers, the unsharded parameters and gradients, the k-way
 * shard, the sync-off accumulator (all of category unsharded; the shards, gradient shards
 * and optimizer states are made once and stay).  Fresh memory costs a page fault and a
 * kernel zero-fill per page, which on a CPU rank cost as much as the collectives
 * themselves, so buf_free keeps freed transient buffers in a cache for buf_new to hand out
 * again: a steady-state step allocates nothing.
 *   - One cache per (world, world rank), shared by all units of the rank and created with
 *     the first of them: a buffer freed by unit i is reused by unit i+1, as a caching device
 *     allocator would, so the cache holds about the rank's peak of live transient buffers
 *     (one or two units' worth), not an unsharded copy of every unit.  It has its own lock
 *     (units of a rank may be driven from several threads, one at a time each).
 *   - Buffers are matched by (dtype, numel) exactly and handed out as a view of the wanted
 *     shape; the last freed is reused first (warm in cache).  The number of buffers of one
 *     size never exceeds the most that were live at once, so the cache is bounded.
 *   - Only a buffer nothing else references is kept: if a caller still holds the tensor or
 *     a view of it (ms_tensor_retain on a borrowed tensor), it is released as before and
 *     lives on in the caller's hands; the cache never hands out memory someone can reach.
 *     The state rules are unchanged: after reshard, param_full is an error whether the
 *     memory went to the cache or back to the allocator.
 *   - A reused buffer is not zeroed unless the unit needs zeros: the gather buffer and the
 *     unsharded parameters are overwritten whole, packed buffers get their padding rows
 *     zeroed (move_block), the unsharded gradients and the sync-off accumulator are zeroed.
 *   - Accounting: a cached buffer is no longer counted under params, grads, optimizer or
 *     unsharded; it is counted under category 4 (cached) of the unit that freed it (taking it
 *     moves it to the taker's live category), so summing ms_unit_bytes over the units of a
 *     rank gives everything the rank holds.  ms_unit_release_unsharded and ms_unit_release
 *     free the unit's cached buffers.
 */

/* ---------------------------------------------------------------- the rank's buffer cache */

/* A free buffer: a contiguous tensor whose storage only the cache references, and the unit
 * that freed it (ms_unit_bytes counts it there). */
typedef struct cache_entry {
    ms_tensor *t;
    const ms_unit *owner;
} cache_entry;

/* The free buffers of one dtype and numel: a stack, the last freed reused first. */
typedef struct cache_bin {
    ms_dtype dtype;
    int64_t numel;
    cache_entry *entries; /* (n), capacity cap */
    int n, cap;
} cache_bin;

struct buf_cache {
    ms_world *world;      /* the key: a world (kept alive by the comms of the units using the cache) */
    int rank;             /* and a world rank */
    int users;            /* units using the cache; under cache_registry_lock */
    pthread_mutex_t lock; /* guards the bins */
    cache_bin *bins;      /* (nbins), capacity bcap; a bin stays when it empties */
    int nbins, bcap;
    buf_cache *next;      /* registry link */
    ms__account *account; /* the memory allocated for the rank's units, counted at the allocator
                           * (ms_unit_rank_allocated); categories 0-2 as CAT_*, 3 unsharded and cached */
};

static pthread_mutex_t cache_registry_lock = PTHREAD_MUTEX_INITIALIZER;
static buf_cache *cache_registry; /* every cache in use */

/* A new, empty cache of (w, rank) with its allocation account, or NULL when out of memory. */
static buf_cache *cache_new(ms_world *w, int rank) {
    buf_cache *c = calloc(1, sizeof *c);
    if (c && !(c->account = ms__account_new())) {
        free(c);
        return NULL;
    }
    if (c) {
        c->world = w;
        c->rank = rank;
        pthread_mutex_init(&c->lock, NULL);
    }
    return c;
}

ms_status cache_acquire(ms_world *w, int rank, buf_cache **out) {
    pthread_mutex_lock(&cache_registry_lock);
    buf_cache *c = cache_registry;
    while (c && (c->world != w || c->rank != rank)) c = c->next;
    if (!c && (c = cache_new(w, rank))) {
        c->next = cache_registry;
        cache_registry = c;
    }
    if (c) c->users++;
    pthread_mutex_unlock(&cache_registry_lock);
    *out = c;
    return c ? MS_OK : ms__fail(MS_ERR_OOM, "out of memory creating the buffer cache of rank %d", rank);
}

void cache_release(buf_cache *c) {
    if (!c) return;
    pthread_mutex_lock(&cache_registry_lock);
    const bool last = --c->users == 0;
    if (last) {
        buf_cache **link = &cache_registry;
        while (*link != c) link = &(*link)->next;
        *link = c->next;
    }
    pthread_mutex_unlock(&cache_registry_lock);
    if (!last) return;
    for (int b = 0; b < c->nbins; b++) {
        for (int i = 0; i < c->bins[b].n; i++) ms_tensor_release(c->bins[b].entries[i].t);
        free(c->bins[b].entries);
    }
    free(c->bins);
    pthread_mutex_destroy(&c->lock);
    ms__account_release(c->account);
    free(c);
}

/* A free buffer of (dtype, numel) out of c, or NULL. */
static ms_tensor *cache_take(buf_cache *c, ms_dtype dtype, int64_t numel) {
    ms_tensor *t = NULL;
    if (!c) return NULL;
    pthread_mutex_lock(&c->lock);
    for (int b = 0; b < c->nbins && !t; b++) {
        cache_bin *bin = &c->bins[b];
        if (bin->dtype == dtype && bin->numel == numel && bin->n) t = bin->entries[--bin->n].t;
    }
    pthread_mutex_unlock(&c->lock);
    return t;
}

/* items (capacity *cap elements of `size` bytes) with room for more than n of them: items
 * itself, or a larger copy and *cap its capacity; NULL when out of memory (items intact). */
static void *grow(void *items, int *cap, int n, size_t size) {
    if (n < *cap) return items;
    const int want = *cap ? 2 * *cap : 8;
    void *p = realloc(items, (size_t)want * size);
    if (p) *cap = want;
    return p;
}

/* Keeps t, freed by `owner`, for reuse and takes over the caller's reference; false when t
 * is shared (another reference to it or to its storage: a caller's view, which must keep
 * its memory), empty, or there is no memory to track it: the caller releases it then. */
static bool cache_put(buf_cache *c, ms_tensor *t, const ms_unit *owner) {
    if (!c || ms_tensor_nbytes(t) == 0 || atomic_load(&t->refcount) != 1 || atomic_load(&t->storage->refcount) != 1)
        return false;
    const ms_dtype dtype = ms_tensor_dtype(t);
    const int64_t numel = ms_tensor_numel(t);
    bool kept = false;
    pthread_mutex_lock(&c->lock);
    int b = 0;
    while (b < c->nbins && (c->bins[b].dtype != dtype || c->bins[b].numel != numel)) b++;
    if (b == c->nbins) {
        cache_bin *bins = grow(c->bins, &c->bcap, c->nbins, sizeof *bins);
        if (bins) {
            c->bins = bins;
            c->bins[c->nbins++] = (cache_bin){.dtype = dtype, .numel = numel};
        }
    }
    if (b < c->nbins) {
        cache_bin *bin = &c->bins[b];
        cache_entry *entries = grow(bin->entries, &bin->cap, bin->n, sizeof *entries);
        if (entries) {
            bin->entries = entries;
            bin->entries[bin->n++] = (cache_entry){t, owner};
            kept = true;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return kept;
}

void cache_drop(buf_cache *c, const ms_unit *owner) {
    if (!c) return;
    pthread_mutex_lock(&c->lock);
    for (int b = 0; b < c->nbins; b++) {
        cache_bin *bin = &c->bins[b];
        int kept = 0;
        for (int i = 0; i < bin->n; i++) {
            if (bin->entries[i].owner == owner) ms_tensor_release(bin->entries[i].t);
            else bin->entries[kept++] = bin->entries[i];
        }
        bin->n = kept;
    }
    pthread_mutex_unlock(&c->lock);
}

/* Bytes of the buffers `owner` left in c. */
static int64_t cache_bytes(buf_cache *c, const ms_unit *owner) {
    int64_t bytes = 0;
    if (!c) return 0;
    pthread_mutex_lock(&c->lock);
    for (int b = 0; b < c->nbins; b++)
        for (int i = 0; i < c->bins[b].n; i++)
            if (c->bins[b].entries[i].owner == owner) bytes += ms_tensor_nbytes(c->bins[b].entries[i].t);
    pthread_mutex_unlock(&c->lock);
    return bytes;
}

/* ---------------------------------------------------------------- buffers */

ms_status zero_elems(ms_tensor *t, int64_t off, int64_t n) {
    if (n <= 0) return MS_OK;
    if (ms_tensor_device(t) == MS_DEVICE_CPU) {
        const int64_t es = ms_dtype_size(ms_tensor_dtype(t));
        memset((char *)ms_tensor_data(t) + off * es, 0, (size_t)(n * es));
        return MS_OK;
    }
    ms_tensor *flat = NULL, *part = NULL;
    const int64_t all = ms_tensor_numel(t);
    ms_status st = ms_tensor_view(&flat, t, 1, &all);
    if (!st) st = ms_tensor_narrow(&part, flat, 0, off, n);
    if (!st) st = ms_tensor_fill(part, 0);
    ms_tensor_release(part);
    ms_tensor_release(flat);
    return st;
}

ms_status buf_new(ms_unit *u, int cat, ms_tensor **out, int ndim, const int64_t *shape, ms_dtype dtype,
                  bool zero) {
    int64_t numel;
    ms_status st = ms__check_shape(ndim, shape, &numel);
    ms_tensor *cached = st || !numel || cat != MS_BYTES_UNSHARDED ? NULL : cache_take(u->cache, dtype, numel);
    const bool on_device = u->device >= 0 && (cat == MS_BYTES_UNSHARDED || !u->offload);
    if (cached) {
        st = ms_tensor_view(out, cached, ndim, shape); /* the view holds the storage alone */
        ms_tensor_release(cached);
        if (!st && zero) st = zero_elems(*out, 0, numel);
    } else if (!st) {
        /* counted at the allocator: cached buffers are transient ones, so 3 holds both */
        const ms__account_scope outer = ms__account_enter(u->cache->account, cat < MS_BYTES_UNSHARDED ? cat : MS_BYTES_UNSHARDED);
        st = ms_tensor_new(out, ndim, shape, dtype, on_device ? MS_DEVICE_CUDA : MS_DEVICE_CPU,
                           on_device ? u->device : 0);
        ms__account_leave(outer);
    }
    if (st) return ms__wrap(st, "unit '%s'", unit_label(u));
    u->bytes[cat] += ms_tensor_nbytes(*out);
    return MS_OK;
}

void buf_free(ms_unit *u, int cat, ms_tensor **t) {
    if (!*t) return;
    u->bytes[cat] -= ms_tensor_nbytes(*t);
    if (cat != MS_BYTES_UNSHARDED || !cache_put(u->cache, *t, u)) ms_tensor_release(*t);
    *t = NULL;
}

/* ---------------------------------------------------------------- audits */

int64_t ms_unit_bytes(const ms_unit *u, ms_bytes_category category) {
    MS_NOT_NULL_OR(u, -1);
    if ((int)category < 0 || (int)category >= CAT_COUNT) return -1;
    return category == MS_BYTES_CACHED ? cache_bytes(u->cache, u) : u->bytes[category];
}

int64_t ms_unit_rank_allocated(const ms_unit *u, ms_bytes_category category) {
    MS_NOT_NULL_OR(u, -1);
    if ((int)category < 0 || (int)category >= MS__ACCOUNT_CATS) {
        ms__fail(MS_ERR_ARG, "unit '%s': rank_allocated: category %d: expected 0 (shards), 1 (gradient shards), "
                 "2 (optimizer state) or 3 (unsharded and cached buffers)", unit_label(u), (int)category);
        return -1;
    }
    return atomic_load(&u->cache->account->bytes[category]);
}
