/*
 * ms_lua_ckpt.c: the raw functions of the checkpoint file primitives (core/src/ckpt.c) for
 * the Lua 5.4 binding; lua/moonshard/core_ffi.lua has the same ones for LuaJIT and
 * lua/moonshard/checkpoint.lua the API over both.  A failed core call returns nil and the
 * message.
 */
#include "ms_lua_internal.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* crc32c(string, crc?) -> integer */
static int l_crc32c(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    uint32_t out = 0;
    TRY(L, ms_crc32c((uint32_t)luaL_optinteger(L, 2, 0), s, (int64_t)n, &out));
    lua_pushinteger(L, out);
    return 1;
}

static int l_crc32c_impl(lua_State *L) {
    lua_pushstring(L, ms_crc32c_impl());
    return 1;
}

static int l_tensor_crc32c(lua_State *L) {
    uint32_t out = 0;
    TRY(L, ms_tensor_crc32c(check_tensor(L, 1), (uint32_t)luaL_optinteger(L, 2, 0), &out));
    lua_pushinteger(L, out);
    return 1;
}

/* ckpt_open(path, write) -> fd */
static int l_ckpt_open(lua_State *L) {
    int fd = -1;
    TRY(L, ms_ckpt_open(luaL_checkstring(L, 1), lua_toboolean(L, 2), &fd));
    lua_pushinteger(L, fd);
    return 1;
}

static int l_ckpt_write(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 2, &n);
    TRY(L, ms_ckpt_write((int)luaL_checkinteger(L, 1), s, (int64_t)n));
    return ms_lua_done(L);
}

/* ckpt_write_tensor(fd, t) -> crc */
static int l_ckpt_write_tensor(lua_State *L) {
    uint32_t crc = 0;
    TRY(L, ms_ckpt_write_tensor((int)luaL_checkinteger(L, 1), check_tensor(L, 2), &crc));
    lua_pushinteger(L, crc);
    return 1;
}

/* ckpt_read_box(fd, offset, shape, start, out) */
static int l_ckpt_read_box(lua_State *L) {
    int64_t shape[MS_MAX_DIMS], start[MS_MAX_DIMS];
    int nd = int_list(L, 3, shape);
    int ns = int_list(L, 4, start);
    if (ns != nd) return luaL_error(L, "ckpt_read_box: shape and start differ in length");
    TRY(L, ms_ckpt_read_box((int)luaL_checkinteger(L, 1), luaL_checkinteger(L, 2), nd, shape, start,
                            check_tensor(L, 5)));
    return ms_lua_done(L);
}

static int l_ckpt_close(lua_State *L) {
    TRY(L, ms_ckpt_close((int)luaL_checkinteger(L, 1), lua_toboolean(L, 2)));
    return ms_lua_done(L);
}

static int l_ckpt_fsync_path(lua_State *L) {
    TRY(L, ms_ckpt_fsync_path(luaL_checkstring(L, 1)));
    return ms_lua_done(L);
}

static int l_ckpt_rename(lua_State *L) {
    TRY(L, ms_ckpt_rename(luaL_checkstring(L, 1), luaL_checkstring(L, 2)));
    return ms_lua_done(L);
}

static int l_ckpt_mkdir(lua_State *L) {
    TRY(L, ms_ckpt_mkdir(luaL_checkstring(L, 1), lua_toboolean(L, 2)));
    return ms_lua_done(L);
}

/* ckpt_list_dir(path) -> {names} (unsorted) */
static int l_ckpt_list_dir(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    int64_t len = 0;
    TRY(L, ms_ckpt_list_dir(path, NULL, 0, &len));
    for (;;) {
        char *buf = lua_newuserdatauv(L, (size_t)len + 1, 0);
        int64_t got = 0;
        TRY(L, ms_ckpt_list_dir(path, buf, len, &got));
        if (got > len) { /* grew meanwhile */
            lua_pop(L, 1);
            len = got;
            continue;
        }
        lua_newtable(L);
        int k = 0;
        for (int64_t i = 0; i < got;) {
            size_t n = strlen(buf + i);
            lua_pushlstring(L, buf + i, n);
            lua_rawseti(L, -2, ++k);
            i += (int64_t)n + 1;
        }
        return 1;
    }
}

static int l_stderr_isatty(lua_State *L) {
    lua_pushboolean(L, isatty(2));
    return 1;
}

void ms_lua_open_ckpt(lua_State *L) {
    static const luaL_Reg funcs[] = {
        {"crc32c", l_crc32c}, {"crc32c_impl", l_crc32c_impl}, {"tensor_crc32c", l_tensor_crc32c},
        {"ckpt_open", l_ckpt_open}, {"ckpt_write", l_ckpt_write}, {"ckpt_write_tensor", l_ckpt_write_tensor},
        {"ckpt_read_box", l_ckpt_read_box}, {"ckpt_close", l_ckpt_close}, {"ckpt_fsync_path", l_ckpt_fsync_path},
        {"ckpt_rename", l_ckpt_rename}, {"ckpt_mkdir", l_ckpt_mkdir}, {"ckpt_list_dir", l_ckpt_list_dir},
        {"stderr_isatty", l_stderr_isatty}, {NULL, NULL}};
    luaL_setfuncs(L, funcs, 0);
}
