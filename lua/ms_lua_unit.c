/*
 * ms_lua_unit.c: the Lua 5.4 binding's raw functions of shard units (moonshard.unit is the
 * API).  The binding's own codes (UNIT_*) pick a getter, an action or a setting, table-driven.
 */
#include "ms_lua_internal.h"

#include <lauxlib.h>
#include <lua.h>

#include <stdint.h>

static void ms_lua_open_zero(lua_State *L);

/* unit_new(name, shard, replicate|nil, param_dtype, reduce_dtype, reshard) */
static int l_unit_new(lua_State *L) {
    const char *name = luaL_checkstring(L, 1);
    ms_comm *shard = check_group(L, 2);
    ms_comm *replicate = lua_isnoneornil(L, 3) ? NULL : check_group(L, 3);
    ms_unit *u = NULL;
    BOXED(L, CLASS_UNIT,
          ms_unit_new(&u, name, shard, replicate, int_arg(L, 4), int_arg(L, 5), int_arg(L, 6)), u);
}

/* unit_add_param(u, fqn, shape, dtype, dim, requires_grad) */
static int l_unit_add_param(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    int64_t shape[MS_MAX_DIMS];
    int nd = int_list(L, 3, shape);
    TRY(L, ms_unit_add_param(u, luaL_checkstring(L, 2), nd, shape, (ms_dtype)luaL_checkinteger(L, 4), int_arg(L, 5),
                             lua_toboolean(L, 6)));
    return ms_lua_done(L);
}

static int l_unit_count(lua_State *L) {
    lua_pushinteger(L, ms_unit_param_count(check_unit(L, 1)));
    return 1;
}

static int l_unit_name(lua_State *L) {
    lua_pushstring(L, ms_unit_name(check_unit(L, 1)));
    return 1;
}

static int l_unit_fqn(lua_State *L) {
    lua_pushstring(L, ms_unit_param_fqn(check_unit(L, 1), int_arg(L, 2)));
    return 1;
}

/* A tensor the unit lends: a box with its own reference; false when there is none; nil and
 * the message when the core refused (its error set). */
static int push_lent(lua_State *L, ms_tensor *t) {
    if (!t) {
        if (!ms_last_error()[0]) {
            lua_pushboolean(L, 0);
            return 1;
        }
        lua_pushnil(L);
        lua_pushfstring(L, "moonshard state error: %s", ms_last_error());
        return 2;
    }
    box *b = box_new(L, CLASS_TENSOR);
    ms_tensor_retain(t);
    b->h = t;
    return 1;
}

static ms_tensor *(*const unit_getters[])(ms_unit *, int) = {ms_unit_param_shard, ms_unit_grad_shard,
                                                             ms_unit_param_full, ms_unit_grad_full};
static const char *const unit_getter_names[] = {"UNIT_PARAM_SHARD", "UNIT_GRAD_SHARD", "UNIT_PARAM_FULL",
                                                "UNIT_GRAD_FULL"};
enum { N_GETTERS = sizeof unit_getters / sizeof unit_getters[0] };

/* unit_tensor(u, code, i) */
static int l_unit_tensor(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    lua_Integer code = luaL_checkinteger(L, 2);
    luaL_argcheck(L, code >= 0 && code < N_GETTERS, 2, "not a UNIT_* getter code");
    return push_lent(L, unit_getters[code](u, int_arg(L, 3)));
}

static ms_status (*const unit_actions[])(ms_unit *) = {ms_unit_finalize, ms_unit_unshard, ms_unit_wait,
                                                       ms_unit_reshard, ms_unit_reduce_grads,
                                                       ms_unit_release_unsharded, ms_unit_zero_grad};
static const char *const unit_action_names[] = {"UNIT_FINALIZE", "UNIT_UNSHARD", "UNIT_WAIT", "UNIT_RESHARD",
                                                "UNIT_REDUCE_GRADS", "UNIT_RELEASE_UNSHARDED", "UNIT_ZERO_GRAD"};
enum { N_ACTIONS = sizeof unit_actions / sizeof unit_actions[0] };

/* unit_action(u, code) */
static int l_unit_action(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    lua_Integer code = luaL_checkinteger(L, 2);
    luaL_argcheck(L, code >= 0 && code < N_ACTIONS, 2, "not a UNIT_* action code");
    TRY(L, unit_actions[code](u));
    return ms_lua_done(L);
}

static ms_status (*const unit_flags[])(ms_unit *, int) = {ms_unit_set_requires_gradient_sync, ms_unit_set_cpu_offload,
                                                           ms_unit_set_packed};
static const char *const unit_flag_names[] = {"UNIT_SYNC", "UNIT_CPU_OFFLOAD", "UNIT_PACKED"};
enum { N_FLAGS = sizeof unit_flags / sizeof unit_flags[0] };
static ms_status (*const unit_numbers[])(ms_unit *, double) = {ms_unit_set_gradient_divide_factor, ms_unit_scale_grads};
static const char *const unit_number_names[] = {"UNIT_DIVIDE_FACTOR", "UNIT_SCALE_GRADS"};

/* unit_set_flag(u, code, boolean) */
static int l_unit_set_flag(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    lua_Integer code = luaL_checkinteger(L, 2);
    luaL_argcheck(L, code >= 0 && code < N_FLAGS, 2, "not a UNIT_* flag code");
    TRY(L, unit_flags[code](u, lua_toboolean(L, 3)));
    return ms_lua_done(L);
}

/* unit_set_number(u, code, x) */
static int l_unit_set_number(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    lua_Integer code = luaL_checkinteger(L, 2);
    luaL_argcheck(L, code >= 0 && code < 2, 2, "not a UNIT_* number code");
    TRY(L, unit_numbers[code](u, luaL_checknumber(L, 3)));
    return ms_lua_done(L);
}

/* unit_set_param_policy(u, i, param_dtype, reduce_dtype): dtypes as codes, -1 unset */
static int l_unit_set_param_policy(lua_State *L) {
    TRY(L, ms_unit_set_param_policy(check_unit(L, 1), int_arg(L, 2), int_arg(L, 3), int_arg(L, 4)));
    return ms_lua_done(L);
}

/* unit_param_dtypes(u, i) -> stored, gather, reduce (dtype codes), requires_grad */
static int l_unit_param_dtypes(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    const int i = int_arg(L, 2);
    int nd, rg;
    int64_t shape[MS_MAX_DIMS];
    ms_dtype stored, gather, reduce;
    TRY(L, ms_unit_param_info(u, i, &nd, shape, &stored, &gather, &rg));
    TRY(L, ms_unit_param_reduce_dtype(u, i, &reduce));
    lua_pushinteger(L, stored);
    lua_pushinteger(L, gather);
    lua_pushinteger(L, reduce);
    lua_pushboolean(L, rg);
    return 4;
}

static int l_unit_load_full(lua_State *L) {
    TRY(L, ms_unit_load_full(check_unit(L, 1), int_arg(L, 2), check_tensor(L, 3)));
    return ms_lua_done(L);
}

/* unit_param_offset(u, i) -> offset, rows, dim */
static int l_unit_param_offset(lua_State *L) {
    int dim;
    int64_t offset, rows;
    TRY(L, ms_unit_param_offset(check_unit(L, 1), int_arg(L, 2), &dim, &offset, &rows));
    lua_pushinteger(L, (lua_Integer)offset);
    lua_pushinteger(L, (lua_Integer)rows);
    lua_pushinteger(L, dim);
    return 3;
}

static int l_unit_grad_sq_norm(lua_State *L) {
    double v;
    TRY(L, ms_unit_grad_sq_norm(check_unit(L, 1), &v));
    lua_pushnumber(L, v);
    return 1;
}

/* unit_adamw_step(u, lr, beta1, beta2, eps, weight_decay, step), and zero_adamw_step's */
typedef ms_status (*adamw_fn)(ms_unit *, double, double, double, double, double, int64_t);
static int adamw_call(lua_State *L, adamw_fn fn) {
    ms_unit *u = check_unit(L, 1);
    TRY(L, fn(u, luaL_checknumber(L, 2), luaL_checknumber(L, 3), luaL_checknumber(L, 4), luaL_checknumber(L, 5),
              luaL_checknumber(L, 6), (int64_t)luaL_checkinteger(L, 7)));
    return ms_lua_done(L);
}
static int l_unit_adamw_step(lua_State *L) { return adamw_call(L, ms_unit_adamw_step); }

static int l_unit_set_adamw(lua_State *L) {
    TRY(L, ms_unit_set_adamw(check_unit(L, 1), int_arg(L, 2)));
    return ms_lua_done(L);
}

/* unit_adamw_state(u, i, which) */
static int l_unit_adamw_state(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    return push_lent(L, ms_unit_adamw_state(u, int_arg(L, 2), int_arg(L, 3)));
}

static int l_unit_adamw_skipped(lua_State *L) {
    lua_pushinteger(L, (lua_Integer)ms_unit_adamw_skipped(check_unit(L, 1), int_arg(L, 2)));
    return 1;
}

static int l_unit_set_adamw_skipped(lua_State *L) {
    TRY(L, ms_unit_set_adamw_skipped(check_unit(L, 1), int_arg(L, 2), (int64_t)luaL_checkinteger(L, 3)));
    return ms_lua_done(L);
}

static int l_unit_bytes(lua_State *L) {
    lua_pushinteger(L, (lua_Integer)ms_unit_bytes(check_unit(L, 1), int_arg(L, 2)));
    return 1;
}

static int l_unit_rank_allocated(lua_State *L) {
    lua_pushinteger(L, (lua_Integer)ms_unit_rank_allocated(check_unit(L, 1), int_arg(L, 2)));
    return 1;
}

static int l_unit_record_count(lua_State *L) {
    lua_pushinteger(L, ms_unit_record_count(check_unit(L, 1)));
    return 1;
}

/* unit_record(u, i) -> kind, dtype, group_size, bytes */
static int l_unit_record(lua_State *L) {
    ms_record_kind kind;
    int size;
    ms_dtype dt;
    int64_t bytes;
    TRY(L, ms_unit_record(check_unit(L, 1), int_arg(L, 2), &kind, &dt, &size, &bytes));
    lua_pushinteger(L, kind);
    lua_pushinteger(L, dt);
    lua_pushinteger(L, size);
    lua_pushinteger(L, (lua_Integer)bytes);
    return 4;
}

static int l_unit_clear_records(lua_State *L) {
    ms_unit_clear_records(check_unit(L, 1));
    return 0;
}

/* Sets names[i] = i in the table at idx. */
static void set_codes(lua_State *L, int idx, const char *const *names, int n) {
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, i);
        lua_setfield(L, idx, names[i]);
    }
}

void ms_lua_open_unit(lua_State *L) {
    static const luaL_Reg funcs[] = {
        {"unit_new", l_unit_new}, {"unit_add_param", l_unit_add_param}, {"unit_count", l_unit_count},
        {"unit_name", l_unit_name}, {"unit_fqn", l_unit_fqn}, {"unit_tensor", l_unit_tensor},
        {"unit_action", l_unit_action}, {"unit_set_flag", l_unit_set_flag}, {"unit_set_number", l_unit_set_number},
        {"unit_load_full", l_unit_load_full}, {"unit_param_offset", l_unit_param_offset},
        {"unit_set_param_policy", l_unit_set_param_policy}, {"unit_param_dtypes", l_unit_param_dtypes},
        {"unit_grad_sq_norm", l_unit_grad_sq_norm}, {"unit_adamw_step", l_unit_adamw_step},
        {"unit_set_adamw", l_unit_set_adamw}, {"unit_adamw_state", l_unit_adamw_state},
        {"unit_adamw_skipped", l_unit_adamw_skipped}, {"unit_set_adamw_skipped", l_unit_set_adamw_skipped},
        {"unit_bytes", l_unit_bytes}, {"unit_rank_allocated", l_unit_rank_allocated},
        {"unit_record_count", l_unit_record_count}, {"unit_record", l_unit_record},
        {"unit_clear_records", l_unit_clear_records}, {NULL, NULL}};
    luaL_setfuncs(L, funcs, 0);
    lua_getfield(L, -1, "const");
    int k = lua_gettop(L);
    set_codes(L, k, unit_getter_names, N_GETTERS);
    set_codes(L, k, unit_action_names, N_ACTIONS);
    set_codes(L, k, unit_flag_names, N_FLAGS);
    set_codes(L, k, unit_number_names, 2);
    lua_pop(L, 1);    ms_lua_open_zero(L);
}

/* ---------------------------------------------------------------- Megatron-FSDP buckets */

/* zero_new(name, dp, strategy, dtype, requires_grad, grad_dtype, main_f32) */
static int l_zero_new(lua_State *L) {
    const char *name = luaL_checkstring(L, 1);
    ms_comm *dp = check_group(L, 2);
    ms_unit *u = NULL;
    BOXED(L, CLASS_UNIT,
          ms_unit_zero_new(&u, name, dp, (ms_zero_strategy)int_arg(L, 3), (ms_dtype)int_arg(L, 4), lua_toboolean(L, 5),
                           int_arg(L, 6), lua_toboolean(L, 7)),
          u);
}

/* zero_add_param(u, fqn, shape, offset) */
static int l_zero_add_param(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    int64_t shape[MS_MAX_DIMS];
    int nd = int_list(L, 3, shape);
    TRY(L, ms_unit_zero_add_param(u, luaL_checkstring(L, 2), nd, shape, (int64_t)luaL_checkinteger(L, 4)));
    return ms_lua_done(L);
}

static int l_zero_finalize(lua_State *L) {
    TRY(L, ms_unit_zero_finalize(check_unit(L, 1), (int64_t)luaL_checkinteger(L, 2)));
    return ms_lua_done(L);
}

/* zero_tensor(u, i, which) */
static int l_zero_tensor(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    return push_lent(L, ms_unit_zero_tensor(u, int_arg(L, 2), (ms_zero_view)int_arg(L, 3)));
}

/* zero_piece(u, i) -> start, stop */
static int l_zero_piece(lua_State *L) {
    int64_t a, b;
    TRY(L, ms_unit_zero_piece(check_unit(L, 1), int_arg(L, 2), &a, &b));
    lua_pushinteger(L, (lua_Integer)a);
    lua_pushinteger(L, (lua_Integer)b);
    return 2;
}

static int l_zero_load_full(lua_State *L) {
    TRY(L, ms_unit_zero_load_full(check_unit(L, 1), int_arg(L, 2), check_tensor(L, 3)));
    return ms_lua_done(L);
}

/* zero_action(u, code): 0 unshard, 1 reshard, 2 reduce_grads, 3 clear_grads, 4 make_state */
static ms_status (*const zero_actions[])(ms_unit *) = {ms_unit_zero_unshard, ms_unit_zero_reshard,
                                                       ms_unit_zero_reduce_grads, ms_unit_zero_clear_grads,
                                                       ms_unit_zero_make_state};
static int l_zero_action(lua_State *L) {
    ms_unit *u = check_unit(L, 1);
    lua_Integer code = luaL_checkinteger(L, 2);
    luaL_argcheck(L, code >= 0 && code < 5, 2, "not a zero action code");
    TRY(L, zero_actions[code](u));
    return ms_lua_done(L);
}

static int l_zero_adamw_step(lua_State *L) { return adamw_call(L, ms_unit_zero_adamw_step); }

static int l_unit_is_zero(lua_State *L) {
    lua_pushboolean(L, ms_unit_is_zero(check_unit(L, 1)));
    return 1;
}

static void ms_lua_open_zero(lua_State *L) {
    static const luaL_Reg funcs[] = {
        {"zero_new", l_zero_new}, {"zero_add_param", l_zero_add_param}, {"zero_finalize", l_zero_finalize},
        {"zero_tensor", l_zero_tensor}, {"zero_piece", l_zero_piece}, {"zero_load_full", l_zero_load_full},
        {"zero_action", l_zero_action}, {"zero_adamw_step", l_zero_adamw_step}, {"unit_is_zero", l_unit_is_zero},
        {NULL, NULL}};
    luaL_setfuncs(L, funcs, 0);
}
