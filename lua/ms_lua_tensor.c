/*
 * ms_lua_tensor.c: the Lua 5.4 binding's tensors: ms.tensor, ms.from_table and the methods
 * of moonshard.Tensor.
 */
#include "ms_lua_internal.h"

#include <lauxlib.h>
#include <lua.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

DEFINE_RELEASE(tensor_gc, TENSOR_MT, ms_tensor_release)

/* ---------------------------------------------------------------- tensors */

int l_tensor(lua_State *L) {
    int64_t shape[MS_MAX_DIMS];
    int nd = check_int_list(L, 1, "shape", shape, MS_MAX_DIMS);
    ms_dtype dt = opt_dtype(L, 2, MS_F32);
    ms_device_type dev = MS_DEVICE_CPU;
    int idx = 0;
    if (!lua_isnoneornil(L, 3)) CHECK(L, ms_device_parse(luaL_checkstring(L, 3), &dev, &idx));
    box *b = box_new(L, TENSOR_MT);
    ms_tensor *t;
    CHECK(L, ms_tensor_new(&t, nd, shape, dt, dev, idx));
    b->h = t;
    return 1;
}

/* The range of integers an integer dtype holds. */
static void int_range(ms_dtype dt, int64_t *lo, int64_t *hi) {
    switch (dt) {
    case MS_I32: *lo = INT32_MIN, *hi = INT32_MAX; break;
    case MS_I8: *lo = INT8_MIN, *hi = INT8_MAX; break;
    case MS_U8: *lo = 0, *hi = UINT8_MAX; break;
    default: *lo = INT64_MIN, *hi = INT64_MAX; break;
    }
}

/* The number (or boolean) at idx as an element of the integer dtype dt, for from_table and
 * fill_: integers exact, floats truncated toward zero, booleans 0 / 1; bool takes any number
 * (nonzero is true).  A value dt cannot hold is an error, as in PyTorch
 * (torch.tensor([300], dtype=torch.int8)), where a cast (t:to) would saturate.  `what` names
 * the value ("fill_: " or "from_table: values[3] = ").  Returns 0 and sets *out, or -1 with
 * the error message pushed. */
static int int_element(lua_State *L, int idx, ms_dtype dt, const char *what, int64_t *out) {
    if (lua_isboolean(L, idx)) {
        *out = lua_toboolean(L, idx);
        return 0;
    }
    bool is_int = lua_isinteger(L, idx);
    lua_Integer iv = is_int ? lua_tointeger(L, idx) : 0;
    lua_Number fv = is_int ? 0 : lua_tonumber(L, idx);
    if (dt == MS_BOOL) {
        *out = is_int ? iv != 0 : fv != 0; /* NaN is true, as bool(nan) is */
        return 0;
    }
    int64_t lo, hi;
    int_range(dt, &lo, &hi);
    bool fits;
    if (is_int) {
        fits = iv >= lo && iv <= hi;
        *out = (int64_t)iv;
    } else {
        double t = trunc(fv); /* NaN fails both comparisons */
        fits = t >= -0x1p63 && t < 0x1p63 && (int64_t)t >= lo && (int64_t)t <= hi;
        if (fits) *out = (int64_t)t;
    }
    if (fits) return 0;
    char num[32]; /* %.14g as both interpreters print numbers, "nan" for every NaN */
    if (is_int) snprintf(num, sizeof num, "%lld", (long long)iv);
    else if (isnan(fv)) snprintf(num, sizeof num, "nan");
    else snprintf(num, sizeof num, "%.14g", (double)fv);
    lua_pushfstring(L, "%s%s", what, num);
    lua_pushfstring(L, "moonshard invalid_argument error: %s is out of range for %s (%I to %I)", lua_tostring(L, -1),
                    ms_dtype_name(dt), (lua_Integer)lo, (lua_Integer)hi);
    return -1;
}

/* from_table(values, dtype?, shape?): values is a flat sequence of numbers (or booleans). */
int l_from_table(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    ms_dtype dt = opt_dtype(L, 2, MS_F32);
    int64_t n = (int64_t)luaL_len(L, 1);
    int64_t shape[MS_MAX_DIMS];
    int nd = 1;
    shape[0] = n;
    if (!lua_isnoneornil(L, 3)) nd = check_int_list(L, 3, "shape", shape, MS_MAX_DIMS);
    box *b = box_new(L, TENSOR_MT);
    ms_tensor *t;
    CHECK(L, ms_tensor_new(&t, nd, shape, dt, MS_DEVICE_CPU, 0));
    b->h = t;
    if (ms_tensor_numel(t) != n) {
        char msg[160];
        snprintf(msg, sizeof msg, "moonshard shape error: from_table: %lld values do not fill a shape of %lld elements",
                 (long long)n, (long long)ms_tensor_numel(t));
        return luaL_error(L, "%s", msg);
    }
    /* Integers travel as int64 so that values above 2^53 stay exact; floats as f64. */
    bool as_int = !ms_dtype_is_float(dt);
    void *stage = malloc((size_t)(n ? n : 1) * 8);
    if (!stage) return luaL_error(L, "moonshard out_of_memory error: from_table: %I values", (lua_Integer)n);
    for (int64_t i = 0; i < n; i++) {
        lua_geti(L, 1, i + 1);
        int ok = lua_isboolean(L, -1);
        if (!ok) lua_tonumberx(L, -1, &ok);
        if (!ok) {
            free(stage);
            return luaL_error(L, "moonshard invalid_argument error: from_table: values[%I] is %s, expected a number",
                              (lua_Integer)(i + 1), luaL_typename(L, -1));
        }
        if (as_int) {
            lua_pushfstring(L, "from_table: values[%I] = ", (lua_Integer)(i + 1));
            if (int_element(L, -2, dt, lua_tostring(L, -1), &((int64_t *)stage)[i])) {
                free(stage);
                return luaL_error(L, "%s", lua_tostring(L, -1));
            }
            lua_pop(L, 1);
        } else {
            ((double *)stage)[i] = lua_isboolean(L, -1) ? lua_toboolean(L, -1) : lua_tonumber(L, -1);
        }
        lua_pop(L, 1);
    }
    ms_status st = ms_cast(ms_tensor_data(t), dt, stage, as_int ? MS_I64 : MS_F64, n);
    free(stage);
    CHECK(L, st);
    return 1;
}

static int t_shape(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    int64_t shape[MS_MAX_DIMS];
    int nd = ms_tensor_ndim(t);
    for (int i = 0; i < nd; i++) shape[i] = ms_tensor_size(t, i);
    push_int_list(L, shape, nd);
    return 1;
}

static int t_stride(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    int64_t s[MS_MAX_DIMS];
    int nd = ms_tensor_ndim(t);
    for (int i = 0; i < nd; i++) s[i] = ms_tensor_stride(t, i);
    push_int_list(L, s, nd);
    return 1;
}

static int t_dtype(lua_State *L) {
    lua_pushstring(L, ms_dtype_name(ms_tensor_dtype(check_tensor(L, 1))));
    return 1;
}
static int t_numel(lua_State *L) {
    lua_pushinteger(L, (lua_Integer)ms_tensor_numel(check_tensor(L, 1)));
    return 1;
}
static int t_nbytes(lua_State *L) {
    lua_pushinteger(L, (lua_Integer)ms_tensor_nbytes(check_tensor(L, 1)));
    return 1;
}
static int t_ndim(lua_State *L) {
    lua_pushinteger(L, ms_tensor_ndim(check_tensor(L, 1)));
    return 1;
}
static int t_is_contiguous(lua_State *L) {
    lua_pushboolean(L, ms_tensor_is_contiguous(check_tensor(L, 1)));
    return 1;
}

static void push_device(lua_State *L, const ms_tensor *t) {
    switch (ms_tensor_device(t)) {
    case MS_DEVICE_CPU: lua_pushliteral(L, "cpu"); break;
    case MS_DEVICE_META: lua_pushliteral(L, "meta"); break;
    case MS_DEVICE_CUDA: lua_pushfstring(L, "cuda:%d", ms_tensor_device_index(t)); break;
    case MS_DEVICE_INVALID: lua_pushnil(L); break; /* a NULL tensor: check_tensor never gives one */
    }
}

static int t_device(lua_State *L) {
    push_device(L, check_tensor(L, 1));
    return 1;
}

/* t:to(dtype) casts; t:to("cpu" | "cuda:N") moves to another device. */
static int t_to(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    ms_device_type dev;
    int idx;
    bool move = lua_type(L, 2) == LUA_TSTRING && ms_device_parse(lua_tostring(L, 2), &dev, &idx) == MS_OK;
    ms_dtype dt = move ? ms_tensor_dtype(t) : opt_dtype(L, 2, ms_tensor_dtype(t));
    box *b = box_new(L, TENSOR_MT);
    ms_tensor *r;
    CHECK(L, move ? ms_tensor_to_device(&r, t, dev, idx) : ms_tensor_to(&r, t, dt));
    b->h = r;
    return 1;
}

static int t_copy_(lua_State *L) {
    CHECK(L, ms_tensor_copy(check_tensor(L, 1), check_tensor(L, 2)));
    lua_settop(L, 1);
    return 1;
}

static int t_fill_(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    if (!lua_isboolean(L, 2)) luaL_checknumber(L, 2);
    ms_dtype dt = ms_tensor_dtype(t);
    if (ms_dtype_is_float(dt)) {
        CHECK(L, ms_tensor_fill(t, lua_isboolean(L, 2) ? lua_toboolean(L, 2) : lua_tonumber(L, 2)));
    } else {
        int64_t v;
        if (int_element(L, 2, dt, "fill_: ", &v)) return luaL_error(L, "%s", lua_tostring(L, -1));
        CHECK(L, ms_tensor_fill_int(t, v));
    }
    lua_settop(L, 1);
    return 1;
}

static int t_narrow(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    int dim = check_int(L, 2, "narrow: dim");
    int64_t start = luaL_checkinteger(L, 3), len = luaL_checkinteger(L, 4);
    box *b = box_new(L, TENSOR_MT);
    ms_tensor *r;
    CHECK(L, ms_tensor_narrow(&r, t, dim, start, len));
    b->h = r;
    return 1;
}

static int t_view(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    int64_t shape[MS_MAX_DIMS];
    int nd = check_int_list(L, 2, "shape", shape, MS_MAX_DIMS);
    box *b = box_new(L, TENSOR_MT);
    ms_tensor *r;
    CHECK(L, ms_tensor_view(&r, t, nd, shape));
    b->h = r;
    return 1;
}

/* t:chunk(chunks, index, dim?) -- piece `index` (0-based) of torch.chunk */
static int t_chunk(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    int64_t chunks = luaL_checkinteger(L, 2), index = luaL_checkinteger(L, 3);
    int dim = opt_int(L, 4, "chunk: dim", 0);
    box *b = box_new(L, TENSOR_MT);
    ms_tensor *r;
    CHECK(L, ms_tensor_chunk(&r, t, chunks, index, dim));
    b->h = r;
    return 1;
}

/* Reads t as a contiguous buffer of `as` (a private copy); returns the owning tensor. */
/* A cpu copy of t in dtype `as` (a cuda tensor comes to the host first), kept alive (and
 * freed) by a box on the Lua stack. */
static ms_tensor *read_as(lua_State *L, ms_tensor *t, ms_dtype as) {
    if (ms_tensor_device(t) == MS_DEVICE_META)
        luaL_error(L, "moonshard device error: totable/bits: a meta tensor holds no data");
    if (ms_tensor_device(t) != MS_DEVICE_CPU) {
        box *host = box_new(L, TENSOR_MT);
        CHECK(L, ms_tensor_to_device((ms_tensor **)&host->h, t, MS_DEVICE_CPU, 0));
        t = host->h;
    }
    box *b = box_new(L, TENSOR_MT);
    ms_tensor *r;
    ms_status st = ms_tensor_to(&r, t, as);
    if (st) ms_lua_fail(L, st);
    b->h = r;
    return r;
}

static int t_totable(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    ms_dtype dt = ms_tensor_dtype(t);
    bool is_float = ms_dtype_is_float(dt);
    ms_tensor *c = read_as(L, t, is_float ? MS_F64 : MS_I64);
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

static int t_bits(lua_State *L) {
    ms_tensor *t = check_tensor(L, 1);
    ms_dtype dt = ms_tensor_dtype(t);
    ms_tensor *c = read_as(L, t, dt);
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

static int t_tostring(lua_State *L) {
    box *b = luaL_checkudata(L, 1, TENSOR_MT);
    if (!b->h) {
        lua_pushliteral(L, "tensor (released)");
        return 1;
    }
    ms_tensor *t = b->h;
    luaL_Buffer buf;
    luaL_buffinit(L, &buf);
    luaL_addstring(&buf, "tensor([");
    for (int i = 0; i < ms_tensor_ndim(t); i++) {
        lua_pushfstring(L, i ? ", %I" : "%I", (lua_Integer)ms_tensor_size(t, i));
        luaL_addvalue(&buf);
    }
    lua_pushfstring(L, "], %s, ", ms_dtype_name(ms_tensor_dtype(t)));
    luaL_addvalue(&buf);
    push_device(L, t);
    luaL_addvalue(&buf);
    luaL_addchar(&buf, ')');
    luaL_pushresult(&buf);
    return 1;
}

/* ---------------------------------------------------------------- registration */

void open_tensor_class(lua_State *L) {
    static const luaL_Reg tensor_methods[] = {
        {"shape", t_shape}, {"stride", t_stride}, {"dtype", t_dtype}, {"numel", t_numel},
        {"nbytes", t_nbytes}, {"ndim", t_ndim}, {"device", t_device},
        {"is_contiguous", t_is_contiguous}, {"to", t_to}, {"copy_", t_copy_}, {"fill_", t_fill_},
        {"narrow", t_narrow}, {"view", t_view}, {"chunk", t_chunk}, {"totable", t_totable},
        {"bits", t_bits}, {"release", tensor_gc}, {NULL, NULL}};
    new_class(L, TENSOR_MT, tensor_methods, tensor_gc, t_tostring);
}
