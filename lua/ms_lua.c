/*
 * ms_lua.c: the Lua 5.4 binding of libmoonshard (luaopen_moonshard_core).
 *
 * Thin functions that check their Lua arguments, call the core and turn a failed status
 * into one Lua error naming the status and the core's message.  Userdata follow liolib:
 * the box is made "closed" before the handle is acquired, and __gc / __close share one
 * idempotent release, so an error half-way leaves nothing behind.
 *
 * The world: the moonshard executable stores each rank's world comm in the registry
 * (ms_lua_set_world) before the script runs.  A stock lua5.4 that does
 * `require "moonshard"` gets a world of one rank, made on first use.
 */
#include "moonshard.h"
#include "ms_lua.h"

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TENSOR_MT "moonshard.Tensor"
#define MESH_MT "moonshard.Mesh"
#define GROUP_MT "moonshard.Group"
#define UNIT_MT "moonshard.Unit"
#define WORLD_KEY "moonshard.world"     /* light userdata: ms_comm * of this rank */
#define WORLD_OWNER_KEY "moonshard.world_owner" /* full userdata owning a 1-rank world */

/* ---------------------------------------------------------------- errors */

static int ms_lua_fail(lua_State *L, ms_status st) {
    return luaL_error(L, "moonshard %s error: %s", ms_status_name(st), ms_last_error());
}

/* Raises the Lua error for a failed core call (luaL_error does not return). */
#define CHECK(L, call)                       \
    do {                                     \
        ms_status st_ = (call);              \
        if (st_ != MS_OK) ms_lua_fail(L, st_); \
    } while (0)

/* ---------------------------------------------------------------- boxes */

typedef struct { void *h; } box;

static void *box_new(lua_State *L, const char *mt) {
    box *b = lua_newuserdatauv(L, sizeof *b, 0);
    b->h = NULL; /* closed until the handle exists */
    luaL_setmetatable(L, mt);
    return b;
}

static void *box_get(lua_State *L, int idx, const char *mt, const char *what) {
    box *b = luaL_checkudata(L, idx, mt);
    if (!b->h) luaL_error(L, "moonshard state error: attempt to use a released %s", what);
    return b->h;
}

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
DEFINE_RELEASE(tensor_gc, TENSOR_MT, ms_tensor_release)
DEFINE_RELEASE(mesh_gc, MESH_MT, ms_mesh_release)
DEFINE_RELEASE(group_gc, GROUP_MT, ms_comm_release)
DEFINE_RELEASE(unit_gc, UNIT_MT, ms_unit_release)

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

static int l_rank(lua_State *L) {
    lua_pushinteger(L, ms_comm_rank(get_world(L)));
    return 1;
}
static int l_world_size(lua_State *L) {
    lua_pushinteger(L, ms_comm_size(get_world(L)));
    return 1;
}
static int l_backend(lua_State *L) {
    lua_pushstring(L, ms_comm_backend(get_world(L)));
    return 1;
}

/* device() -> where this rank's tensors go: "cuda:N" (its GPU) on the nccl backend, else "cpu" */
static int l_device(lua_State *L) {
    if (strcmp(ms_comm_backend(get_world(L)), "nccl") == 0) lua_pushfstring(L, "cuda:%d", ms_nccl_device());
    else lua_pushliteral(L, "cpu");
    return 1;
}

/* ---------------------------------------------------------------- argument helpers */

static ms_dtype opt_dtype(lua_State *L, int idx, ms_dtype def) {
    if (lua_isnoneornil(L, idx)) return def;
    ms_dtype d;
    ms_status st = ms_dtype_parse(luaL_checkstring(L, idx), &d);
    if (st) ms_lua_fail(L, st);
    return d;
}

/* A Lua sequence of integers (a shape, a list of sizes); returns its length. */
static int check_int_list(lua_State *L, int idx, const char *what, int64_t *out, int cap) {
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
static int check_int(lua_State *L, int idx, const char *what) {
    lua_Integer v = luaL_checkinteger(L, idx);
    if (v < INT_MIN || v > INT_MAX) luaL_error(L, "moonshard invalid_argument error: %s %I is out of range", what, v);
    return (int)v;
}

static int opt_int(lua_State *L, int idx, const char *what, int def) {
    return lua_isnoneornil(L, idx) ? def : check_int(L, idx, what);
}

static void push_int_list(lua_State *L, const int64_t *v, int n) {
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, (lua_Integer)v[i]);
        lua_rawseti(L, -2, i + 1);
    }
}

static ms_op opt_op(lua_State *L, int idx) {
    if (lua_isnoneornil(L, idx)) return MS_OP_SUM;
    ms_op op;
    ms_status st = ms_op_parse(luaL_checkstring(L, idx), &op);
    if (st) ms_lua_fail(L, st);
    return op;
}

/* ---------------------------------------------------------------- tensors */

static int l_tensor(lua_State *L) {
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
static int l_from_table(lua_State *L) {
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

/* ---------------------------------------------------------------- meshes */

/* ms.mesh({{"dp_replicate", 2}, {"dp_shard", 4}}, {shape_only = true}?) */
static int l_mesh(lua_State *L) {
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
static int l_local_shape(lua_State *L) {
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

static int l_fsdp_shard(lua_State *L) {
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

static int l_chunk_extent(lua_State *L) {
    int64_t len, off;
    CHECK(L, ms_chunk_extent(luaL_checkinteger(L, 1), luaL_checkinteger(L, 2), luaL_checkinteger(L, 3), &len, &off));
    lua_pushinteger(L, (lua_Integer)len);
    lua_pushinteger(L, (lua_Integer)off);
    return 2;
}

/* ---------------------------------------------------------------- shard units */

static int opt_dtype_or_unset(lua_State *L, int idx) {
    if (lua_isnoneornil(L, idx)) return -1;
    return (int)opt_dtype(L, idx, MS_F32);
}

/* core.unit(name, shard_group, replicate_group|nil, param_dtype|nil, reduce_dtype|nil,
 *           reshard_after_forward) -- reshard: true, false or an integer k */
static int l_unit(lua_State *L) {
    const char *name = luaL_checkstring(L, 1);
    ms_comm *shard = check_group(L, 2);
    ms_comm *replicate = lua_isnoneornil(L, 3) ? NULL : check_group(L, 3);
    int pd = opt_dtype_or_unset(L, 4), rd = opt_dtype_or_unset(L, 5);
    /* PyTorch's: true (the default), false or the integer the C API takes */
    int raf = MS_RESHARD_FULL;
    if (lua_isboolean(L, 6)) raf = lua_toboolean(L, 6) ? MS_RESHARD_FULL : MS_RESHARD_KEEP;
    else if (!lua_isnoneornil(L, 6)) raf = check_int(L, 6, "unit: reshard_after_forward");
    box *b = box_new(L, UNIT_MT);
    ms_unit *u;
    CHECK(L, ms_unit_new(&u, name, shard, replicate, pd, rd, raf));
    b->h = u;
    return 1;
}

/* unit:add_param(fqn, shape, dtype, dim?, requires_grad?) -> index (0-based) */
static int u_add_param(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    const char *fqn = luaL_checkstring(L, 2);
    int64_t shape[MS_MAX_DIMS];
    int nd = check_int_list(L, 3, "shape", shape, MS_MAX_DIMS);
    ms_dtype dt = opt_dtype(L, 4, MS_F32);
    int dim = opt_int(L, 5, "add_param: dim", 0);
    int requires_grad = lua_isnoneornil(L, 6) ? 1 : lua_toboolean(L, 6);
    CHECK(L, ms_unit_add_param(u, fqn, nd, shape, dt, dim, requires_grad));
    lua_pushinteger(L, ms_unit_param_count(u) - 1);
    return 1;
}

static int param_index(lua_State *L, ms_unit *u, int idx) {
    lua_Integer i = luaL_checkinteger(L, idx);
    if (i < 0 || i >= ms_unit_param_count(u))
        luaL_error(L, "moonshard invalid_argument error: unit %s has no parameter %I (it has %d, numbered from 0)", ms_unit_name(u), i,
                   ms_unit_param_count(u));
    return (int)i;
}

/* Pushes a tensor the unit lends: the Lua object holds its own reference. */
static int push_borrowed(lua_State *L, ms_tensor *t) {
    if (!t) {
        lua_pushnil(L);
        return 1;
    }
    box *b = box_new(L, TENSOR_MT);
    ms_tensor_retain(t);
    b->h = t;
    return 1;
}

#define UNIT_TENSOR_GETTER(fname, call)                                  \
    static int fname(lua_State *L) {                                     \
        ms_unit *u = check_unit(L, 1);                                   \
        int i = param_index(L, u, 2);                                    \
        ms_tensor *t = call(u, i);                                       \
        if (!t && ms_last_error()[0])                                    \
            return luaL_error(L, "moonshard state error: %s", ms_last_error()); \
        return push_borrowed(L, t);                                      \
    }
UNIT_TENSOR_GETTER(u_param_shard, ms_unit_param_shard)
UNIT_TENSOR_GETTER(u_grad_shard, ms_unit_grad_shard)
UNIT_TENSOR_GETTER(u_param_full, ms_unit_param_full)
UNIT_TENSOR_GETTER(u_grad_full, ms_unit_grad_full)

#define UNIT_ACTION(fname, call)                 \
    static int fname(lua_State *L) {             \
        CHECK(L, call(check_unit(L, 1)));        \
        lua_settop(L, 1);                        \
        return 1;                                \
    }
UNIT_ACTION(u_finalize, ms_unit_finalize)
UNIT_ACTION(u_unshard, ms_unit_unshard)
UNIT_ACTION(u_wait, ms_unit_wait)
UNIT_ACTION(u_reshard, ms_unit_reshard)
UNIT_ACTION(u_reduce_grads, ms_unit_reduce_grads)
UNIT_ACTION(u_release_unsharded, ms_unit_release_unsharded)
UNIT_ACTION(u_zero_grad, ms_unit_zero_grad)

static int u_load_full(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    CHECK(L, ms_unit_load_full(u, param_index(L, u, 2), check_tensor(L, 3)));
    lua_settop(L, 1);
    return 1;
}

/* unit:param_offset(i) -> offset, rows, dim: this rank's shard of parameter i is rows
 * [offset, offset + rows) of the full parameter's dim `dim` (0-based, like add_param's) */
static int u_param_offset(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    int dim;
    int64_t offset, rows;
    CHECK(L, ms_unit_param_offset(u, param_index(L, u, 2), &dim, &offset, &rows));
    lua_pushinteger(L, (lua_Integer)offset);
    lua_pushinteger(L, (lua_Integer)rows);
    lua_pushinteger(L, dim);
    return 3;
}

static int u_set_sync(lua_State *L) {
    CHECK(L, ms_unit_set_requires_gradient_sync(check_unit(L, 1), lua_toboolean(L, 2)));
    lua_settop(L, 1);
    return 1;
}

/* unit:set_cpu_offload(offload): FSDP2's CPUOffloadPolicy, before the first add_param */
static int u_set_cpu_offload(lua_State *L) {
    CHECK(L, ms_unit_set_cpu_offload(check_unit(L, 1), lua_toboolean(L, 2)));
    lua_settop(L, 1);
    return 1;
}

static int u_set_divide_factor(lua_State *L) {
    CHECK(L, ms_unit_set_gradient_divide_factor(check_unit(L, 1), luaL_checknumber(L, 2)));
    lua_settop(L, 1);
    return 1;
}

static int u_grad_sq_norm(lua_State *L) {
    double v;
    CHECK(L, ms_unit_grad_sq_norm(check_unit(L, 1), &v));
    lua_pushnumber(L, v);
    return 1;
}

static int u_scale_grads(lua_State *L) {
    CHECK(L, ms_unit_scale_grads(check_unit(L, 1), luaL_checknumber(L, 2)));
    lua_settop(L, 1);
    return 1;
}

/* Field `name` of the options table at t: a number (required, or def when absent). */
static double opt_field_number(lua_State *L, int t, const char *fn, const char *name, bool required, double def) {
    lua_getfield(L, t, name);
    int ok = lua_isnumber(L, -1);
    double v = ok ? lua_tonumber(L, -1) : def;
    if (!ok && (required || !lua_isnil(L, -1)))
        luaL_error(L, "moonshard invalid_argument error: %s: field '%s' is %s; expected a number", fn, name,
                   luaL_typename(L, -1));
    lua_pop(L, 1);
    return v;
}

/* unit:adamw_step{lr=, betas={b1, b2}, eps=, weight_decay=, step=}: lr and step required */
static int u_adamw_step(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    const char *fn = "adamw_step";
    /* a misspelt key would silently leave its default in place */
    static const char *const fields[] = {"lr", "betas", "eps", "weight_decay", "step", NULL};
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        lua_pop(L, 1);
        bool known = false;
        for (int j = 0; fields[j] && lua_type(L, -1) == LUA_TSTRING; j++) known |= !strcmp(lua_tostring(L, -1), fields[j]);
        if (!known)
            return luaL_error(L, "moonshard invalid_argument error: %s: unknown field '%s'; expected lr, betas, eps, "
                              "weight_decay and step", fn, lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1)
                                                                                           : luaL_typename(L, -1));
    }
    double lr = opt_field_number(L, 2, fn, "lr", true, 0);
    double eps = opt_field_number(L, 2, fn, "eps", false, 1e-8);
    double wd = opt_field_number(L, 2, fn, "weight_decay", false, 0.01);
    lua_getfield(L, 2, "step");
    int is_int;
    lua_Integer step = lua_tointegerx(L, -1, &is_int);
    if (!is_int)
        return luaL_error(L, "moonshard invalid_argument error: %s: field 'step' is %s; expected an integer "
                          "(the step count, from 1)", fn, lua_isnumber(L, -1) ? "not an integer" : luaL_typename(L, -1));
    lua_pop(L, 1);
    double b1 = 0.9, b2 = 0.999;
    lua_getfield(L, 2, "betas");
    if (!lua_isnil(L, -1)) {
        if (!lua_istable(L, -1))
            return luaL_error(L, "moonshard invalid_argument error: %s: field 'betas' is %s; expected {beta1, beta2}",
                              fn, luaL_typename(L, -1));
        int betas = lua_gettop(L);
        lua_geti(L, betas, 1);
        lua_geti(L, betas, 2);
        if (!lua_isnumber(L, -2) || !lua_isnumber(L, -1))
            return luaL_error(L, "moonshard invalid_argument error: %s: field 'betas' must be two numbers "
                              "{beta1, beta2}", fn);
        b1 = lua_tonumber(L, -2);
        b2 = lua_tonumber(L, -1);
        lua_pop(L, 2);
    }
    lua_pop(L, 1);
    CHECK(L, ms_unit_adamw_step(u, lr, b1, b2, eps, wd, (int64_t)step));
    lua_settop(L, 1);
    return 1;
}

/* The index in names (NULL-terminated) of the string argument idx, or -1. */
static int name_index(lua_State *L, int idx, const char *const *names) {
    const char *s = luaL_checkstring(L, idx);
    for (int j = 0; names[j]; j++)
        if (!strcmp(s, names[j])) return j;
    return -1;
}

/* unit:adamw_state(i, "exp_avg" | "exp_avg_sq" | "master") -> tensor or nil (ms_unit_adamw_state) */
static int u_adamw_state(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    int i = param_index(L, u, 2);
    static const char *const which[] = {"exp_avg", "exp_avg_sq", "master", NULL};
    int k = name_index(L, 3, which);
    if (k < 0)
        return luaL_error(L, "moonshard invalid_argument error: adamw_state: '%s'; expected 'exp_avg', 'exp_avg_sq' "
                          "or 'master'", lua_tostring(L, 3));
    ms_tensor *t = ms_unit_adamw_state(u, i, k);
    if (!t && ms_last_error()[0]) return luaL_error(L, "moonshard state error: %s", ms_last_error());
    return push_borrowed(L, t);
}

/* unit:adamw_skipped(i) -> the adamw_step calls parameter i had no gradient in */
static int u_adamw_skipped(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    lua_pushinteger(L, (lua_Integer)ms_unit_adamw_skipped(u, param_index(L, u, 2)));
    return 1;
}

/* unit:set_adamw_skipped(i, k) */
static int u_set_adamw_skipped(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    int i = param_index(L, u, 2);
    CHECK(L, ms_unit_set_adamw_skipped(u, i, (int64_t)luaL_checkinteger(L, 3)));
    lua_settop(L, 1);
    return 1;
}

/* unit:set_adamw("master" | "torch"): how adamw_step keeps its state (ms_unit_set_adamw) */
static int u_set_adamw(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    static const char *const modes[] = {"master", "torch", NULL};
    int mode = name_index(L, 2, modes);
    if (mode < 0)
        return luaL_error(L, "moonshard invalid_argument error: set_adamw: mode '%s'; expected 'master' (f32 master "
                          "weights and moments) or 'torch' (torch.optim.AdamW: state in the stored dtype)",
                          lua_tostring(L, 2));
    CHECK(L, ms_unit_set_adamw(u, mode == 0 ? MS_ADAMW_MASTER : MS_ADAMW_TORCH));
    lua_settop(L, 1);
    return 1;
}

/* ms_unit_bytes' categories by name; ms_unit_rank_allocated takes the first four */
static const char *const byte_categories[] = {"params", "grads", "optimizer", "unsharded", "cached"};

/* unit:bytes() -> {params=, grads=, optimizer=, unsharded=, cached=} */
static int u_bytes(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    lua_createtable(L, 0, 5);
    for (int c = 0; c < 5; c++) {
        lua_pushinteger(L, (lua_Integer)ms_unit_bytes(u, c));
        lua_setfield(L, -2, byte_categories[c]);
    }
    return 1;
}

/* unit:rank_allocated() -> {params=, grads=, optimizer=, unsharded=}: the memory allocated
 * for every unit of the rank, counted at the allocator (ms_unit_rank_allocated) */
static int u_rank_allocated(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    lua_createtable(L, 0, 4);
    for (int c = 0; c < 4; c++) {
        lua_pushinteger(L, (lua_Integer)ms_unit_rank_allocated(u, c));
        lua_setfield(L, -2, byte_categories[c]);
    }
    return 1;
}

/* unit:records() -> list of {kind=, dtype=, group_size=, bytes=} */
static int u_records(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    static const char *const kinds[] = {"all_gather", "reduce_scatter", "all_reduce"};
    int n = ms_unit_record_count(u);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        int kind, size;
        ms_dtype dt;
        int64_t bytes;
        CHECK(L, ms_unit_record(u, i, &kind, &dt, &size, &bytes));
        lua_createtable(L, 0, 4);
        lua_pushstring(L, kind >= 0 && kind < 3 ? kinds[kind] : "?");
        lua_setfield(L, -2, "kind");
        lua_pushstring(L, ms_dtype_name(dt));
        lua_setfield(L, -2, "dtype");
        lua_pushinteger(L, size);
        lua_setfield(L, -2, "group_size");
        lua_pushinteger(L, (lua_Integer)bytes);
        lua_setfield(L, -2, "bytes");
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int u_clear_records(lua_State *L) {
    ms_unit_clear_records(check_unit(L, 1));
    return 0;
}

static int u_count(lua_State *L) {
    lua_pushinteger(L, ms_unit_param_count(check_unit(L, 1)));
    return 1;
}

static int u_name(lua_State *L) {
    lua_pushstring(L, ms_unit_name(check_unit(L, 1)));
    return 1;
}

static int u_fqn(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    lua_pushstring(L, ms_unit_param_fqn(u, param_index(L, u, 2)));
    return 1;
}

static int u_tostring(lua_State *L) {
    box *b = luaL_checkudata(L, 1, UNIT_MT);
    if (!b->h) lua_pushliteral(L, "unit (released)");
    else lua_pushfstring(L, "unit(%s, %d params)", ms_unit_name(b->h), ms_unit_param_count(b->h));
    return 1;
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

ms_unit *ms_lua_to_unit(lua_State *L, int idx) {
    box *b = luaL_testudata(L, idx, UNIT_MT);
    return b ? b->h : NULL;
}

/* ---------------------------------------------------------------- registration */

static void new_class(lua_State *L, const char *mt, const luaL_Reg *methods, lua_CFunction gc,
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
    static const luaL_Reg tensor_methods[] = {
        {"shape", t_shape}, {"stride", t_stride}, {"dtype", t_dtype}, {"numel", t_numel},
        {"nbytes", t_nbytes}, {"ndim", t_ndim}, {"device", t_device},
        {"is_contiguous", t_is_contiguous}, {"to", t_to}, {"copy_", t_copy_}, {"fill_", t_fill_},
        {"narrow", t_narrow}, {"view", t_view}, {"chunk", t_chunk}, {"totable", t_totable},
        {"bits", t_bits}, {"release", tensor_gc}, {NULL, NULL}};
    static const luaL_Reg mesh_methods[] = {
        {"size", m_size}, {"axes", m_axes}, {"rank", m_rank}, {"coords", m_coords},
        {"group", m_group}, {"group_ranks", m_group_ranks}, {"release", mesh_gc}, {NULL, NULL}};
    static const luaL_Reg group_methods[] = {
        {"size", g_size}, {"rank", g_rank}, {"ranks", g_ranks}, {"all_gather", g_all_gather},
        {"reduce_scatter", g_reduce_scatter}, {"all_reduce", g_all_reduce},
        {"broadcast", g_broadcast}, {"all_to_all", g_all_to_all}, {"barrier", g_barrier},
        {"release", group_gc}, {NULL, NULL}};
    static const luaL_Reg funcs[] = {
        {"rank", l_rank}, {"world_size", l_world_size}, {"backend", l_backend}, {"device", l_device},
        {"tensor", l_tensor}, {"from_table", l_from_table}, {"mesh", l_mesh},
        {"local_shape", l_local_shape}, {"fsdp_shard", l_fsdp_shard},
        {"chunk_extent", l_chunk_extent}, {"dtype_size", l_dtype_size},
        {"cast_impl", l_cast_impl}, {"unit", l_unit}, {"cuda_device_count", l_cuda_device_count},
        {"memory_cap", ms_lua_memory_cap}, {"memory_refused", ms_lua_memory_refused}, {"file_stat", l_file_stat},
        {NULL, NULL}};
    new_class(L, TENSOR_MT, tensor_methods, tensor_gc, t_tostring);
    new_class(L, MESH_MT, mesh_methods, mesh_gc, m_tostring);
    new_class(L, GROUP_MT, group_methods, group_gc, g_tostring);
    static const luaL_Reg unit_methods[] = {
        {"add_param", u_add_param}, {"finalize", u_finalize}, {"count", u_count}, {"name", u_name},
        {"fqn", u_fqn}, {"param_shard", u_param_shard}, {"grad_shard", u_grad_shard},
        {"param_full", u_param_full}, {"grad_full", u_grad_full}, {"load_full", u_load_full},
        {"param_offset", u_param_offset},
        {"unshard", u_unshard}, {"wait", u_wait}, {"reshard", u_reshard},
        {"reduce_grads", u_reduce_grads}, {"set_requires_gradient_sync", u_set_sync},
        {"set_gradient_divide_factor", u_set_divide_factor}, {"set_cpu_offload", u_set_cpu_offload},
        {"release_unsharded", u_release_unsharded}, {"zero_grad", u_zero_grad},
        {"grad_sq_norm", u_grad_sq_norm}, {"scale_grads", u_scale_grads},
        {"adamw_step", u_adamw_step}, {"set_adamw", u_set_adamw}, {"adamw_state", u_adamw_state},
        {"adamw_skipped", u_adamw_skipped}, {"set_adamw_skipped", u_set_adamw_skipped}, {"bytes", u_bytes}, {"rank_allocated", u_rank_allocated}, {"records", u_records},
        {"clear_records", u_clear_records}, {"release", unit_gc}, {NULL, NULL}};
    new_class(L, UNIT_MT, unit_methods, unit_gc, u_tostring);
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
