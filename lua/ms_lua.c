/*
 * ms_lua.c: the Lua 5.4 binding of libmoonshard (luaopen_moonshard_core): the module table,
 * what the classes' files share (ms_lua_internal.h) and the functions of no class.  The
 * classes: ms_lua_tensor.c, ms_lua_mesh.c (meshes, groups, the world), ms_lua_unit.c.
 *
 * Thin functions that check their Lua arguments, call the core and turn a failed status
 * into one Lua error naming the status and the core's message.  Userdata follow liolib:
 * the box is made "closed" before the handle is acquired, and __gc / __close share one
 * idempotent release, so an error half-way leaves nothing behind.
 */
#include "ms_lua_internal.h"

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include <limits.h>
#include <stdint.h>
#include <string.h>

/* ---------------------------------------------------------------- errors */

int ms_lua_fail(lua_State *L, ms_status st) {
    return luaL_error(L, "moonshard %s error: %s", ms_status_name(st), ms_last_error());
}

/* ---------------------------------------------------------------- boxes */

void *box_new(lua_State *L, const char *mt) {
    box *b = lua_newuserdatauv(L, sizeof *b, 0);
    b->h = NULL; /* closed until the handle exists */
    luaL_setmetatable(L, mt);
    return b;
}

void *box_get(lua_State *L, int idx, const char *mt, const char *what) {
    box *b = luaL_checkudata(L, idx, mt);
    if (!b->h) luaL_error(L, "moonshard state error: attempt to use a released %s", what);
    return b->h;
}

/* ---------------------------------------------------------------- argument helpers */

ms_dtype opt_dtype(lua_State *L, int idx, ms_dtype def) {
    if (lua_isnoneornil(L, idx)) return def;
    ms_dtype d;
    ms_status st = ms_dtype_parse(luaL_checkstring(L, idx), &d);
    if (st) ms_lua_fail(L, st);
    return d;
}

/* A Lua sequence of integers (a shape, a list of sizes); returns its length. */
int check_int_list(lua_State *L, int idx, const char *what, int64_t *out, int cap) {
    luaL_checktype(L, idx, LUA_TTABLE);
    int n = (int)luaL_len(L, idx);
    if (n > cap) luaL_error(L, "moonshard invalid_argument error: %s has %d entries, at most %d allowed", what, n, cap);
    for (int i = 0; i < n; i++) {
        lua_geti(L, idx, i + 1);
        int ok;
        lua_Integer v = lua_tointegerx(L, -1, &ok);
        if (!ok)
            luaL_error(L, "moonshard invalid_argument error: %s[%d] is %s, expected an integer", what, i + 1,
                       luaL_typename(L, -1));
        out[i] = (int64_t)v;
        lua_pop(L, 1);
    }
    return n;
}

/* An integer argument that the core takes as a C int (a dim, a root): a value outside int's
 * range is refused by name instead of being cut down to another, valid-looking one. */
int check_int(lua_State *L, int idx, const char *what) {
    lua_Integer v = luaL_checkinteger(L, idx);
    if (v < INT_MIN || v > INT_MAX) luaL_error(L, "moonshard invalid_argument error: %s %I is out of range", what, v);
    return (int)v;
}

int opt_int(lua_State *L, int idx, const char *what, int def) {
    return lua_isnoneornil(L, idx) ? def : check_int(L, idx, what);
}

void push_int_list(lua_State *L, const int64_t *v, int n) {
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, (lua_Integer)v[i]);
        lua_rawseti(L, -2, i + 1);
    }
}

/* ---------------------------------------------------------------- misc */

/* cuda_device_count() -> n, and when n is 0 the reason (not built, no driver, no device) */
static int l_cuda_device_count(lua_State *L) {
    int n = 0;
    if (ms_cuda_device_count(&n) == MS_OK) {
        lua_pushinteger(L, n);
        return 1;
    }
    lua_pushinteger(L, 0);
    lua_pushstring(L, ms_last_error());
    return 2;
}

static int l_dtype_size(lua_State *L) {
    lua_pushinteger(L, ms_dtype_size(opt_dtype(L, 1, MS_F32)));
    return 1;
}

/* file_stat(path) -> kind, size: what path names without opening it ("regular file",
 * "directory", "FIFO (named pipe)", "character device", ...: ms_file_kind_name) and a
 * regular file's size; nil and "<path>: <reason>" when it cannot be stat'ed, as io.open
 * reports a failure. */
static int l_file_stat(lua_State *L) {
    size_t len;
    const char *path = luaL_checklstring(L, 1, &len);
    if (strlen(path) != len) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: the path holds a NUL byte", path);
        return 2;
    }
    ms_file_kind kind;
    int64_t size;
    if (ms_file_stat(path, &kind, &size) != MS_OK) {
        lua_pushnil(L);
        lua_pushstring(L, ms_last_error());
        return 2;
    }
    lua_pushstring(L, ms_file_kind_name(kind));
    lua_pushinteger(L, (lua_Integer)size);
    return 2;
}

static int l_cast_impl(lua_State *L) {
    if (!lua_isnoneornil(L, 1)) {
        const char *name = luaL_checkstring(L, 1);
        int impl = strcmp(name, "portable") == 0 ? MS_CAST_PORTABLE
                   : strcmp(name, "avx2") == 0   ? MS_CAST_AVX2
                   : strcmp(name, "auto") == 0   ? MS_CAST_AUTO
                                                 : -1;
        if (impl < 0) return luaL_error(L, "moonshard invalid_argument error: cast_impl: '%s' is not auto, portable or avx2", name);
        CHECK(L, ms_cast_set_impl((ms_cast_impl)impl));
    }
    lua_pushstring(L, ms_cast_get_impl() == MS_CAST_AVX2 ? "avx2" : "portable");
    return 1;
}

/* ---------------------------------------------------------------- states for ranks and hosts */

void ms_lua_setup(lua_State *L, ms_comm *world) {
    ms_lua_register_memory_cap(L);
    luaL_openlibs(L);
    lua_getglobal(L, "package");
    const char *dir = ms_lua_dir();
    lua_getfield(L, -1, "path");
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", dir, dir, lua_tostring(L, -1));
    lua_setfield(L, -3, "path");
    lua_pop(L, 1);
    lua_getfield(L, -1, "preload");
    lua_pushcfunction(L, luaopen_moonshard_core);
    lua_setfield(L, -2, "moonshard.core");
    lua_pop(L, 2);
    ms_lua_set_world(L, world);
}

/* ---------------------------------------------------------------- registration */

void new_class(lua_State *L, const char *mt, const luaL_Reg *methods, lua_CFunction gc,
              lua_CFunction tostring) {
    luaL_newmetatable(L, mt);
    lua_newtable(L);
    luaL_setfuncs(L, methods, 0);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, gc);
    lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pushstring(L, mt);
    lua_setfield(L, -2, "__name");
    lua_pop(L, 1);
}

int luaopen_moonshard_core(lua_State *L) {
    static const luaL_Reg funcs[] = {
        {"rank", l_rank}, {"world_size", l_world_size}, {"backend", l_backend}, {"device", l_device},
        {"tensor", l_tensor}, {"from_table", l_from_table}, {"mesh", l_mesh},
        {"local_shape", l_local_shape}, {"fsdp_shard", l_fsdp_shard},
        {"chunk_extent", l_chunk_extent}, {"dtype_size", l_dtype_size},
        {"cast_impl", l_cast_impl}, {"unit", l_unit}, {"cuda_device_count", l_cuda_device_count},
        {"memory_cap", ms_lua_memory_cap}, {"memory_refused", ms_lua_memory_refused}, {"file_stat", l_file_stat},
        {NULL, NULL}};
    open_tensor_class(L);
    open_mesh_classes(L);
    open_unit_class(L);
    luaL_newlib(L, funcs);
    lua_pushstring(L, ms_version());
    lua_setfield(L, -2, "version");
    lua_createtable(L, MS_DTYPE_COUNT, 0);
    for (int d = 0; d < MS_DTYPE_COUNT; d++) {
        lua_pushstring(L, ms_dtype_name((ms_dtype)d));
        lua_rawseti(L, -2, d + 1);
    }
    lua_setfield(L, -2, "dtypes");
    return 1;
}
