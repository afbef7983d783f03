/*
 * ms_lua.c: the Lua 5.4 binding of libmoonshard (luaopen_moonshard_core): the module table,
 * the boxes of the four classes, the primitives moonshard.args uses, and the functions of no
 * class.  The classes' raw functions: ms_lua_tensor.c, ms_lua_mesh.c, ms_lua_unit.c.
 *
 * Raw (lua/moonshard/raw.lua lists the functions): values go across and a failed core call
 * returns nil and "moonshard <status> error: <message>"; the API's checks, defaults and
 * messages are written once in Lua (moonshard.args, .tensor, .mesh, .unit) for this binding
 * and LuaJIT's FFI binding alike.  Boxes follow liolib: a box is made closed before its
 * handle is acquired, and __gc / __close share one idempotent release.
 */
#include "ms_lua_internal.h"

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include <stdint.h>
#include <string.h>

const char *const ms_lua_class_mt[CLASS_COUNT] = {"moonshard.Tensor", "moonshard.Mesh", "moonshard.Group",
                                                  "moonshard.Unit"};
const char *const ms_lua_class_word[CLASS_COUNT] = {"tensor", "mesh", "group", "unit"};

/* ---------------------------------------------------------------- results */

int ms_lua_failed(lua_State *L, ms_status st) {
    lua_pushnil(L);
    lua_pushfstring(L, "moonshard %s error: %s", ms_status_name(st), ms_last_error());
    return 2;
}

int ms_lua_done(lua_State *L) {
    lua_pushboolean(L, 1);
    return 1;
}

/* ---------------------------------------------------------------- boxes */

box *box_new(lua_State *L, ms_lua_class c) {
    box *b = lua_newuserdatauv(L, sizeof *b, 0);
    b->h = NULL; /* closed until the handle exists */
    luaL_setmetatable(L, ms_lua_class_mt[c]);
    return b;
}

void *box_get(lua_State *L, int idx, ms_lua_class c) {
    box *b = luaL_checkudata(L, idx, ms_lua_class_mt[c]);
    if (!b->h) luaL_error(L, "moonshard state error: attempt to use a released %s", ms_lua_class_word[c]);
    return b->h;
}

/* The class of the value at idx, or -1. */
static int class_of(lua_State *L, int idx) {
    for (int c = 0; c < CLASS_COUNT; c++)
        if (luaL_testudata(L, idx, ms_lua_class_mt[c])) return c;
    return -1;
}

static void release_handle(int c, void *h) {
    switch ((ms_lua_class)c) {
    case CLASS_TENSOR: ms_tensor_release(h); break;
    case CLASS_MESH: ms_mesh_release(h); break;
    case CLASS_GROUP: ms_comm_release(h); break;
    case CLASS_UNIT: ms_unit_release(h); break;
    case CLASS_COUNT: break;
    }
}

/* release(obj) and every class's __gc and __close: the handle, once. */
static int l_release(lua_State *L) {
    int c = class_of(L, 1);
    if (c < 0) return luaL_argerror(L, 1, "a moonshard object expected");
    box *b = lua_touserdata(L, 1);
    if (b->h) {
        void *h = b->h;
        b->h = NULL;
        release_handle(c, h);
    }
    return 0;
}

static int l_classof(lua_State *L) {
    int c = class_of(L, 1);
    if (c < 0) lua_pushnil(L);
    else lua_pushstring(L, ms_lua_class_word[c]);
    return 1;
}

/* state(v, class) -> true for a live object of the class, false for a released one, else nil */
static int l_state(lua_State *L) {
    int c = (int)luaL_checkinteger(L, 2);
    box *b = c >= 0 && c < CLASS_COUNT ? luaL_testudata(L, 1, ms_lua_class_mt[c]) : NULL;
    if (!b) lua_pushnil(L);
    else lua_pushboolean(L, b->h != NULL);
    return 1;
}

/* __tostring: "<class> (released)", else the class's own format (upvalue 1). */
static int box_tostring(lua_State *L) {
    int c = class_of(L, 1);
    if (c < 0 || !((box *)lua_touserdata(L, 1))->h) {
        lua_pushfstring(L, "%s (released)", c < 0 ? "?" : ms_lua_class_word[c]);
        return 1;
    }
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_pushvalue(L, 1);
    lua_call(L, 1, 1);
    return 1;
}

/* define(class, methods, tostring_live): the class's methods and format. */
static int l_define(lua_State *L) {
    const char *word = luaL_checkstring(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    luaL_checktype(L, 3, LUA_TFUNCTION);
    int c = 0;
    while (c < CLASS_COUNT && strcmp(word, ms_lua_class_word[c])) c++;
    if (c == CLASS_COUNT) return luaL_argerror(L, 1, "not a class");
    luaL_getmetatable(L, ms_lua_class_mt[c]);
    lua_pushvalue(L, 2);
    lua_setfield(L, -2, "__index");
    lua_pushvalue(L, 3);
    lua_pushcclosure(L, box_tostring, 1);
    lua_setfield(L, -2, "__tostring");
    return 0;
}

/* ---------------------------------------------------------------- values */

int int_list(lua_State *L, int idx, int64_t *out) {
    luaL_checktype(L, idx, LUA_TTABLE);
    lua_Integer n = luaL_len(L, idx);
    if (n > MS_MAX_DIMS) luaL_error(L, "moonshard invalid_argument error: %I entries, at most %d allowed", n, MS_MAX_DIMS);
    for (int i = 0; i < (int)n; i++) {
        lua_geti(L, idx, i + 1);
        out[i] = (int64_t)luaL_checkinteger(L, -1);
        lua_pop(L, 1);
    }
    return (int)n;
}

void push_int_list(lua_State *L, const int64_t *v, int n) {
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, (lua_Integer)v[i]);
        lua_rawseti(L, -2, i + 1);
    }
}

static int l_to_integer(lua_State *L) {
    int ok;
    lua_Integer v = lua_tointegerx(L, 1, &ok);
    if (ok) lua_pushinteger(L, v);
    else lua_pushnil(L);
    return 1;
}

static int l_is_number(lua_State *L) {
    lua_pushboolean(L, lua_isnumber(L, 1));
    return 1;
}

/* int_element(v, dtype) -> the element, or nil and the reason (ms_int_element) */
static int l_int_element(lua_State *L) {
    ms_dtype dt = (ms_dtype)luaL_checkinteger(L, 2);
    int64_t out;
    ms_status st;
    if (lua_isboolean(L, 1)) st = ms_int_element(dt, 0, lua_toboolean(L, 1), 0, &out);
    else if (lua_isinteger(L, 1)) st = ms_int_element(dt, 0, (int64_t)lua_tointeger(L, 1), 0, &out);
    else st = ms_int_element(dt, 1, 0, (double)luaL_checknumber(L, 1), &out);
    if (st) {
        lua_pushnil(L);
        lua_pushstring(L, ms_last_error());
        return 2;
    }
    lua_pushinteger(L, (lua_Integer)out);
    return 1;
}

/* ---------------------------------------------------------------- dtypes, devices, ops */

static int l_dtype_code(lua_State *L) {
    ms_dtype d;
    TRY(L, ms_dtype_parse(luaL_checkstring(L, 1), &d));
    lua_pushinteger(L, d);
    return 1;
}

static int l_dtype_name(lua_State *L) {
    lua_pushstring(L, ms_dtype_name((ms_dtype)luaL_checkinteger(L, 1)));
    return 1;
}

static int l_dtype_size(lua_State *L) {
    lua_pushinteger(L, ms_dtype_size((ms_dtype)luaL_checkinteger(L, 1)));
    return 1;
}

static int l_dtype_is_float(lua_State *L) {
    lua_pushboolean(L, ms_dtype_is_float((ms_dtype)luaL_checkinteger(L, 1)));
    return 1;
}

static int l_device_code(lua_State *L) {
    ms_device_type type;
    int index;
    TRY(L, ms_device_parse(luaL_checkstring(L, 1), &type, &index));
    lua_pushinteger(L, type);
    lua_pushinteger(L, index);
    return 2;
}

static int l_op_code(lua_State *L) {
    ms_op op;
    TRY(L, ms_op_parse(luaL_checkstring(L, 1), &op));
    lua_pushinteger(L, op);
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

/* file_stat(path) -> kind (ms_file_kind_name), size | nil, "<path>: <reason>" */
static int l_file_stat(lua_State *L) {
    ms_file_kind kind;
    int64_t size;
    if (ms_file_stat(luaL_checkstring(L, 1), &kind, &size) != MS_OK) {
        lua_pushnil(L);
        lua_pushstring(L, ms_last_error());
        return 2;
    }
    lua_pushstring(L, ms_file_kind_name(kind));
    lua_pushinteger(L, (lua_Integer)size);
    return 2;
}

/* file_read_region(path, offset, dtype, src_shape, start, perm|nil, dst) -> bytes read | nil, err */
static int l_file_read_region(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    int64_t shape[MS_MAX_DIMS], start[MS_MAX_DIMS], perm[MS_MAX_DIMS];
    int nd = int_list(L, 4, shape);
    if (int_list(L, 5, start) != nd) return luaL_error(L, "moonshard internal error: file_read_region: start");
    int has_perm = !lua_isnoneornil(L, 6);
    if (has_perm && int_list(L, 6, perm) != nd) return luaL_error(L, "moonshard internal error: file_read_region: perm");
    int64_t bytes = 0;
    TRY(L, ms_file_read_region(path, (int64_t)luaL_checkinteger(L, 2), (ms_dtype)luaL_checkinteger(L, 3), nd, shape,
                               start, has_perm ? perm : NULL, check_tensor(L, 7), &bytes));
    lua_pushinteger(L, (lua_Integer)bytes);
    return 1;
}

static int l_cast_set_impl(lua_State *L) {
    TRY(L, ms_cast_set_impl((ms_cast_impl)luaL_checkinteger(L, 1)));
    return ms_lua_done(L);
}

static int l_cast_get_impl(lua_State *L) {
    lua_pushinteger(L, ms_cast_get_impl());
    return 1;
}

static int l_adamw_defaults(lua_State *L) {
    double d[4];
    TRY(L, ms_adamw_defaults(&d[0], &d[1], &d[2], &d[3]));
    for (int i = 0; i < 4; i++) lua_pushnumber(L, d[i]);
    return 4;
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
    box *b = luaL_testudata(L, idx, ms_lua_class_mt[CLASS_UNIT]);
    return b ? b->h : NULL;
}

/* ---------------------------------------------------------------- registration */

/* The core's enums and the binding's own codes, as raw.lua's `const`. */
static void push_constants(lua_State *L) {
    static const struct { const char *name; int value; } k[] = {
        {"F32", MS_F32}, {"F64", MS_F64}, {"I64", MS_I64}, {"BOOL", MS_BOOL}, {"DTYPE_COUNT", MS_DTYPE_COUNT},
        {"DEVICE_CPU", MS_DEVICE_CPU}, {"DEVICE_META", MS_DEVICE_META}, {"DEVICE_CUDA", MS_DEVICE_CUDA},
        {"OP_SUM", MS_OP_SUM}, {"PLACEMENT_REPLICATE", MS_PLACE_REPLICATE},
        {"PLACEMENT_SHARD", MS_PLACE_SHARD}, {"PLACEMENT_PARTIAL", MS_PLACE_PARTIAL},
        {"RESHARD_FULL", MS_RESHARD_FULL}, {"RESHARD_KEEP", MS_RESHARD_KEEP},
        {"ADAMW_MASTER", MS_ADAMW_MASTER}, {"ADAMW_TORCH", MS_ADAMW_TORCH}, {"ADAMW_EXP_AVG", MS_ADAMW_EXP_AVG},
        {"ADAMW_EXP_AVG_SQ", MS_ADAMW_EXP_AVG_SQ}, {"ADAMW_MASTER_WEIGHTS", MS_ADAMW_MASTER_WEIGHTS},
        {"CAST_AUTO", MS_CAST_AUTO}, {"CAST_PORTABLE", MS_CAST_PORTABLE}, {"CAST_AVX2", MS_CAST_AVX2},
        {"P2P_SEND", MS_P2P_SEND}, {"P2P_RECV", MS_P2P_RECV},
    };
    lua_createtable(L, 0, (int)(sizeof k / sizeof k[0]) + 20);
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        lua_pushinteger(L, k[i].value);
        lua_setfield(L, -2, k[i].name);
    }
    static const char *const class_codes[CLASS_COUNT] = {"CLASS_TENSOR", "CLASS_MESH", "CLASS_GROUP", "CLASS_UNIT"};
    for (int c = 0; c < CLASS_COUNT; c++) { /* state()'s codes */
        lua_pushinteger(L, c);
        lua_setfield(L, -2, class_codes[c]);
    }
}

int luaopen_moonshard_core(lua_State *L) {
    static const luaL_Reg funcs[] = {
        {"to_integer", l_to_integer}, {"is_number", l_is_number}, {"classof", l_classof}, {"state", l_state},
        {"release", l_release}, {"define", l_define}, {"int_element", l_int_element},
        {"dtype_code", l_dtype_code}, {"dtype_name", l_dtype_name}, {"dtype_size", l_dtype_size},
        {"dtype_is_float", l_dtype_is_float}, {"device_code", l_device_code}, {"op_code", l_op_code},
        {"cuda_device_count", l_cuda_device_count}, {"file_stat", l_file_stat},
        {"file_read_region", l_file_read_region},
        {"cast_set_impl", l_cast_set_impl}, {"cast_get_impl", l_cast_get_impl},
        {"adamw_defaults", l_adamw_defaults}, {"memory_cap", ms_lua_memory_cap},
        {"memory_refused", ms_lua_memory_refused}, {NULL, NULL}};
    for (int c = 0; c < CLASS_COUNT; c++) {
        luaL_newmetatable(L, ms_lua_class_mt[c]);
        lua_pushcfunction(L, l_release);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, l_release);
        lua_setfield(L, -2, "__close");
        lua_pop(L, 1); /* __name: luaL_newmetatable's */
    }
    luaL_newlib(L, funcs);
    lua_pushstring(L, ms_version());
    lua_setfield(L, -2, "version");
    lua_pushinteger(L, MS_MAX_DIMS);
    lua_setfield(L, -2, "MAX_DIMS");
    push_constants(L);
    lua_setfield(L, -2, "const");
    ms_lua_open_tensor(L);
    ms_lua_open_mesh(L);
    ms_lua_open_unit(L);
    ms_lua_open_quant(L);
    ms_lua_open_ckpt(L);
    return 1;
}
