/*
 * ms_embed.c: the embedding API (moonshard_embed.h).  Every step that touches the Lua
 * state runs inside lua_pcall: a call pushes one C function and a pointer to its arguments
 * (neither allocates, so neither can raise) and that function does the rest protected:
 * it pushes the arguments, calls the matching function of the Lua module moonshard.embed
 * and reads the results.  A Lua error, out of memory included, becomes a status and
 * ms_last_error(): nothing longjmps into the host, and the Lua panic handler is never
 * reached.
 *
 * The module moonshard.embed is loaded once, by ms_interp_new, and kept in the registry,
 * so what a host's ms_interp_exec does to package.loaded cannot change it.  The units of
 * ms_interp_materialize are retained here, in C, until ms_interp_free: the pointers of
 * ms_interp_unit stay valid whatever the Lua state does with its own references.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr */
#endif
#include "moonshard_embed.h"
#include "ms_lua.h"

#include <lauxlib.h>
#include <lua.h>

#include <dlfcn.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Failures are reported through the core's per-thread message (ms_set_error and
 * ms_last_error of moonshard.h), as the core reports its own: this file uses the public API
 * and nothing internal to the core. */
#if defined(__GNUC__)
#define EMB_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define EMB_PRINTF(a, b)
#endif

static ms_status emb_fail(ms_status st, const char *fmt, ...) EMB_PRINTF(2, 3);
static ms_status emb_fail(ms_status st, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ms_set_error(st, msg);
}

static ms_status emb_ok(void) { return ms_set_error(MS_OK, NULL); }

/* Prepends "<fmt ...>: " to this thread's message; keeps st. */
static ms_status emb_wrap(ms_status st, const char *fmt, ...) EMB_PRINTF(2, 3);
static ms_status emb_wrap(ms_status st, const char *fmt, ...) {
    char old[1024], msg[1024];
    snprintf(old, sizeof old, "%s", ms_last_error());
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t len = strlen(msg), room = sizeof msg - 1 - len, n = strlen(old);
    if (room >= 2) {
        memcpy(msg + len, ": ", 2);
        len += 2;
        room -= 2;
        if (n > room) n = room;
        memcpy(msg + len, old, n);
        len += n;
    }
    msg[len] = '\0';
    return ms_set_error(st, msg);
}

/* "<function>: <argument> is NULL", as the core's functions say it (and return `bad`) */
#define EMB_NOT_NULL_OR(p, bad)                                               \
    do {                                                                      \
        if (!(p)) {                                                           \
            emb_fail(MS_ERR_ARG, "%s: %s is NULL", __func__, #p);             \
            return bad;                                                       \
        }                                                                     \
    } while (0)
#define EMB_NOT_NULL(p)                                                          \
    do {                                                                         \
        if (!(p)) return emb_fail(MS_ERR_ARG, "%s: %s is NULL", __func__, #p);    \
    } while (0)

#define EMBED_KEY "moonshard.embed.module" /* registry: the module table of moonshard.embed */

struct ms_interp {
    lua_State *L;
    ms_comm *world; /* retained */
    ms_unit **units; /* retained at materialize, released by ms_interp_free */
    int nunits;
    char **warnings; /* (nwarnings) the last plan's, malloc'd */
    int nwarnings;
};

/* ---------------------------------------------------------------- errors */

/* The status a Lua error message carries: the outermost "moonshard <status> error:" in it
 * (the binding's errors and moonshard.embed's own), MS_ERR_OOM for Lua's out-of-memory
 * message rethrown as a plain error; any other Lua error is an invalid argument (a bad
 * model, mesh or policy). */
static ms_status status_of(const char *msg) {
    static const ms_status all[] = {MS_ERR_ARG, MS_ERR_OOM, MS_ERR_OVERFLOW, MS_ERR_SHAPE, MS_ERR_DTYPE,
                                    MS_ERR_DEVICE, MS_ERR_MISMATCH, MS_ERR_TIMEOUT, MS_ERR_PEER,
                                    MS_ERR_NOT_BUILT, MS_ERR_STATE, MS_ERR_IO, MS_ERR_INTERNAL};
    ms_status best = MS_ERR_ARG;
    const char *first = NULL;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        char head[64];
        snprintf(head, sizeof head, "moonshard %s error:", ms_status_name(all[i]));
        const char *at = strstr(msg, head);
        if (at && (!first || at < first)) {
            first = at;
            best = all[i];
        }
    }
    if (first) return best;
    static const char oom[] = "not enough memory"; /* Lua's message for LUA_ERRMEM */
    size_t n = strlen(msg), k = sizeof oom - 1;
    if (n >= k && strcmp(msg + n - k, oom) == 0) return MS_ERR_OOM;
    return MS_ERR_ARG;
}

/* A non-string error object as text, called protected (a __tostring may raise): its
 * __tostring, a number or boolean as Lua prints it, else "(error object is a T value)". */
static int p_error_text(lua_State *L) {
    if (luaL_getmetafield(L, 1, "__tostring") != LUA_TNIL) {
        lua_pop(L, 1);
        luaL_tolstring(L, 1, NULL);
    } else if (lua_type(L, 1) == LUA_TNUMBER || lua_type(L, 1) == LUA_TBOOLEAN) {
        luaL_tolstring(L, 1, NULL);
    } else {
        lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    return 1;
}

/* The failed protected call's error object (on top, lua_pcall's status lst) as a status and
 * ms_last_error(); leaves the stack at top. */
static ms_status lua_failure(lua_State *L, int lst, int top) {
    ms_status s;
    if (lua_type(L, -1) == LUA_TSTRING) { /* lua_tostring of a string neither allocates nor raises */
        const char *msg = lua_tostring(L, -1);
        s = lst == LUA_ERRMEM ? MS_ERR_OOM : status_of(msg);
        emb_fail(s, "%s", msg);
    } else {
        const char *type = luaL_typename(L, -1); /* static strings */
        lua_pushcfunction(L, p_error_text);
        lua_pushvalue(L, -2);
        int st = lua_pcall(L, 1, 1, 0);
        if (st == LUA_OK && lua_type(L, -1) == LUA_TSTRING) {
            const char *msg = lua_tostring(L, -1);
            s = lst == LUA_ERRMEM ? MS_ERR_OOM : status_of(msg);
            emb_fail(s, "%s", msg);
        } else {
            s = lst == LUA_ERRMEM || st == LUA_ERRMEM ? MS_ERR_OOM : MS_ERR_ARG;
            if (lua_type(L, -1) == LUA_TSTRING)
                emb_fail(s, "(error object is a %s value; its __tostring failed: %s)", type, lua_tostring(L, -1));
            else emb_fail(s, "(error object is a %s value; its __tostring failed)", type);
        }
    }
    lua_settop(L, top);
    return s;
}

/* Runs f protected with the light userdata arg; a Lua error becomes a status. */
static ms_status run(lua_State *L, lua_CFunction f, void *arg) {
    int top = lua_gettop(L);
    lua_pushcfunction(L, f);
    lua_pushlightuserdata(L, arg);
    int st = lua_pcall(L, 1, 0, 0);
    if (st != LUA_OK) return lua_failure(L, st, top);
    lua_settop(L, top);
    return emb_ok();
}

/* ---------------------------------------------------------------- calls into moonshard.embed */

typedef enum {
    C_ADD_PARAM,
    C_MODULE_TYPE,
    C_CONFIG,
    C_PLAN,
    C_PREFETCH,
    C_PLAN_JSON,
    C_FIND,
    C_OPTIMIZER,
    C_OPTION,
    C_LIMITS,
    C_SECONDS,
    C_BATCH,
    C_RECIPE,
    C_PARAM_INFO,
    C_LORA,
    C_RAN,
    C_CKPT_SAVE,
    C_CKPT_LOAD,
    C_CKPT_READ,
    C_LOAD_HF,
    C_TIE
} call_kind;

typedef struct {
    call_kind kind;
    const char *s1, *s2; /* string arguments */
    int ndim;
    const int64_t *shape;
    ms_dtype dtype;
    int requires_grad;
    double d1, d2;       /* number arguments */
    int64_t i1, i2, i3;  /* integer arguments */
    lua_Integer out[2]; /* integer results */
    int64_t *shape_out; /* C_PARAM_INFO's shape (MS_MAX_DIMS) */
    ms_dtype dtype_out;
    double num_out[2]; /* C_LORA's alpha, dropout */
    char *json;          /* C_PLAN_JSON's result, C_CKPT_LOAD's and C_CKPT_READ's extra (NULL: none), malloc'd */
} embed_call;

static const char *const FN[] = {"add_param", "set_module_type", "use_config", "plan", "prefetch",
                                 "plan_json", "find", "set_optimizer", "set_option", "set_policy_limits",
                                 "set_policy_seconds", "set_batch", "set_recipe", "param_info", "lora", "recipe_ran",
                                 "checkpoint_save", "checkpoint_load", "checkpoint_read", "load_hf", "tie"};

/* Pushes moonshard.embed[fn] (protected: raises when it is gone or not a function). */
static void push_fn(lua_State *L, const char *fn) {
    lua_getfield(L, LUA_REGISTRYINDEX, EMBED_KEY);
    if (!lua_istable(L, -1)) luaL_error(L, "moonshard internal error: embed: the module moonshard.embed is not loaded");
    lua_getfield(L, -1, fn);
    if (!lua_isfunction(L, -1))
        luaL_error(L, "moonshard internal error: embed: moonshard.embed.%s is not a function (was it replaced?)", fn);
    lua_remove(L, -2);
}

/* Result i (1-based among nres results at the top) as an integer, or an error naming fn. */
static lua_Integer int_result(lua_State *L, const char *fn, int i, int nres) {
    int isnum = 0;
    lua_Integer v = lua_tointegerx(L, -nres + i - 1, &isnum);
    if (!isnum) luaL_error(L, "moonshard internal error: embed: %s returned %s, not an integer", fn,
                           luaL_typename(L, -nres + i - 1));
    return v;
}

static int p_call(lua_State *L) {
    embed_call *c = lua_touserdata(L, 1);
    const char *fn = FN[c->kind];
    push_fn(L, fn);
    int nargs = 0, nres = 0;
    switch (c->kind) {
    case C_ADD_PARAM:
        lua_pushstring(L, c->s1);
        lua_createtable(L, c->ndim, 0);
        for (int i = 0; i < c->ndim; i++) {
            lua_pushinteger(L, (lua_Integer)c->shape[i]);
            lua_rawseti(L, -2, i + 1);
        }
        lua_pushstring(L, ms_dtype_name(c->dtype));
        lua_pushboolean(L, c->requires_grad);
        nargs = 4;
        break;
    case C_MODULE_TYPE:
    case C_TIE:
    case C_PLAN:
        lua_pushstring(L, c->s1);
        lua_pushstring(L, c->s2);
        nargs = 2;
        nres = c->kind == C_PLAN;
        break;
    case C_CONFIG:
    case C_OPTIMIZER:
    case C_RECIPE:
    case C_OPTION: lua_pushstring(L, c->s1); nargs = 1; break;
    case C_PARAM_INFO: lua_pushstring(L, c->s1); nargs = 1; nres = 4; break;
    case C_LORA: lua_pushstring(L, c->s1); nargs = 1; nres = 5; break;
    case C_RAN: lua_pushstring(L, c->s1); nargs = 1; nres = 1; break;
    case C_LIMITS:
        lua_pushnumber(L, c->d1);
        lua_pushnumber(L, c->d2);
        nargs = 2;
        break;
    case C_SECONDS: lua_pushnumber(L, c->d1); nargs = 1; break;
    case C_BATCH:
        lua_pushinteger(L, (lua_Integer)c->i1);
        lua_pushinteger(L, (lua_Integer)c->i2);
        lua_pushinteger(L, (lua_Integer)c->i3);
        nargs = 3;
        break;
    case C_PREFETCH: nres = 2; break;
    case C_PLAN_JSON: nres = 1; break;
    case C_FIND: lua_pushstring(L, c->s1); nargs = 1; nres = 2; break;
    case C_CKPT_SAVE:
        lua_pushstring(L, c->s1);
        lua_pushinteger(L, (lua_Integer)c->i1);
        if (c->s2) lua_pushstring(L, c->s2);
        else lua_pushnil(L);
        lua_pushinteger(L, (lua_Integer)c->i2);
        nargs = 4;
        break;
    case C_CKPT_LOAD: lua_pushstring(L, c->s1); nargs = 1; nres = 2; break; /* step, extra (its dir dropped) */
    case C_CKPT_READ: lua_pushstring(L, c->s1); nargs = 1; nres = 2; break;
    case C_LOAD_HF: lua_pushstring(L, c->s1); nargs = 1; nres = 1; break;
    }
    lua_call(L, nargs, nres);
    if (c->kind == C_PARAM_INFO) {
        /* ndim, shape, dtype name, requires_grad */
        lua_Integer nd = int_result(L, fn, 1, 4);
        if (nd < 0 || nd > MS_MAX_DIMS) luaL_error(L, "moonshard internal error: embed: param_info: %d dims", (int)nd);
        for (lua_Integer i = 0; i < nd; i++) {
            lua_rawgeti(L, -3, i + 1);
            int isnum = 0;
            lua_Integer v = lua_tointegerx(L, -1, &isnum);
            if (!isnum) luaL_error(L, "moonshard internal error: embed: param_info: a size is not an integer");
            c->shape_out[i] = (int64_t)v;
            lua_pop(L, 1);
        }
        ms_dtype dt;
        if (ms_dtype_parse(lua_tostring(L, -2), &dt) != MS_OK)
            luaL_error(L, "moonshard internal error: embed: param_info: dtype %s", lua_tostring(L, -2));
        c->out[0] = nd;
        c->out[1] = lua_toboolean(L, -1);
        c->dtype_out = dt;
    } else if (c->kind == C_LORA) {
        /* dim, alpha, dropout, dropout_pre, init_uniform */
        c->out[0] = int_result(L, fn, 1, 5);
        c->num_out[0] = lua_tonumber(L, -4);
        c->num_out[1] = lua_tonumber(L, -3);
        c->out[1] = int_result(L, fn, 4, 5) * 2 + int_result(L, fn, 5, 5);
    } else if (c->kind == C_PLAN_JSON) {
        size_t len;
        if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "moonshard internal error: embed: plan_json returned no string");
        const char *s = lua_tolstring(L, -1, &len);
        if (!(c->json = malloc(len + 1))) luaL_error(L, "moonshard out_of_memory error: interp_plan_json: %d bytes", (int)len);
        memcpy(c->json, s, len + 1); /* nothing raises after this */
    } else if (c->kind == C_CKPT_LOAD || c->kind == C_CKPT_READ) {
        /* step, the extra as JSON text or nil */
        c->out[0] = int_result(L, fn, 1, 2);
        if (!lua_isnil(L, -1)) {
            size_t len;
            if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "moonshard internal error: embed: %s: extra is no string", fn);
            const char *s = lua_tolstring(L, -1, &len);
            if (!(c->json = malloc(len + 1))) luaL_error(L, "moonshard out_of_memory error: %s: %d bytes", fn, (int)len);
            memcpy(c->json, s, len + 1); /* nothing raises after this */
        }
    } else {
        for (int i = 0; i < nres; i++) c->out[i] = int_result(L, fn, i + 1, nres);
    }
    return 0;
}

static ms_status call(ms_interp *in, embed_call *c) { return run(in->L, p_call, c); }

/* ---------------------------------------------------------------- the interpreter */

typedef struct {
    ms_comm *world;
} setup_arg;

/* Opens the libraries, links moonshard in and loads moonshard.embed into the registry. */
static int p_setup(lua_State *L) {
    setup_arg *a = lua_touserdata(L, 1);
    ms_lua_setup(L, a->world);
    lua_getglobal(L, "require");
    lua_pushliteral(L, "moonshard.embed");
    lua_call(L, 1, 1);
    if (!lua_istable(L, -1))
        luaL_error(L, "moonshard internal error: embed: require 'moonshard.embed' returned %s, not the module",
                   luaL_typename(L, -1));
    lua_setfield(L, LUA_REGISTRYINDEX, EMBED_KEY);
    return 0;
}

/* The library each of Lua's functions was bound to: a host that also has another Lua (LuaJIT,
 * a 5.1 to 5.3) ahead of Lua 5.4 in the process has the functions both define resolved to
 * its own, and those only Lua 5.4 has to Lua 5.4's; a state of one passed to the other
 * would crash.  Refused instead, naming both. */
static ms_status check_lua_binding(void) {
    static const struct {
        const char *name;
        union {
            lua_State *(*newstate)(lua_Alloc, void *);
            int (*pcallk)(lua_State *, int, int, int, lua_KContext, lua_KFunction);
            void (*settop)(lua_State *, int);
            void *p;
        } f;
    } fns[] = {{"lua_newstate", {.newstate = lua_newstate}},
               {"lua_settop", {.settop = lua_settop}},
               {"lua_pcallk", {.pcallk = lua_pcallk}}};
    Dl_info first;
    if (!dladdr(fns[0].f.p, &first) || !first.dli_fname) return MS_OK; /* no answer: nothing to compare */
    for (size_t i = 1; i < sizeof fns / sizeof fns[0]; i++) {
        Dl_info d;
        if (dladdr(fns[i].f.p, &d) && d.dli_fname && strcmp(d.dli_fname, first.dli_fname))
            return emb_fail(MS_ERR_STATE, "interp_new: this process binds Lua's C functions to two libraries "
                            "(%s from %s, %s from %s): the host has another Lua (LuaJIT?) ahead of the Lua 5.4 "
                            "that moonshard's embedding library runs on.  Load the library with "
                            "dlopen(\"libmoonshard_embed.so.0\", RTLD_NOW | RTLD_DEEPBIND), which binds it to its "
                            "own Lua, or keep the other Lua out of this process", fns[0].name, first.dli_fname,
                            fns[i].name, d.dli_fname);
    }
    return MS_OK;
}

ms_status ms_interp_new(ms_interp **out, ms_comm *world) {
    EMB_NOT_NULL(out);
    EMB_NOT_NULL(world);
    *out = NULL;
    ms_status bound = check_lua_binding();
    if (bound) return bound;
    ms_interp *in = calloc(1, sizeof *in);
    if (!in || !(in->L = ms_lua_newstate())) {
        free(in);
        return emb_fail(MS_ERR_OOM, "interp_new: cannot create a Lua state");
    }
    setup_arg a = {world};
    ms_status st = run(in->L, p_setup, &a);
    if (st) {
        emb_wrap(st, "interp_new");
        ms_lua_close(in->L);
        free(in);
        return st;
    }
    ms_comm_retain(world);
    in->world = world;
    *out = in;
    return emb_ok();
}

static void warnings_free(char **list, int n) {
    for (int i = 0; i < n; i++) free(list[i]);
    free(list);
}

void ms_interp_free(ms_interp *in) {
    if (!in) return;
    ms_lua_close(in->L); /* releases the units and tensors the state holds */
    for (int i = 0; i < in->nunits; i++) ms_unit_release(in->units[i]); /* then the host's */
    free(in->units);
    warnings_free(in->warnings, in->nwarnings);
    ms_comm_release(in->world);
    free(in);
}

ms_status ms_interp_exec(ms_interp *in, const char *code) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(code);
    lua_State *L = in->L;
    int top = lua_gettop(L);
    /* both are protected: they return a status instead of raising */
    int st = luaL_loadbufferx(L, code, strlen(code), "=(host)", "t");
    if (st == LUA_OK) st = lua_pcall(L, 0, 0, 0);
    if (st != LUA_OK) return lua_failure(L, st, top);
    lua_settop(L, top);
    return emb_ok();
}

ms_status ms_interp_model_param(ms_interp *in, const char *fqn, int ndim, const int64_t *shape,
                                ms_dtype dtype, int requires_grad) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(fqn);
    if (ndim > 0) EMB_NOT_NULL(shape);
    if (!ms_dtype_name(dtype)) return emb_fail(MS_ERR_DTYPE, "interp_model_param: %s: invalid dtype %d", fqn, (int)dtype);
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return emb_fail(MS_ERR_SHAPE, "interp_model_param: %s: %d dims (0 to %d)", fqn, ndim, MS_MAX_DIMS);
    int64_t numel = 1, bytes = 0; /* sizes >= 0, elements and bytes within int64 */
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return emb_fail(MS_ERR_SHAPE, "interp_model_param: %s: size of dim %d is %lld; sizes must be >= 0", fqn, i,
                            (long long)shape[i]);
        if (__builtin_mul_overflow(numel, shape[i], &numel)) {
            char dims[256];
            size_t len = (size_t)snprintf(dims, sizeof dims, "[");
            for (int k = 0; k < ndim && len < sizeof dims; k++)
                len += (size_t)snprintf(dims + len, sizeof dims - len, k ? ", %lld" : "%lld", (long long)shape[k]);
            if (len < sizeof dims) snprintf(dims + len, sizeof dims - len, "]");
            return emb_fail(MS_ERR_OVERFLOW, "interp_model_param: %s: shape %s has more than 2^63 elements", fqn, dims);
        }
    }
    if (__builtin_mul_overflow(numel, (int64_t)ms_dtype_size(dtype), &bytes))
        return emb_fail(MS_ERR_OVERFLOW, "interp_model_param: %s: %lld elements of %s are more than 2^63 bytes", fqn,
                        (long long)numel, ms_dtype_name(dtype));
    embed_call c = {.kind = C_ADD_PARAM, .s1 = fqn, .ndim = ndim, .shape = shape, .dtype = dtype,
                    .requires_grad = requires_grad};
    return call(in, &c);
}

ms_status ms_interp_model_module_type(ms_interp *in, const char *name, const char *type_name) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(name);
    EMB_NOT_NULL(type_name);
    embed_call c = {.kind = C_MODULE_TYPE, .s1 = name, .s2 = type_name};
    return call(in, &c);
}

ms_status ms_interp_model_tie(ms_interp *in, const char *fqn, const char *target) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(fqn);
    EMB_NOT_NULL(target);
    embed_call c = {.kind = C_TIE, .s1 = fqn, .s2 = target};
    return call(in, &c);
}

ms_status ms_interp_model_config(ms_interp *in, const char *config_path) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(config_path);
    embed_call c = {.kind = C_CONFIG, .s1 = config_path};
    return call(in, &c);
}

typedef struct {
    char **list;
    int n;
} warning_copy;

/* moonshard.embed.warnings() copied into w (malloc'd; freed by the caller on error too). */
static int p_warnings(lua_State *L) {
    warning_copy *w = lua_touserdata(L, 1);
    push_fn(L, "warnings");
    lua_call(L, 0, 1);
    if (!lua_istable(L, -1)) luaL_error(L, "moonshard internal error: embed: warnings returned no list");
    const lua_Integer n = (lua_Integer)lua_rawlen(L, -1);
    if (n > INT_MAX / (lua_Integer)sizeof(char *)) luaL_error(L, "moonshard internal error: embed: %d warnings", (int)n);
    if (n && !(w->list = calloc((size_t)n, sizeof *w->list)))
        luaL_error(L, "moonshard out_of_memory error: embed: the plan's warnings");
    for (lua_Integer i = 0; i < n; i++) {
        lua_rawgeti(L, -1, i + 1);
        const char *s = lua_tostring(L, -1);
        if (!s) luaL_error(L, "moonshard internal error: embed: warning %d is not a string", (int)i);
        if (!(w->list[i] = strdup(s))) luaL_error(L, "moonshard out_of_memory error: embed: the plan's warnings");
        w->n = (int)i + 1;
        lua_pop(L, 1);
    }
    return 0;
}

ms_status ms_interp_plan(ms_interp *in, const char *mesh, const char *policy, int *units) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(mesh);
    EMB_NOT_NULL(policy);
    embed_call c = {.kind = C_PLAN, .s1 = mesh, .s2 = policy};
    ms_status st = call(in, &c);
    if (st) return st;
    warning_copy w = {NULL, 0};
    st = run(in->L, p_warnings, &w);
    if (st) {
        warnings_free(w.list, w.n);
        return emb_wrap(st, "interp_plan: the plan's warnings");
    }
    warnings_free(in->warnings, in->nwarnings);
    in->warnings = w.list;
    in->nwarnings = w.n;
    if (units) *units = (int)c.out[0];
    return MS_OK;
}

int ms_interp_warning_count(ms_interp *in) {
    EMB_NOT_NULL_OR(in, -1);
    return in->nwarnings;
}

const char *ms_interp_warning(ms_interp *in, int i) {
    EMB_NOT_NULL_OR(in, NULL);
    return i >= 0 && i < in->nwarnings ? in->warnings[i] : NULL;
}

ms_status ms_interp_set_optimizer(ms_interp *in, const char *optimizer) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(optimizer);
    embed_call c = {.kind = C_OPTIMIZER, .s1 = optimizer};
    return call(in, &c);
}

ms_status ms_interp_set_option(ms_interp *in, const char *setting) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(setting);
    embed_call c = {.kind = C_OPTION, .s1 = setting};
    return call(in, &c);
}

ms_status ms_interp_set_policy_limits(ms_interp *in, double instructions, double memory_mb) {
    EMB_NOT_NULL(in);
    embed_call c = {.kind = C_LIMITS, .d1 = instructions, .d2 = memory_mb};
    return call(in, &c);
}

ms_status ms_interp_set_batch(ms_interp *in, int64_t seq_len, int64_t micro_batch, int64_t global_batch) {
    EMB_NOT_NULL(in);
    embed_call c = {.kind = C_BATCH, .i1 = seq_len, .i2 = micro_batch, .i3 = global_batch};
    return call(in, &c);
}

ms_status ms_interp_set_policy_seconds(ms_interp *in, double seconds) {
    EMB_NOT_NULL(in);
    embed_call c = {.kind = C_SECONDS, .d1 = seconds};
    return call(in, &c);
}

ms_status ms_interp_plan_json(ms_interp *in, char **json) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(json);
    embed_call c = {.kind = C_PLAN_JSON};
    ms_status st = call(in, &c);
    if (!st) *json = c.json;
    return st;
}

ms_status ms_interp_prefetch(ms_interp *in, int *forward, int *backward) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(forward);
    EMB_NOT_NULL(backward);
    embed_call c = {.kind = C_PREFETCH};
    ms_status st = call(in, &c);
    if (st) return st;
    *forward = (int)c.out[0];
    *backward = (int)c.out[1];
    return MS_OK;
}

/* moonshard.embed.materialize(), then every unit, retained for the host. */
static int p_materialize(lua_State *L) {
    ms_interp *in = lua_touserdata(L, 1);
    push_fn(L, "materialize");
    lua_call(L, 0, 1);
    lua_Integer n = int_result(L, "materialize", 1, 1);
    if (n < 0 || n > INT_MAX / (lua_Integer)sizeof(ms_unit *))
        luaL_error(L, "moonshard internal error: embed: materialize returned %d units", (int)n);
    /* collected in a Lua userdata first, so that an error half-way leaks nothing */
    ms_unit **tmp = lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof *tmp, 0);
    for (lua_Integer i = 0; i < n; i++) {
        push_fn(L, "unit");
        lua_pushinteger(L, i);
        lua_call(L, 1, 1);
        if (!(tmp[i] = ms_lua_to_unit(L, -1)))
            luaL_error(L, "moonshard internal error: embed: unit %d is not a unit", (int)i);
        lua_pop(L, 1);
    }
    ms_unit **units = malloc((size_t)(n ? n : 1) * sizeof *units);
    if (!units) luaL_error(L, "moonshard out_of_memory error: interp_materialize: the table of %d units", (int)n);
    for (lua_Integer i = 0; i < n; i++) { /* nothing raises from here on */
        units[i] = tmp[i];
        ms_unit_retain(units[i]);
    }
    in->units = units;
    in->nunits = (int)n;
    return 0;
}

ms_status ms_interp_materialize(ms_interp *in) {
    EMB_NOT_NULL(in);
    return run(in->L, p_materialize, in);
}

int ms_interp_unit_count(ms_interp *in) {
    EMB_NOT_NULL_OR(in, -1);
    return in->nunits;
}

ms_unit *ms_interp_unit(ms_interp *in, int i) {
    EMB_NOT_NULL_OR(in, NULL);
    if (!in->units) {
        emb_fail(MS_ERR_STATE, "interp_unit: no units yet: materialise the plan first");
        return NULL;
    }
    if (i < 0 || i >= in->nunits) {
        emb_fail(MS_ERR_ARG, "interp_unit: no unit %d (there are %d, numbered from 0)", i, in->nunits);
        return NULL;
    }
    return in->units[i];
}

ms_status ms_interp_set_recipe(ms_interp *in, const char *path) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(path);
    embed_call c = {.kind = C_RECIPE, .s1 = path};
    return call(in, &c);
}

ms_status ms_interp_param_info(ms_interp *in, const char *fqn, int *ndim, int64_t *shape, ms_dtype *dtype,
                               int *requires_grad) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(fqn);
    EMB_NOT_NULL(ndim);
    EMB_NOT_NULL(shape);
    int64_t tmp[MS_MAX_DIMS];
    embed_call c = {.kind = C_PARAM_INFO, .s1 = fqn, .shape_out = tmp};
    ms_status st = call(in, &c);
    if (st) return st;
    *ndim = (int)c.out[0];
    for (int i = 0; i < *ndim; i++) shape[i] = tmp[i];
    if (dtype) *dtype = c.dtype_out;
    if (requires_grad) *requires_grad = (int)c.out[1];
    return MS_OK;
}

ms_status ms_interp_lora(ms_interp *in, const char *module, ms_lora *out) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(module);
    EMB_NOT_NULL(out);
    embed_call c = {.kind = C_LORA, .s1 = module};
    ms_status st = call(in, &c);
    if (st) return st;
    out->dim = (int)c.out[0];
    out->alpha = c.num_out[0];
    out->dropout = c.num_out[1];
    out->dropout_pre = (int)(c.out[1] / 2);
    out->init_uniform = (int)(c.out[1] % 2);
    return MS_OK;
}

ms_status ms_interp_recipe_ran(ms_interp *in, const char *step, int *ran) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(step);
    EMB_NOT_NULL(ran);
    embed_call c = {.kind = C_RAN, .s1 = step};
    ms_status st = call(in, &c);
    if (st) return st;
    *ran = (int)c.out[0];
    return MS_OK;
}

ms_status ms_interp_find_param(ms_interp *in, const char *fqn, int *unit, int *index) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(fqn);
    EMB_NOT_NULL(unit);
    EMB_NOT_NULL(index);
    embed_call c = {.kind = C_FIND, .s1 = fqn};
    ms_status st = call(in, &c);
    if (st) return st;
    *unit = (int)c.out[0];
    *index = (int)c.out[1];
    return MS_OK;
}

/* ---------------------------------------------------------------- checkpoints */

ms_status ms_interp_checkpoint_save(ms_interp *in, const char *dir, int64_t step, const char *extra_json, int keep_last) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(dir);
    if (step < 0) return emb_fail(MS_ERR_ARG, "interp_checkpoint_save: step %lld: expected an integer >= 0", (long long)step);
    embed_call c = {.kind = C_CKPT_SAVE, .s1 = dir, .s2 = extra_json, .i1 = step, .i2 = keep_last};
    return call(in, &c);
}

/* A checkpoint's step and extra (C_CKPT_LOAD or C_CKPT_READ) into the host's pointers. */
static ms_status checkpoint_step(ms_interp *in, call_kind kind, const char *path, int64_t *step, char **extra_json) {
    embed_call c = {.kind = kind, .s1 = path};
    ms_status st = call(in, &c);
    if (st) {
        free(c.json);
        return st;
    }
    if (step) *step = (int64_t)c.out[0];
    if (extra_json) *extra_json = c.json;
    else free(c.json);
    return MS_OK;
}

ms_status ms_interp_checkpoint_load(ms_interp *in, const char *path, int64_t *step, char **extra_json) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(path);
    return checkpoint_step(in, C_CKPT_LOAD, path, step, extra_json);
}

ms_status ms_interp_checkpoint_read(ms_interp *in, const char *path, int64_t *step, char **extra_json) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(path);
    return checkpoint_step(in, C_CKPT_READ, path, step, extra_json);
}

ms_status ms_ckpt_load_hf(ms_interp *in, const char *path) {
    EMB_NOT_NULL(in);
    EMB_NOT_NULL(path);
    embed_call c = {.kind = C_LOAD_HF, .s1 = path};
    return call(in, &c);
}
