/*
 * ms_lua_internal.h: what the files of the Lua 5.4 binding share (ms_lua.c and the classes'
 * ms_lua_tensor.c, ms_lua_mesh.c, ms_lua_unit.c).  Hidden: none of it leaves the library or
 * executable the binding is linked into.  Hosts use ms_lua.h.
 */
#ifndef MS_LUA_INTERNAL_H
#define MS_LUA_INTERNAL_H

#include "moonshard.h"
#include "ms_lua.h"

#include <lauxlib.h>
#include <lua.h>

#include <stdint.h>

#if defined(__GNUC__)
#define MS_LUA_HIDDEN __attribute__((visibility("hidden")))
#else
#define MS_LUA_HIDDEN
#endif

#define TENSOR_MT "moonshard.Tensor"
#define MESH_MT "moonshard.Mesh"
#define GROUP_MT "moonshard.Group"
#define UNIT_MT "moonshard.Unit"

/* ---------------------------------------------------------------- errors (ms_lua.c) */

MS_LUA_HIDDEN int ms_lua_fail(lua_State *L, ms_status st);

/* Raises the Lua error for a failed core call (luaL_error does not return). */
#define CHECK(L, call)                       \
    do {                                     \
        ms_status st_ = (call);              \
        if (st_ != MS_OK) ms_lua_fail(L, st_); \
    } while (0)

/* ---------------------------------------------------------------- boxes (ms_lua.c) */

typedef struct { void *h; } box;

MS_LUA_HIDDEN void *box_new(lua_State *L, const char *mt);
MS_LUA_HIDDEN void *box_get(lua_State *L, int idx, const char *mt, const char *what);

#define check_tensor(L, i) ((ms_tensor *)box_get(L, i, TENSOR_MT, "tensor"))
#define check_mesh(L, i) ((ms_mesh *)box_get(L, i, MESH_MT, "mesh"))
#define check_group(L, i) ((ms_comm *)box_get(L, i, GROUP_MT, "group"))
#define check_unit(L, i) ((ms_unit *)box_get(L, i, UNIT_MT, "unit"))

#define DEFINE_RELEASE(fname, mt, release)          \
    static int fname(lua_State *L) {                \
        box *b = luaL_checkudata(L, 1, mt);         \
        if (b->h) {                                 \
            release(b->h);                          \
            b->h = NULL;                            \
        }                                           \
        return 0;                                   \
    }

/* ---------------------------------------------------------------- argument helpers (ms_lua.c) */

MS_LUA_HIDDEN ms_dtype opt_dtype(lua_State *L, int idx, ms_dtype def);
/* A Lua sequence of integers (a shape, a list of sizes); returns its length. */
MS_LUA_HIDDEN int check_int_list(lua_State *L, int idx, const char *what, int64_t *out, int cap);
/* An integer argument that the core takes as a C int (a dim, a root). */
MS_LUA_HIDDEN int check_int(lua_State *L, int idx, const char *what);
MS_LUA_HIDDEN int opt_int(lua_State *L, int idx, const char *what, int def);
MS_LUA_HIDDEN void push_int_list(lua_State *L, const int64_t *v, int n);

/* ---------------------------------------------------------------- registration */

/* ms_lua.c: the metatable mt with its methods, __gc and __close (gc), __tostring, __name. */
MS_LUA_HIDDEN void new_class(lua_State *L, const char *mt, const luaL_Reg *methods, lua_CFunction gc,
                             lua_CFunction tostring);
/* Each class's file: its metatables, and the module functions that make its objects. */
MS_LUA_HIDDEN void open_tensor_class(lua_State *L); /* ms_lua_tensor.c */
MS_LUA_HIDDEN int l_tensor(lua_State *L);
MS_LUA_HIDDEN int l_from_table(lua_State *L);
MS_LUA_HIDDEN void open_mesh_classes(lua_State *L); /* ms_lua_mesh.c: Mesh and Group */
MS_LUA_HIDDEN int l_rank(lua_State *L);
MS_LUA_HIDDEN int l_world_size(lua_State *L);
MS_LUA_HIDDEN int l_backend(lua_State *L);
MS_LUA_HIDDEN int l_device(lua_State *L);
MS_LUA_HIDDEN int l_mesh(lua_State *L);
MS_LUA_HIDDEN int l_local_shape(lua_State *L);
MS_LUA_HIDDEN int l_fsdp_shard(lua_State *L);
MS_LUA_HIDDEN int l_chunk_extent(lua_State *L);
MS_LUA_HIDDEN void open_unit_class(lua_State *L); /* ms_lua_unit.c */
MS_LUA_HIDDEN int l_unit(lua_State *L);

#endif
