/*
 * ms_lua_mesh.c: the Lua 5.4 binding's raw functions of the world, meshes, groups and their
 * collectives and point-to-point calls, and the layouts (moonshard.mesh is the API).
 *
 * The world: the moonshard executable stores each rank's world comm in the registry
 * (ms_lua_set_world) before the script runs.  A stock lua5.4 that does
 * `require "moonshard"` gets a world of one rank, made on first use.
 */
#include "ms_lua_internal.h"

#include <lauxlib.h>
#include <lua.h>

#include <stdint.h>

#define WORLD_KEY "moonshard.world"             /* light userdata: ms_comm * of this rank */
#define WORLD_OWNER_KEY "moonshard.world_owner" /* full userdata owning a 1-rank world */

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

/* This state's world comm; raises when a one-rank world cannot be made. */
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
    ms_status st = ms_threads_world_new(&o->w, 1, 0);
    if (!st) st = ms_world_comm(o->w, 0, &o->c);
    if (st) luaL_error(L, "moonshard %s error: %s", ms_status_name(st), ms_last_error());
    lua_setfield(L, LUA_REGISTRYINDEX, WORLD_OWNER_KEY);
    ms_lua_set_world(L, o->c);
    return o->c;
}

static int l_world_rank(lua_State *L) {
    lua_pushinteger(L, ms_comm_rank(get_world(L)));
    return 1;
}
static int l_world_size(lua_State *L) {
    lua_pushinteger(L, ms_comm_size(get_world(L)));
    return 1;
}
static int l_world_backend(lua_State *L) {
    lua_pushstring(L, ms_comm_backend(get_world(L)));
    return 1;
}

/* world_device() -> device type, index of this rank's tensors */
static int l_world_device(lua_State *L) {
    ms_device_type type;
    int index;
    TRY(L, ms_comm_device(get_world(L), &type, &index));
    lua_pushinteger(L, type);
    lua_pushinteger(L, index);
    return 2;
}

/* ---------------------------------------------------------------- meshes */

/* mesh_new(names, sizes, with_world) */
static int l_mesh_new(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    int64_t sizes[MS_MAX_DIMS];
    int n = int_list(L, 2, sizes);
    const char *names[MS_MAX_DIMS];
    for (int i = 0; i < n; i++) {
        lua_geti(L, 1, i + 1);
        names[i] = luaL_checkstring(L, -1);
        lua_pop(L, 1); /* the string stays alive in the table */
    }
    ms_comm *world = lua_toboolean(L, 3) ? get_world(L) : NULL;
    ms_mesh *m = NULL;
    BOXED(L, CLASS_MESH, ms_mesh_new(&m, n, names, sizes, world), m);
}

static int l_mesh_ndim(lua_State *L) {
    lua_pushinteger(L, ms_mesh_ndim(check_mesh(L, 1)));
    return 1;
}

static int l_mesh_axis_name(lua_State *L) {
    lua_pushstring(L, ms_mesh_axis_name(check_mesh(L, 1), int_arg(L, 2)));
    return 1;
}

static int l_mesh_axis_size(lua_State *L) {
    lua_pushinteger(L, (lua_Integer)ms_mesh_axis_size(check_mesh(L, 1), int_arg(L, 2)));
    return 1;
}

static int l_mesh_size(lua_State *L) {
    lua_pushinteger(L, (lua_Integer)ms_mesh_size(check_mesh(L, 1)));
    return 1;
}

static int l_mesh_axis_index(lua_State *L) {
    lua_pushinteger(L, ms_mesh_axis_index(check_mesh(L, 1), luaL_checkstring(L, 2)));
    return 1;
}

static int l_mesh_rank(lua_State *L) {
    lua_pushinteger(L, (lua_Integer)ms_mesh_rank(check_mesh(L, 1)));
    return 1;
}

static int l_mesh_coords(lua_State *L) {
    ms_mesh *m = check_mesh(L, 1);
    int64_t c[MS_MAX_DIMS];
    TRY(L, ms_mesh_coords(m, (int64_t)luaL_checkinteger(L, 2), c));
    push_int_list(L, c, ms_mesh_ndim(m));
    return 1;
}

/* A list of 0-based axis indices at idx; its length. */
static int axis_list(lua_State *L, int idx, int *axes) {
    int64_t v[MS_MAX_DIMS];
    int n = int_list(L, idx, v);
    for (int i = 0; i < n; i++) axes[i] = (int)v[i];
    return n;
}

static int l_mesh_group(lua_State *L) {
    ms_mesh *m = check_mesh(L, 1);
    int axes[MS_MAX_DIMS];
    int n = axis_list(L, 2, axes);
    ms_comm *c = NULL;
    BOXED(L, CLASS_GROUP, ms_mesh_group(m, n, axes, &c), c);
}

/* mesh_group_ranks(m, axes, rank) -> the mesh ranks of that group, without communicating */
static int l_mesh_group_ranks(lua_State *L) {
    ms_mesh *m = check_mesh(L, 1);
    int axes[MS_MAX_DIMS];
    int n = axis_list(L, 2, axes);
    int64_t rank = (int64_t)luaL_checkinteger(L, 3), count = 1;
    for (int i = 0; i < n; i++) count *= ms_mesh_axis_size(m, axes[i]);
    int64_t *ranks = lua_newuserdatauv(L, (size_t)(count > 0 ? count : 1) * sizeof *ranks, 0);
    TRY(L, ms_mesh_group_ranks(m, n, axes, rank, ranks, &count));
    push_int_list(L, ranks, (int)count);
    return 1;
}

/* ---------------------------------------------------------------- groups */

static int l_group_size(lua_State *L) {
    lua_pushinteger(L, ms_comm_size(check_group(L, 1)));
    return 1;
}
static int l_group_rank(lua_State *L) {
    lua_pushinteger(L, ms_comm_rank(check_group(L, 1)));
    return 1;
}
static int l_group_world_rank(lua_State *L) {
    lua_pushinteger(L, ms_comm_world_rank(check_group(L, 1), int_arg(L, 2)));
    return 1;
}
static int l_group_backend(lua_State *L) {
    lua_pushstring(L, ms_comm_backend(check_group(L, 1)));
    return 1;
}

static int l_all_gather(lua_State *L) {
    TRY(L, ms_all_gather(check_group(L, 1), check_tensor(L, 2), check_tensor(L, 3)));
    return ms_lua_done(L);
}
static int l_reduce_scatter(lua_State *L) {
    TRY(L, ms_reduce_scatter(check_group(L, 1), check_tensor(L, 2), check_tensor(L, 3), (ms_op)luaL_checkinteger(L, 4)));
    return ms_lua_done(L);
}
static int l_all_reduce(lua_State *L) {
    TRY(L, ms_all_reduce(check_group(L, 1), check_tensor(L, 2), (ms_op)luaL_checkinteger(L, 3)));
    return ms_lua_done(L);
}
static int l_broadcast(lua_State *L) {
    TRY(L, ms_broadcast(check_group(L, 1), check_tensor(L, 2), int_arg(L, 3)));
    return ms_lua_done(L);
}
static int l_all_to_all(lua_State *L) {
    TRY(L, ms_all_to_all(check_group(L, 1), check_tensor(L, 2), check_tensor(L, 3)));
    return ms_lua_done(L);
}
static int l_barrier(lua_State *L) {
    TRY(L, ms_barrier(check_group(L, 1)));
    return ms_lua_done(L);
}
static int l_send(lua_State *L) {
    TRY(L, ms_send(check_group(L, 1), check_tensor(L, 2), int_arg(L, 3), int_arg(L, 4)));
    return ms_lua_done(L);
}
static int l_recv(lua_State *L) {
    TRY(L, ms_recv(check_group(L, 1), check_tensor(L, 2), int_arg(L, 3), int_arg(L, 4)));
    return ms_lua_done(L);
}

/* batch_p2p(g, kinds, tensors, peers, tags): the ops as parallel lists */
static int l_batch_p2p(lua_State *L) {
    ms_comm *c = check_group(L, 1);
    for (int i = 2; i <= 5; i++) luaL_checktype(L, i, LUA_TTABLE);
    lua_Integer n = luaL_len(L, 2);
    if (n < 0 || n > INT32_MAX) return luaL_error(L, "moonshard internal error: batch_p2p: %d ops", (int)n);
    ms_p2p_op *ops = lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof *ops, 0);
    for (lua_Integer i = 0; i < n; i++) {
        lua_geti(L, 2, i + 1);
        lua_geti(L, 3, i + 1);
        lua_geti(L, 4, i + 1);
        lua_geti(L, 5, i + 1);
        int top = lua_gettop(L);
        ops[i] = (ms_p2p_op){(ms_p2p_kind)luaL_checkinteger(L, top - 3), check_tensor(L, top - 2),
                             (int)luaL_checkinteger(L, top - 1), (int)luaL_checkinteger(L, top)};
        lua_pop(L, 4); /* the tensors stay alive in their list */
    }
    TRY(L, ms_batch_p2p(c, ops, (int)n));
    return ms_lua_done(L);
}

/* ---------------------------------------------------------------- layouts */

/* local_shape(shape, kinds, dims, mesh_sizes, coords) -> local, offset */
static int l_local_shape(lua_State *L) {
    int64_t shape[MS_MAX_DIMS], kinds64[MS_MAX_DIMS], dims64[MS_MAX_DIMS], sizes[MS_MAX_DIMS], coords[MS_MAX_DIMS];
    int nd = int_list(L, 1, shape);
    int nk = int_list(L, 2, kinds64), ndims = int_list(L, 3, dims64);
    int nm = int_list(L, 4, sizes), nc = int_list(L, 5, coords);
    if (nk != nm || ndims != nm || nc != nm)
        return luaL_error(L, "moonshard internal error: local_shape: one placement and coordinate per mesh dim");
    int kinds[MS_MAX_DIMS], dims[MS_MAX_DIMS];
    for (int i = 0; i < nm; i++) {
        kinds[i] = (int)kinds64[i];
        dims[i] = (int)dims64[i];
    }
    int64_t local[MS_MAX_DIMS], offset[MS_MAX_DIMS];
    TRY(L, ms_local_shape(nd, shape, nm, kinds, dims, sizes, coords, local, offset));
    push_int_list(L, local, nd);
    push_int_list(L, offset, nd);
    return 2;
}

/* fsdp_shard(shape, world, rank, dim) -> local, offset, padded */
static int l_fsdp_shard(lua_State *L) {
    int64_t shape[MS_MAX_DIMS], local[MS_MAX_DIMS], padded[MS_MAX_DIMS], offset;
    int nd = int_list(L, 1, shape);
    TRY(L, ms_fsdp_shard(nd, shape, (int64_t)luaL_checkinteger(L, 2), (int64_t)luaL_checkinteger(L, 3), int_arg(L, 4),
                         local, &offset, padded));
    push_int_list(L, local, nd);
    lua_pushinteger(L, (lua_Integer)offset);
    push_int_list(L, padded, nd);
    return 3;
}

/* chunk_extent(n, k, r) -> length, offset */
static int l_chunk_extent(lua_State *L) {
    int64_t len, off;
    TRY(L, ms_chunk_extent((int64_t)luaL_checkinteger(L, 1), (int64_t)luaL_checkinteger(L, 2),
                           (int64_t)luaL_checkinteger(L, 3), &len, &off));
    lua_pushinteger(L, (lua_Integer)len);
    lua_pushinteger(L, (lua_Integer)off);
    return 2;
}

void ms_lua_open_mesh(lua_State *L) {
    static const luaL_Reg funcs[] = {
        {"world_rank", l_world_rank}, {"world_size", l_world_size}, {"world_backend", l_world_backend},
        {"world_device", l_world_device}, {"mesh_new", l_mesh_new}, {"mesh_ndim", l_mesh_ndim},
        {"mesh_axis_name", l_mesh_axis_name}, {"mesh_axis_size", l_mesh_axis_size}, {"mesh_size", l_mesh_size},
        {"mesh_axis_index", l_mesh_axis_index}, {"mesh_rank", l_mesh_rank}, {"mesh_coords", l_mesh_coords},
        {"mesh_group", l_mesh_group}, {"mesh_group_ranks", l_mesh_group_ranks}, {"group_size", l_group_size},
        {"group_rank", l_group_rank}, {"group_world_rank", l_group_world_rank}, {"group_backend", l_group_backend},
        {"all_gather", l_all_gather}, {"reduce_scatter", l_reduce_scatter}, {"all_reduce", l_all_reduce},
        {"broadcast", l_broadcast}, {"all_to_all", l_all_to_all}, {"barrier", l_barrier}, {"send", l_send},
        {"recv", l_recv}, {"batch_p2p", l_batch_p2p},
        {"local_shape", l_local_shape}, {"fsdp_shard", l_fsdp_shard}, {"chunk_extent", l_chunk_extent},
        {NULL, NULL}};
    luaL_setfuncs(L, funcs, 0);
}
