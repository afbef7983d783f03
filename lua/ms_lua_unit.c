/*
 * ms_lua_unit.c: the Lua 5.4 binding's shard units: core.unit and the methods of
 * moonshard.Unit.
 */
#include "ms_lua_internal.h"

#include <lauxlib.h>
#include <lua.h>

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

DEFINE_RELEASE(unit_gc, UNIT_MT, ms_unit_release)

/* ---------------------------------------------------------------- shard units */

static int opt_dtype_or_unset(lua_State *L, int idx) {
    if (lua_isnoneornil(L, idx)) return -1;
    return (int)opt_dtype(L, idx, MS_F32);
}

/* core.unit(name, shard_group, replicate_group|nil, param_dtype|nil, reduce_dtype|nil,
 *           reshard_after_forward) -- reshard: true, false or an integer k */
int l_unit(lua_State *L) {
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
    double b1, b2, eps, wd; /* torch's defaults, from the core */
    CHECK(L, ms_adamw_defaults(&b1, &b2, &eps, &wd));
    double lr = opt_field_number(L, 2, fn, "lr", true, 0);
    eps = opt_field_number(L, 2, fn, "eps", false, eps);
    wd = opt_field_number(L, 2, fn, "weight_decay", false, wd);
    lua_getfield(L, 2, "step");
    int is_int;
    lua_Integer step = lua_tointegerx(L, -1, &is_int);
    if (!is_int)
        return luaL_error(L, "moonshard invalid_argument error: %s: field 'step' is %s; expected an integer "
                          "(the step count, from 1)", fn, lua_isnumber(L, -1) ? "not an integer" : luaL_typename(L, -1));
    lua_pop(L, 1);
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

ms_unit *ms_lua_to_unit(lua_State *L, int idx) {
    box *b = luaL_testudata(L, idx, UNIT_MT);
    return b ? b->h : NULL;
}

/* ---------------------------------------------------------------- registration */

void open_unit_class(lua_State *L) {
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
}
