/*
 * ms_lua_tensor.c: the Lua 5.4 binding's raw tensor functions (moonshard.tensor is the API).
 */
#include "ms_lua_internal.h"

#include <lauxlib.h>
#include <lua.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* tensor_new(shape, dtype, device, index) */
static int l_tensor_new(lua_State *L) {
    int64_t shape[MS_MAX_DIMS];
    int nd = int_list(L, 1, shape);
    ms_tensor *t = NULL;
    BOXED(L, CLASS_TENSOR,
          ms_tensor_new(&t, nd, shape, (ms_dtype)luaL_checkinteger(L, 2), (ms_device_type)luaL_checkinteger(L, 3),
                        int_arg(L, 4)),
          t);
}

/* tensor_write(t, values, as_int): numel values, staged as i64 or f64, into a cpu tensor */
static int l_tensor_write(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    bool as_int = lua_toboolean(L, 3);
    int64_t n = ms_tensor_numel(t);
    if ((int64_t)luaL_len(L, 2) != n || ms_tensor_device(t) != MS_DEVICE_CPU || !ms_tensor_is_contiguous(t))
        return luaL_error(L, "moonshard internal error: tensor_write: %I values for a tensor of %I", (lua_Integer)luaL_len(L, 2),
                          (lua_Integer)n);
    /* a userdata, freed by the collector even when an error comes half-way */
    void *stage = lua_newuserdatauv(L, (size_t)(n ? n : 1) * 8, 0);
    for (int64_t i = 0; i < n; i++) {
        lua_geti(L, 2, (lua_Integer)i + 1);
        if (as_int) ((int64_t *)stage)[i] = (int64_t)luaL_checkinteger(L, -1);
        else ((double *)stage)[i] = (double)luaL_checknumber(L, -1);
        lua_pop(L, 1);
    }
    TRY(L, ms_cast(ms_tensor_data(t), ms_tensor_dtype(t), stage, as_int ? MS_I64 : MS_F64, n));
    return ms_lua_done(L);
}

static int l_tensor_shape(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    int64_t v[MS_MAX_DIMS];
    for (int i = 0; i < ms_tensor_ndim(t); i++) v[i] = ms_tensor_size(t, i);
    push_int_list(L, v, ms_tensor_ndim(t));
    return 1;
}

static int l_tensor_stride(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    int64_t v[MS_MAX_DIMS];
    for (int i = 0; i < ms_tensor_ndim(t); i++) v[i] = ms_tensor_stride(t, i);
    push_int_list(L, v, ms_tensor_ndim(t));
    return 1;
}

/* The getters that give one integer of the tensor. */
#define TENSOR_INTEGER(fname, expr)                      \
    static int fname(lua_State *L) {                     \
        ms_tensor *t = check_tensor(L, 1);               \
        lua_pushinteger(L, (lua_Integer)(expr));         \
        return 1;                                        \
    }
TENSOR_INTEGER(l_tensor_dtype, ms_tensor_dtype(t))
TENSOR_INTEGER(l_tensor_numel, ms_tensor_numel(t))
TENSOR_INTEGER(l_tensor_nbytes, ms_tensor_nbytes(t))
TENSOR_INTEGER(l_tensor_ndim, ms_tensor_ndim(t))

static int l_tensor_is_contiguous(lua_State *L) {
    lua_pushboolean(L, ms_tensor_is_contiguous(check_tensor(L, 1)));
    return 1;
}

static int l_tensor_device(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    lua_pushinteger(L, ms_tensor_device(t));
    lua_pushinteger(L, ms_tensor_device_index(t));
    return 2;
}

static int l_tensor_to(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1), *r = NULL;
    BOXED(L, CLASS_TENSOR, ms_tensor_to(&r, t, (ms_dtype)luaL_checkinteger(L, 2)), r);
}

static int l_tensor_to_device(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1), *r = NULL;
    BOXED(L, CLASS_TENSOR, ms_tensor_to_device(&r, t, (ms_device_type)luaL_checkinteger(L, 2), int_arg(L, 3)), r);
}

static int l_tensor_copy(lua_State *L) {
    TRY(L, ms_tensor_copy(check_tensor(L, 1), check_tensor(L, 2)));
    return ms_lua_done(L);
}

static int l_tensor_fill(lua_State *L) {
    TRY(L, ms_tensor_fill(check_tensor(L, 1), luaL_checknumber(L, 2)));
    return ms_lua_done(L);
}

static int l_tensor_fill_int(lua_State *L) {
    TRY(L, ms_tensor_fill_int(check_tensor(L, 1), (int64_t)luaL_checkinteger(L, 2)));
    return ms_lua_done(L);
}

static int l_tensor_narrow(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1), *r = NULL;
    BOXED(L, CLASS_TENSOR,
          ms_tensor_narrow(&r, t, int_arg(L, 2), (int64_t)luaL_checkinteger(L, 3), (int64_t)luaL_checkinteger(L, 4)), r);
}

static int l_tensor_view(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1), *r = NULL;
    int64_t shape[MS_MAX_DIMS];
    int nd = int_list(L, 2, shape);
    BOXED(L, CLASS_TENSOR, ms_tensor_view(&r, t, nd, shape), r);
}

static int l_tensor_chunk(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1), *r = NULL;
    BOXED(L, CLASS_TENSOR,
          ms_tensor_chunk(&r, t, (int64_t)luaL_checkinteger(L, 2), (int64_t)luaL_checkinteger(L, 3), int_arg(L, 4)), r);
}

/* A contiguous cpu copy of t in dtype `as` (a cuda tensor comes to the host first), owned by
 * a box pushed on the stack; NULL with the failure pushed (2 values) when the core fails. */
static ms_tensor *host_copy(lua_State *L, ms_tensor *t, ms_dtype as) {
    if (ms_tensor_device(t) != MS_DEVICE_CPU) {
        box *host = box_new(L, CLASS_TENSOR);
        ms_status st = ms_tensor_to_device((ms_tensor **)&host->h, t, MS_DEVICE_CPU, 0);
        if (st) return ms_lua_failed(L, st), NULL;
        t = host->h;
    }
    box *b = box_new(L, CLASS_TENSOR);
    ms_status st = ms_tensor_to((ms_tensor **)&b->h, t, as);
    if (st) return ms_lua_failed(L, st), NULL;
    return b->h;
}

/* tensor_read(t): the values, f64 for float dtypes and integers for the others */
static int l_tensor_read(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    bool is_float = ms_dtype_is_float(ms_tensor_dtype(t));
    ms_tensor *c = host_copy(L, t, is_float ? MS_F64 : MS_I64);
    if (!c) return 2;
    int64_t n = ms_tensor_numel(c);
    const void *p = ms_tensor_data(c);
    lua_createtable(L, n < INT32_MAX ? (int)n : 0, 0);
    for (int64_t i = 0; i < n; i++) {
        if (is_float) lua_pushnumber(L, ((const double *)p)[i]);
        else lua_pushinteger(L, (lua_Integer)((const int64_t *)p)[i]);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

/* tensor_bits(t): the elements' bit patterns (8-byte ones as signed integers) */
static int l_tensor_bits(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    ms_dtype dt = ms_tensor_dtype(t);
    ms_tensor *c = host_copy(L, t, dt);
    if (!c) return 2;
    int64_t n = ms_tensor_numel(c);
    int es = ms_dtype_size(dt);
    const unsigned char *p = ms_tensor_data(c);
    lua_createtable(L, n < INT32_MAX ? (int)n : 0, 0);
    for (int64_t i = 0; i < n; i++) {
        uint64_t v = 0;
        memcpy(&v, p + i * es, (size_t)es); /* little-endian host */
        lua_pushinteger(L, (lua_Integer)v);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

void ms_lua_open_tensor(lua_State *L) {
    static const luaL_Reg funcs[] = {
        {"tensor_new", l_tensor_new}, {"tensor_write", l_tensor_write}, {"tensor_shape", l_tensor_shape},
        {"tensor_stride", l_tensor_stride}, {"tensor_dtype", l_tensor_dtype}, {"tensor_numel", l_tensor_numel},
        {"tensor_nbytes", l_tensor_nbytes}, {"tensor_ndim", l_tensor_ndim},
        {"tensor_is_contiguous", l_tensor_is_contiguous}, {"tensor_device", l_tensor_device},
        {"tensor_to", l_tensor_to}, {"tensor_to_device", l_tensor_to_device}, {"tensor_copy", l_tensor_copy},
        {"tensor_fill", l_tensor_fill}, {"tensor_fill_int", l_tensor_fill_int}, {"tensor_narrow", l_tensor_narrow},
        {"tensor_view", l_tensor_view}, {"tensor_chunk", l_tensor_chunk}, {"tensor_read", l_tensor_read},
        {"tensor_bits", l_tensor_bits}, {NULL, NULL}};
    luaL_setfuncs(L, funcs, 0);
}
