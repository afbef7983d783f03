/*
 * mesh.c: device meshes.  Ordered named axes, row-major rank <->
 * coordinates, and one group per axis or per flattened set of axes, made on first use and
 * cached for the mesh's life.
 */
#include "ms_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MS_MESH_MAX_AXES = MS_MAX_DIMS, MS_AXIS_NAME_MAX = 63 };

typedef struct mesh_group {
    int naxes;
    int axes[MS_MESH_MAX_AXES];
    ms_comm *comm;
    struct mesh_group *next;
} mesh_group;

struct ms_mesh {
    atomic_int refcount;
    int naxes;
    char names[MS_MESH_MAX_AXES][MS_AXIS_NAME_MAX + 1];
    int64_t sizes[MS_MESH_MAX_AXES];
    int64_t size;     /* product of sizes */
    ms_comm *world;   /* retained; NULL for a shape-only mesh */
    mesh_group *groups;
};

ms_status ms_mesh_new(ms_mesh **out, int naxes, const char *const *names, const int64_t *sizes,
                      ms_comm *world) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(names);
    MS_NOT_NULL(sizes);
    if (naxes < 1 || naxes > MS_MESH_MAX_AXES)
        return ms__fail(MS_ERR_ARG, "mesh: a mesh has 1 to %d axes, got %d", MS_MESH_MAX_AXES, naxes);
    int64_t product = 1;
    for (int i = 0; i < naxes; i++) {
        if (!names[i] || !names[i][0]) return ms__fail(MS_ERR_ARG, "mesh: axis %d has no name", i);
        if (strlen(names[i]) > MS_AXIS_NAME_MAX)
            return ms__fail(MS_ERR_ARG, "mesh: axis name '%.20s...' is longer than %d characters", names[i],
                            MS_AXIS_NAME_MAX);
        for (int j = 0; j < i; j++)
            if (strcmp(names[i], names[j]) == 0)
                return ms__fail(MS_ERR_ARG, "mesh: axis name '%s' appears twice (axes %d and %d)", names[i], j, i);
        if (sizes[i] < 1)
            return ms__fail(MS_ERR_ARG, "mesh: axis '%s' has size %lld; sizes must be >= 1", names[i],
                            (long long)sizes[i]);
        if (!ms__mul_ok(product, sizes[i], &product))
            return ms__fail(MS_ERR_OVERFLOW, "mesh: the product of the axis sizes overflows int64");
    }
    if (world && product != ms_comm_size(world)) {
        char buf[512];
        size_t len = 0;
        for (int i = 0; i < naxes && len < sizeof buf; i++)
            len += (size_t)snprintf(buf + len, sizeof buf - len, "%s%s=%lld", i ? " x " : "", names[i],
                                    (long long)sizes[i]);
        return ms__fail(MS_ERR_SHAPE, "mesh: %s has %lld ranks but the world has %d", buf, (long long)product,
                        ms_comm_size(world));
    }
    ms_mesh *m = calloc(1, sizeof *m);
    if (!m) return ms__fail(MS_ERR_OOM, "mesh: out of memory");
    atomic_init(&m->refcount, 1);
    m->naxes = naxes;
    for (int i = 0; i < naxes; i++) {
        strcpy(m->names[i], names[i]);
        m->sizes[i] = sizes[i];
    }
    m->size = product;
    m->world = world;
    if (world) ms_comm_retain(world);
    *out = m;
    return ms__ok();
}

void ms_mesh_retain(ms_mesh *m) {
    if (m) atomic_fetch_add(&m->refcount, 1);
}

void ms_mesh_release(ms_mesh *m) {
    if (!m || atomic_fetch_sub(&m->refcount, 1) != 1) return;
    for (mesh_group *g = m->groups, *next; g; g = next) {
        next = g->next;
        ms_comm_release(g->comm);
        free(g);
    }
    ms_comm_release(m->world);
    free(m);
}

int ms_mesh_ndim(const ms_mesh *m) {
    MS_NOT_NULL_OR(m, -1);
    return m->naxes;
}
const char *ms_mesh_axis_name(const ms_mesh *m, int axis) {
    MS_NOT_NULL_OR(m, NULL);
    return axis >= 0 && axis < m->naxes ? m->names[axis] : NULL;
}
int64_t ms_mesh_axis_size(const ms_mesh *m, int axis) {
    MS_NOT_NULL_OR(m, -1);
    return axis >= 0 && axis < m->naxes ? m->sizes[axis] : -1;
}
int ms_mesh_axis_index(const ms_mesh *m, const char *name) {
    MS_NOT_NULL_OR(m, -1);
    MS_NOT_NULL_OR(name, -1);
    for (int i = 0; i < m->naxes; i++)
        if (strcmp(m->names[i], name) == 0) return i;
    return -1;
}
int64_t ms_mesh_size(const ms_mesh *m) {
    MS_NOT_NULL_OR(m, -1);
    return m->size;
}
int64_t ms_mesh_rank(const ms_mesh *m) {
    MS_NOT_NULL_OR(m, -1);
    return m->world ? ms_comm_rank(m->world) : -1;
}

ms_status ms_mesh_coords(const ms_mesh *m, int64_t rank, int64_t *coords) {
    MS_NOT_NULL(m);
    MS_NOT_NULL(coords);
    if (rank < 0 || rank >= m->size)
        return ms__fail(MS_ERR_ARG, "mesh coords: rank %lld out of range for a mesh of %lld ranks",
                        (long long)rank, (long long)m->size);
    for (int i = m->naxes - 1; i >= 0; i--) {
        coords[i] = rank % m->sizes[i];
        rank /= m->sizes[i];
    }
    return ms__ok();
}

ms_status ms_mesh_rank_of(const ms_mesh *m, const int64_t *coords, int64_t *rank) {
    MS_NOT_NULL(m);
    MS_NOT_NULL(coords);
    MS_NOT_NULL(rank);
    int64_t r = 0;
    for (int i = 0; i < m->naxes; i++) {
        if (coords[i] < 0 || coords[i] >= m->sizes[i])
            return ms__fail(MS_ERR_ARG, "mesh rank_of: coordinate %lld out of range for axis '%s' of size %lld",
                            (long long)coords[i], m->names[i], (long long)m->sizes[i]);
        r = r * m->sizes[i] + coords[i];
    }
    *rank = r;
    return ms__ok();
}

static ms_status check_axes(const ms_mesh *m, int naxes, const int *axes) {
    if (naxes < 1 || naxes > m->naxes)
        return ms__fail(MS_ERR_ARG, "mesh group: need 1 to %d axes, got %d", m->naxes, naxes);
    for (int i = 0; i < naxes; i++) {
        if (axes[i] < 0 || axes[i] >= m->naxes)
            return ms__fail(MS_ERR_ARG, "mesh group: axis index %d out of range for a %d-axis mesh", axes[i],
                            m->naxes);
        if (i > 0 && axes[i] <= axes[i - 1])
            return ms__fail(MS_ERR_ARG,
                            "mesh group: axes '%s' and '%s' are not in mesh order (flattened axes are given in "
                            "the mesh's order, as torch DeviceMesh slicing requires)",
                            m->names[axes[i - 1]], m->names[axes[i]]);
    }
    return MS_OK;
}

ms_status ms_mesh_group_ranks(const ms_mesh *m, int naxes, const int *axes, int64_t rank,
                              int64_t *ranks, int64_t *count) {
    MS_NOT_NULL(m);
    MS_NOT_NULL(axes);
    MS_NOT_NULL(ranks);
    MS_NOT_NULL(count);
    ms_status st = check_axes(m, naxes, axes);
    if (st) return st;
    int64_t coords[MS_MESH_MAX_AXES];
    if ((st = ms_mesh_coords(m, rank, coords))) return st;
    int64_t n = 1;
    for (int i = 0; i < naxes; i++) n *= m->sizes[axes[i]];
    /* Enumerate the selected axes row-major in the order given (last varies fastest). */
    for (int i = 0; i < naxes; i++) coords[axes[i]] = 0;
    for (int64_t k = 0; k < n; k++) {
        ms_mesh_rank_of(m, coords, &ranks[k]);
        for (int i = naxes - 1; i >= 0; i--) {
            if (++coords[axes[i]] < m->sizes[axes[i]]) break;
            coords[axes[i]] = 0;
        }
    }
    *count = n;
    return ms__ok();
}

ms_status ms_mesh_group(ms_mesh *m, int naxes, const int *axes, ms_comm **out) {
    MS_NOT_NULL(m);
    MS_NOT_NULL(axes);
    MS_NOT_NULL(out);
    ms_status st = check_axes(m, naxes, axes);
    if (st) return st;
    if (!m->world)
        return ms__fail(MS_ERR_STATE, "mesh group: this mesh has no ranks behind it (a shape-only mesh)");
    for (mesh_group *g = m->groups; g; g = g->next)
        if (g->naxes == naxes && !memcmp(g->axes, axes, (size_t)naxes * sizeof *axes)) {
            ms_comm_retain(g->comm);
            *out = g->comm;
            return ms__ok();
        }
    int64_t n = 1;
    for (int i = 0; i < naxes; i++) n *= m->sizes[axes[i]];
    int64_t *ranks = malloc((size_t)n * sizeof *ranks);
    int *world_ranks = malloc((size_t)n * sizeof *world_ranks);
    mesh_group *g = calloc(1, sizeof *g);
    if (!ranks || !world_ranks || !g) {
        free(ranks), free(world_ranks), free(g);
        return ms__fail(MS_ERR_OOM, "mesh group: out of memory");
    }
    ms_mesh_group_ranks(m, naxes, axes, ms_comm_rank(m->world), ranks, &n);
    /* Axes in mesh order make the row-major group order increasing in rank.  Mesh ranks are
     * ranks of the mesh's comm, which may itself be a subgroup: translate to world ranks. */
    for (int64_t k = 0; k < n; k++) world_ranks[k] = ms_comm_world_rank(m->world, (int)ranks[k]);
    st = ms_comm_group(m->world, (int)n, world_ranks, &g->comm);
    free(ranks);
    free(world_ranks);
    if (st) {
        free(g);
        return ms__wrap(st, "mesh group");
    }
    g->naxes = naxes;
    memcpy(g->axes, axes, (size_t)naxes * sizeof *axes);
    g->next = m->groups;
    m->groups = g;
    ms_comm_retain(g->comm);
    *out = g->comm;
    return ms__ok();
}
