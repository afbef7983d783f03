/*
 * ms_lua_mesh.c: the Lua 5.4 binding's world (ms.rank, ms.world_size, ...), meshes, groups
 * and their collectives, and the layout functions (local_shape, fsdp_shard, chunk_extent).
 *
 * The world: the moonshard executable stores each rank's world comm in the registry
 * (ms_lua_set_world) before the script runs.  A stock lua5.4 that does
 * `require "moonshard"` gets a world of one rank, made on first use.
 */
#include "ms_lua_internal.h"

#include <lauxlib.h>
#include <lua.h>

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define WORLD_KEY "moonshard.world"     /* light userdata: ms_comm * of this rank */
#define WORLD_OWNER_KEY "moonshard.world_owner" /* full userdata owning a 1-rank world */

DEFINE_RELEASE(mesh_gc, MESH_MT, ms_mesh_release)
DEFINE_RELEASE(group_gc, GROUP_MT, ms_comm_release)

/* ---------------------------------------------------------------- world */

void ms_lua_set_world(lua_State *L, ms_comm *world) {
    lua_pushlightuserdata(L, world);
    lua_setfield(L, LUA_REGISTRYINDEX, WORLD_KEY);
}

typedef struct { ms_world *w; ms_comm *c; } world_owner;

static int world_owner_gc(lua_State *L) {
    world_owner *o = lua_touserdata(L, 1);
    ms_comm_release(o->c);
    ms_world_release(o->w);
    o->c = NULL;
    o->w = NULL;
    return 0;
}

static ms_comm *get_world(lua_State *L) {
    lua_getfield(L, LUA_REGISTRYINDEX, WORLD_KEY);
    ms_comm *c = lua_touserdata(L, -1);
    lua_pop(L, 1);
    if (c) return c;
    /* No launcher: this Lua state is rank 0 of 1. */
    world_owner *o = lua_newuserdatauv(L, sizeof *o, 0);
    o->w = NULL;
    o->c = NULL;
    lua_newtable(L);
    lua_pushcfunction(L, world_owner_gc);
    lua_setfield(L, -2, "__gc");
    lua_setmetatable(L, -2);
    CHECK(L, ms_threads_world_new(&o->w, 1, 0));
    CHECK(L, ms_world_comm(o->w, 0, &o->c));
    lua_setfield(L, LUA_REGISTRYINDEX, WORLD_OWNER_KEY);
    ms_lua_set_world(L, o->c);
    return o->c;
}

int l_rank(lua_State *L) {
    lua_pushinteger(L, ms_comm_rank(get_world(L)));
    return 1;
}
int l_world_size(lua_State *L) {
    lua_pushinteger(L, ms_comm_size(get_world(L)));
    return 1;
}
int l_backend(lua_State *L) {
    lua_pushstring(L, ms_comm_backend(get_world(L)));
    return 1;
}

/* device() -> where this rank's tensors go: "cuda:N" (its GPU) on the nccl backend, else "cpu" */
int l_device(lua_State *L) {
    ms_device_type type = MS_DEVICE_CPU;
    int index = -1;
    CHECK(L, ms_comm_device(get_world(L), &type, &index));
    if (type == MS_DEVICE_CUDA) lua_pushfstring(L, "cuda:%d", index);
    else lua_pushliteral(L, "cpu");
    return 1;
}

/* ---------------------------------------------------------------- meshes */

/* ms.mesh({{"dp_replicate", 2}, {"dp_shard", 4}}, {shape_only = true}?) */
int l_mesh(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    int n = (int)luaL_len(L, 1);
    if (n < 1 || n > MS_MAX_DIMS)
        return luaL_error(L, "moonshard invalid_argument error: mesh: expected 1 to %d axes like {{\"dp_shard\", 4}}, got %d", MS_MAX_DIMS, n);
    const char *names[MS_MAX_DIMS];
    int64_t sizes[MS_MAX_DIMS];
    for (int i = 0; i < n; i++) {
        lua_geti(L, 1, i + 1);
        if (!lua_istable(L, -1))
            return luaL_error(L, "moonshard invalid_argument error: mesh: axis %d is %s, expected {name, size}", i + 1, luaL_typename(L, -1));
        lua_geti(L, -1, 1);
        lua_geti(L, -2, 2);
        int ok;
        names[i] = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
        sizes[i] = (int64_t)lua_tointegerx(L, -1, &ok);
        if (!names[i] || !ok)
            return luaL_error(L, "moonshard invalid_argument error: mesh: axis %d must be {name, size} with a string and an integer", i + 1);
        lua_pop(L, 2); /* names[i] stays alive: the axis table is kept on the stack */
    }
    bool shape_only = false;
    if (lua_istable(L, 2)) {
        lua_getfield(L, 2, "shape_only");
        shape_only = lua_toboolean(L, -1);
        lua_pop(L, 1);
    }
    ms_comm *world = shape_only ? NULL : get_world(L);
    box *b = box_new(L, MESH_MT);
    ms_mesh *m;
    CHECK(L, ms_mesh_new(&m, n, names, sizes, world));
    b->h = m;
    return 1;
}

static int axis_index(lua_State *L, ms_mesh *m, int idx) {
    const char *name = luaL_checkstring(L, idx);
    int a = ms_mesh_axis_index(m, name);
    if (a < 0) {
        luaL_Buffer buf;
        luaL_buffinit(L, &buf);
        for (int i = 0; i < ms_mesh_ndim(m); i++) {
            if (i) luaL_addstring(&buf, ", ");
            luaL_addstring(&buf, ms_mesh_axis_name(m, i));
        }
        luaL_pushresult(&buf);
        luaL_error(L, "moonshard invalid_argument error: mesh has no axis '%s' (axes: %s)", name, lua_tostring(L, -1));
    }
    return a;
}

static int m_size(lua_State *L) {
    ms_mesh *m = check_mesh(L, 1);
    if (lua_isnoneornil(L, 2)) lua_pushinteger(L, (lua_Integer)ms_mesh_size(m));
    else lua_pushinteger(L, (lua_Integer)ms_mesh_axis_size(m, axis_index(L, m, 2)));
    return 1;
}

static int m_axes(lua_State *L) {
    ms_mesh *m = check_mesh(L, 1);
    lua_createtable(L, ms_mesh_ndim(m), 0);
    for (int i = 0; i < ms_mesh_ndim(m); i++) {
        lua_pushstring(L, ms_mesh_axis_name(m, i));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int64_t opt_rank(lua_State *L, ms_mesh *m, int idx) {
    if (!lua_isnoneornil(L, idx)) return luaL_checkinteger(L, idx);
    int64_t r = ms_mesh_rank(m);
    if (r < 0) luaL_error(L, "moonshard invalid_argument error: a shape-only mesh has no rank of its own; pass a rank");
    return r;
}

static int m_rank(lua_State *L) {
    ms_mesh *m = check_mesh(L, 1);
    int64_t r = ms_mesh_rank(m);
    if (r < 0) lua_pushnil(L);
    else lua_pushinteger(L, (lua_Integer)r);
    return 1;
}

static int m_coords(lua_State *L) {
    ms_mesh *m = check_mesh(L, 1);
    int64_t c[MS_MAX_DIMS];
    CHECK(L, ms_mesh_coords(m, opt_rank(L, m, 2), c));
    lua_createtable(L, 0, ms_mesh_ndim(m));
    for (int i = 0; i < ms_mesh_ndim(m); i++) {
        lua_pushinteger(L, (lua_Integer)c[i]);
        lua_setfield(L, -2, ms_mesh_axis_name(m, i));
    }
    return 1;
}

/* An axis name or a sequence of names -> axis indices. */
static int check_axes(lua_State *L, ms_mesh *m, int idx, int *axes) {
    if (lua_type(L, idx) == LUA_TSTRING) {
        axes[0] = axis_index(L, m, idx);
        return 1;
    }
    luaL_checktype(L, idx, LUA_TTABLE);
    int n = (int)luaL_len(L, idx);
    if (n < 1 || n > ms_mesh_ndim(m))
        luaL_error(L, "moonshard invalid_argument error: mesh group: expected 1 to %d axis names, got %d", ms_mesh_ndim(m), n);
    for (int i = 0; i < n; i++) {
        lua_geti(L, idx, i + 1);
        axes[i] = axis_index(L, m, lua_gettop(L));
        lua_pop(L, 1);
    }
    return n;
}

static int m_group(lua_State *L) {
    ms_mesh *m = check_mesh(L, 1);
    int axes[MS_MAX_DIMS];
    int n = check_axes(L, m, 2, axes);
    box *b = box_new(L, GROUP_MT);
    ms_comm *c;
    CHECK(L, ms_mesh_group(m, n, axes, &c));
    b->h = c;
    return 1;
}

/* mesh:group_ranks(axes, rank?) -> the mesh ranks of that group, without communicating */
static int m_group_ranks(lua_State *L) {
    ms_mesh *m = check_mesh(L, 1);
    int axes[MS_MAX_DIMS];
    int n = check_axes(L, m, 2, axes);
    int64_t count = 1;
    for (int i = 0; i < n; i++) count *= ms_mesh_axis_size(m, axes[i]);
    int64_t rank = opt_rank(L, m, 3); /* before the scratch userdata takes slot 3 */
    int64_t *ranks = lua_newuserdatauv(L, (size_t)count * sizeof *ranks, 0);
    CHECK(L, ms_mesh_group_ranks(m, n, axes, rank, ranks, &count));
    push_int_list(L, ranks, (int)count);
    return 1;
}

static int m_tostring(lua_State *L) {
    box *b = luaL_checkudata(L, 1, MESH_MT);
    if (!b->h) {
        lua_pushliteral(L, "mesh (released)");
        return 1;
    }
    ms_mesh *m = b->h;
    luaL_Buffer buf;
    luaL_buffinit(L, &buf);
    luaL_addstring(&buf, "mesh(");
    for (int i = 0; i < ms_mesh_ndim(m); i++) {
        lua_pushfstring(L, i ? ", %s=%I" : "%s=%I", ms_mesh_axis_name(m, i), (lua_Integer)ms_mesh_axis_size(m, i));
        luaL_addvalue(&buf);
    }
    luaL_addchar(&buf, ')');
    luaL_pushresult(&buf);
    return 1;
}

/* ---------------------------------------------------------------- groups */

static ms_op opt_op(lua_State *L, int idx) {
    if (lua_isnoneornil(L, idx)) return MS_OP_SUM;
    ms_op op;
    ms_status st = ms_op_parse(luaL_checkstring(L, idx), &op);
    if (st) ms_lua_fail(L, st);
    return op;
}

static int g_size(lua_State *L) {
    lua_pushinteger(L, ms_comm_size(check_group(L, 1)));
    return 1;
}
static int g_rank(lua_State *L) {
    lua_pushinteger(L, ms_comm_rank(check_group(L, 1)));
    return 1;
}
static int g_ranks(lua_State *L) {
    ms_comm *c = check_group(L, 1);
    int n = ms_comm_size(c);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, ms_comm_world_rank(c, i));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int g_all_gather(lua_State *L) {
    CHECK(L, ms_all_gather(check_group(L, 1), check_tensor(L, 2), check_tensor(L, 3)));
    lua_settop(L, 2);
    return 1;
}
static int g_reduce_scatter(lua_State *L) {
    CHECK(L, ms_reduce_scatter(check_group(L, 1), check_tensor(L, 2), check_tensor(L, 3), opt_op(L, 4)));
    lua_settop(L, 2);
    return 1;
}
static int g_all_reduce(lua_State *L) {
    CHECK(L, ms_all_reduce(check_group(L, 1), check_tensor(L, 2), opt_op(L, 3)));
    lua_settop(L, 2);
    return 1;
}
static int g_broadcast(lua_State *L) {
    CHECK(L, ms_broadcast(check_group(L, 1), check_tensor(L, 2), check_int(L, 3, "broadcast: root")));
    lua_settop(L, 2);
    return 1;
}
static int g_all_to_all(lua_State *L) {
    CHECK(L, ms_all_to_all(check_group(L, 1), check_tensor(L, 2), check_tensor(L, 3)));
    lua_settop(L, 2);
    return 1;
}
static int g_barrier(lua_State *L) {
    CHECK(L, ms_barrier(check_group(L, 1)));
    return 0;
}

static int g_tostring(lua_State *L) {
    box *b = luaL_checkudata(L, 1, GROUP_MT);
    if (!b->h) {
        lua_pushliteral(L, "group (released)");
        return 1;
    }
    ms_comm *c = b->h;
    luaL_Buffer buf;
    luaL_buffinit(L, &buf);
    lua_pushfstring(L, "group(%s, rank %d of %d, ranks [", ms_comm_backend(c), ms_comm_rank(c), ms_comm_size(c));
    luaL_addvalue(&buf);
    for (int i = 0; i < ms_comm_size(c); i++) {
        lua_pushfstring(L, i ? " %d" : "%d", ms_comm_world_rank(c, i));
        luaL_addvalue(&buf);
    }
    luaL_addstring(&buf, "])");
    luaL_pushresult(&buf);
    return 1;
}
/* ---------------------------------------------------------------- layouts */

/* core.local_shape(shape, kinds, dims, mesh_sizes, coords) -- kinds: 0 replicate, 1 shard,
 * 2 partial (ms_placement_kind); the Lua library turns placements into these lists. */
int l_local_shape(lua_State *L) {
    int64_t shape[MS_MAX_DIMS], kinds64[MS_MAX_DIMS], dims64[MS_MAX_DIMS], sizes[MS_MAX_DIMS], coords[MS_MAX_DIMS];
    int nd = check_int_list(L, 1, "global_shape", shape, MS_MAX_DIMS);
    int nk = check_int_list(L, 2, "placements", kinds64, MS_MAX_DIMS);
    int ndims = check_int_list(L, 3, "placement dims", dims64, MS_MAX_DIMS);
    int nm = check_int_list(L, 4, "mesh_shape", sizes, MS_MAX_DIMS);
    int nc = check_int_list(L, 5, "coords", coords, MS_MAX_DIMS);
    if (nk != nm || ndims != nm || nc != nm)
        return luaL_error(L, "moonshard invalid_argument error: local_shape: %d placements and %d coordinates for a mesh of %d dims "
                          "(one of each per mesh dim)", nk, nc, nm);
    int kinds[MS_MAX_DIMS], dims[MS_MAX_DIMS];
    for (int i = 0; i < nm; i++) {
        if (dims64[i] < INT_MIN || dims64[i] > INT_MAX)
            return luaL_error(L, "moonshard invalid_argument error: local_shape: placement dim %I is out of range",
                              (lua_Integer)dims64[i]);
        kinds[i] = kinds64[i] >= 0 && kinds64[i] <= 2 ? (int)kinds64[i] : -1; /* the core refuses -1 */
        dims[i] = (int)dims64[i];
    }
    int64_t local[MS_MAX_DIMS], offset[MS_MAX_DIMS];
    CHECK(L, ms_local_shape(nd, shape, nm, kinds, dims, sizes, coords, local, offset));
    push_int_list(L, local, nd);
    push_int_list(L, offset, nd);
    return 2;
}

int l_fsdp_shard(lua_State *L) {
    int64_t shape[MS_MAX_DIMS];
    int nd = check_int_list(L, 1, "global_shape", shape, MS_MAX_DIMS);
    int64_t world = luaL_checkinteger(L, 2), rank = luaL_checkinteger(L, 3);
    int dim = opt_int(L, 4, "fsdp_shard: dim", 0);
    int64_t local[MS_MAX_DIMS], padded[MS_MAX_DIMS], offset;
    CHECK(L, ms_fsdp_shard(nd, shape, world, rank, dim, local, &offset, padded));
    push_int_list(L, local, nd);
    lua_pushinteger(L, (lua_Integer)offset);
    push_int_list(L, padded, nd);
    return 3;
}

int l_chunk_extent(lua_State *L) {
    int64_t len, off;
    CHECK(L, ms_chunk_extent(luaL_checkinteger(L, 1), luaL_checkinteger(L, 2), luaL_checkinteger(L, 3), &len, &off));
    lua_pushinteger(L, (lua_Integer)len);
    lua_pushinteger(L, (lua_Integer)off);
    return 2;
}

/* ---------------------------------------------------------------- registration */

void open_mesh_classes(lua_State *L) {
    static const luaL_Reg mesh_methods[] = {
        {"size", m_size}, {"axes", m_axes}, {"rank", m_rank}, {"coords", m_coords},
        {"group", m_group}, {"group_ranks", m_group_ranks}, {"release", mesh_gc}, {NULL, NULL}};
    static const luaL_Reg group_methods[] = {
        {"size", g_size}, {"rank", g_rank}, {"ranks", g_ranks}, {"all_gather", g_all_gather},
        {"reduce_scatter", g_reduce_scatter}, {"all_reduce", g_all_reduce},
        {"broadcast", g_broadcast}, {"all_to_all", g_all_to_all}, {"barrier", g_barrier},
        {"release", group_gc}, {NULL, NULL}};
    new_class(L, MESH_MT, mesh_methods, mesh_gc, m_tostring);
    new_class(L, GROUP_MT, group_methods, group_gc, g_tostring);
}
