/*
 * ms_embed.c: the embedding API (moonshard_embed.h).  Each call pushes its arguments,
 * calls the matching function of the Lua module moonshard.embed under lua_pcall, and turns
 * a Lua error into a status and ms_last_error(): nothing longjmps into the host.
 */
#include "moonshard_embed.h"
#include "ms_internal.h"
#include "ms_lua.h"

#include <lauxlib.h>
#include <lua.h>

#include <stdlib.h>
#include <string.h>

struct ms_interp {
    lua_State *L;
    ms_comm *world; /* retained */
};

/* "moonshard shape error: ..." -> MS_ERR_SHAPE; any other Lua error is an invalid argument
 * (a bad model, mesh or policy). */
static ms_status status_of(const char *msg) {
    static const ms_status all[] = {MS_ERR_ARG, MS_ERR_OOM, MS_ERR_OVERFLOW, MS_ERR_SHAPE, MS_ERR_DTYPE,
                                    MS_ERR_DEVICE, MS_ERR_MISMATCH, MS_ERR_TIMEOUT, MS_ERR_PEER,
                                    MS_ERR_NOT_BUILT, MS_ERR_STATE, MS_ERR_IO, MS_ERR_INTERNAL};
    for (size_t i = 0; msg && i < sizeof all / sizeof all[0]; i++) {
        char head[64];
        snprintf(head, sizeof head, "moonshard %s error:", ms_status_name(all[i]));
        if (strstr(msg, head)) return all[i];
    }
    return MS_ERR_ARG;
}

/* Calls moonshard.embed[fn] with the nargs values on top of the stack; leaves nres results. */
static ms_status call(ms_interp *in, const char *fn, int nargs, int nres) {
    lua_State *L = in->L;
    int base = lua_gettop(L) - nargs;
    lua_getglobal(L, "require");
    lua_pushliteral(L, "moonshard.embed");
    int st = lua_pcall(L, 1, 1, 0);
    if (st == LUA_OK) {
        lua_getfield(L, -1, fn);
        lua_remove(L, -2);
        lua_insert(L, base + 1);
        st = lua_pcall(L, nargs, nres, 0);
    } else {
        lua_insert(L, base + 1);
        lua_settop(L, base + 1);
    }
    if (st != LUA_OK) {
        const char *msg = lua_tostring(L, -1);
        ms_status s = status_of(msg);
        ms__fail(s, "%s", msg ? msg : "(error object is not a string)");
        lua_settop(L, base);
        return s;
    }
    return ms__ok();
}

ms_status ms_interp_new(ms_interp **out, ms_comm *world) {
    if (!out || !world) return ms__fail(MS_ERR_ARG, "interp_new: NULL argument");
    ms_interp *in = calloc(1, sizeof *in);
    if (!in || !(in->L = luaL_newstate())) {
        free(in);
        return ms__fail(MS_ERR_OOM, "interp_new: cannot create a Lua state");
    }
    ms_comm_retain(world);
    in->world = world;
    ms_lua_setup(in->L, world);
    *out = in;
    return ms__ok();
}

void ms_interp_free(ms_interp *in) {
    if (!in) return;
    lua_close(in->L); /* releases the units and tensors the state holds */
    ms_comm_release(in->world);
    free(in);
}

ms_status ms_interp_exec(ms_interp *in, const char *code) {
    if (!in || !code) return ms__fail(MS_ERR_ARG, "interp_exec: NULL argument");
    if (luaL_loadbufferx(in->L, code, strlen(code), "=(host)", "t") != LUA_OK ||
        lua_pcall(in->L, 0, 0, 0) != LUA_OK) {
        const char *msg = lua_tostring(in->L, -1);
        ms_status s = status_of(msg);
        ms__fail(s, "%s", msg ? msg : "(error object is not a string)");
        lua_pop(in->L, 1);
        return s;
    }
    return ms__ok();
}

ms_status ms_interp_model_param(ms_interp *in, const char *fqn, int ndim, const int64_t *shape,
                                ms_dtype dtype, int requires_grad) {
    if (!in || !fqn || (ndim > 0 && !shape)) return ms__fail(MS_ERR_ARG, "interp_model_param: NULL argument");
    if (!ms_dtype_name(dtype)) return ms__fail(MS_ERR_DTYPE, "interp_model_param: %s: invalid dtype %d", fqn, (int)dtype);
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return ms__fail(MS_ERR_SHAPE, "interp_model_param: %s: %d dims (0 to %d)", fqn, ndim, MS_MAX_DIMS);
    lua_State *L = in->L;
    lua_pushstring(L, fqn);
    lua_createtable(L, ndim, 0);
    for (int i = 0; i < ndim; i++) {
        lua_pushinteger(L, (lua_Integer)shape[i]);
        lua_rawseti(L, -2, i + 1);
    }
    lua_pushstring(L, ms_dtype_name(dtype));
    lua_pushboolean(L, requires_grad);
    return call(in, "add_param", 4, 0);
}

ms_status ms_interp_model_module_type(ms_interp *in, const char *name, const char *type_name) {
    if (!in || !name || !type_name) return ms__fail(MS_ERR_ARG, "interp_model_module_type: NULL argument");
    lua_pushstring(in->L, name);
    lua_pushstring(in->L, type_name);
    return call(in, "set_module_type", 2, 0);
}

ms_status ms_interp_model_config(ms_interp *in, const char *config_path) {
    if (!in || !config_path) return ms__fail(MS_ERR_ARG, "interp_model_config: NULL argument");
    lua_pushstring(in->L, config_path);
    return call(in, "use_config", 1, 0);
}

ms_status ms_interp_plan(ms_interp *in, const char *mesh, const char *policy, int *units) {
    if (!in || !mesh || !policy) return ms__fail(MS_ERR_ARG, "interp_plan: NULL argument");
    lua_pushstring(in->L, mesh);
    lua_pushstring(in->L, policy);
    ms_status st = call(in, "plan", 2, 1);
    if (st) return st;
    if (units) *units = (int)lua_tointeger(in->L, -1);
    lua_pop(in->L, 1);
    return MS_OK;
}

ms_status ms_interp_plan_json(ms_interp *in, char **json) {
    if (!in || !json) return ms__fail(MS_ERR_ARG, "interp_plan_json: NULL argument");
    ms_status st = call(in, "plan_json", 0, 1);
    if (st) return st;
    *json = strdup(lua_tostring(in->L, -1));
    lua_pop(in->L, 1);
    return *json ? MS_OK : ms__fail(MS_ERR_OOM, "interp_plan_json: out of memory");
}

ms_status ms_interp_prefetch(ms_interp *in, int *forward, int *backward) {
    if (!in || !forward || !backward) return ms__fail(MS_ERR_ARG, "interp_prefetch: NULL argument");
    ms_status st = call(in, "prefetch", 0, 2);
    if (st) return st;
    *forward = (int)lua_tointeger(in->L, -2);
    *backward = (int)lua_tointeger(in->L, -1);
    lua_pop(in->L, 2);
    return MS_OK;
}

ms_status ms_interp_materialize(ms_interp *in) {
    if (!in) return ms__fail(MS_ERR_ARG, "interp_materialize: NULL interpreter");
    ms_status st = call(in, "materialize", 0, 1);
    if (!st) lua_pop(in->L, 1);
    return st;
}

int ms_interp_unit_count(ms_interp *in) {
    if (!in || call(in, "materialize_count", 0, 1)) return 0;
    int n = (int)lua_tointeger(in->L, -1);
    lua_pop(in->L, 1);
    return n;
}

ms_unit *ms_interp_unit(ms_interp *in, int i) {
    if (!in) return NULL;
    lua_pushinteger(in->L, i);
    if (call(in, "unit", 1, 1)) return NULL;
    /* The unit stays referenced by moonshard.embed's state, so the pointer outlives the pop. */
    ms_unit *u = ms_lua_to_unit(in->L, -1);
    lua_pop(in->L, 1);
    return u;
}

ms_status ms_interp_find_param(ms_interp *in, const char *fqn, int *unit, int *index) {
    if (!in || !fqn || !unit || !index) return ms__fail(MS_ERR_ARG, "interp_find_param: NULL argument");
    lua_pushstring(in->L, fqn);
    ms_status st = call(in, "find", 1, 2);
    if (st) return st;
    *unit = (int)lua_tointeger(in->L, -2);
    *index = (int)lua_tointeger(in->L, -1);
    lua_pop(in->L, 2);
    return MS_OK;
}
