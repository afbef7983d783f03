/*
 * ms_alloc.c: the counting allocator of the Lua states moonshard makes (ranks of the
 * moonshard and moonshard-jit executables, embedding hosts), and the two functions through
 * which the policy sandbox sets its hard memory cap (lua/moonshard/policy_budget.lua).  Compiled
 * against Lua 5.4 for the binding and against LuaJIT for moonshard-jit: both take a host's
 * allocator (LuaJIT's GC64 build as Debian ships it does), so a policy's allocations are
 * refused past its cap under either interpreter, where a count hook alone lets one
 * instruction build a string of any length.
 */
#include "ms_lua.h"

#include <lauxlib.h>
#include <lua.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* The counting allocator: the bytes Lua holds, and a limit (0: none) past which it refuses
 * to grow a block.  `refused` says the limit refused one since it was last set. */
typedef struct {
    size_t used, limit;
    bool refused;
} counted;

static void *counting_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
    counted *c = ud;
    size_t old = ptr ? osize : 0; /* with no block, osize is the kind of object */
    if (nsize == 0) {
        free(ptr);
        c->used -= old;
        return NULL;
    }
    if (c->limit && nsize > old && (c->used >= c->limit || nsize - old > c->limit - c->used)) {
        c->refused = true; /* Lua collects in emergency and asks again before it raises */
        return NULL;
    }
    void *p = realloc(ptr, nsize);
    if (!p) return NULL;
    c->used = c->used - old + nsize;
    return p;
}

static int panic(lua_State *L) { /* luaL_newstate's */
    const char *msg = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "error object is not a string";
    fprintf(stderr, "PANIC: unprotected error in call to Lua API (%s)\n", msg);
    fflush(stderr);
    return 0;
}

lua_State *ms_lua_newstate(void) {
    counted *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    lua_State *L = lua_newstate(counting_alloc, c);
    if (!L) {
        free(c);
        return NULL;
    }
    lua_atpanic(L, panic);
    return L;
}

void ms_lua_close(lua_State *L) {
    if (!L) return;
    void *ud = NULL;
    bool ours = lua_getallocf(L, &ud) == counting_alloc;
    lua_close(L);
    if (ours) free(ud);
}

/* The state's counting allocator, NULL when it uses another. */
static counted *counter(lua_State *L) {
    void *ud = NULL;
    return lua_getallocf(L, &ud) == counting_alloc ? ud : NULL;
}

/* memory_cap(bytes): Lua may hold `bytes` more than it does now, and no more;
 * memory_cap(nil) lifts the limit.  False (nothing set) when this state does not use
 * the counting allocator (a stock lua5.4 or luajit). */
int ms_lua_memory_cap(lua_State *L) {
    counted *c = counter(L);
    double bytes = lua_isnoneornil(L, 1) ? 0 : luaL_checknumber(L, 1);
    luaL_argcheck(L, lua_isnoneornil(L, 1) || bytes >= 0, 1, "bytes must be a non-negative number or nil");
    if (c) {
        if (lua_isnoneornil(L, 1)) {
            c->limit = 0;
        } else {
            double left = (double)(SIZE_MAX - c->used);
            c->limit = bytes >= left ? SIZE_MAX : c->used + (size_t)bytes;
            if (c->limit == 0) c->limit = 1; /* 0 is no limit */
        }
        c->refused = false;
    }
    lua_pushboolean(L, c != NULL);
    return 1;
}

/* memory_refused(): whether the limit memory_cap set refused an allocation since. */
int ms_lua_memory_refused(lua_State *L) {
    counted *c = counter(L);
    lua_pushboolean(L, c && c->refused);
    return 1;
}

/* Puts memory_cap and memory_refused in the registry ("moonshard.memory_cap",
 * "moonshard.memory_refused"), where the policy sandbox finds them under either interpreter. */
void ms_lua_register_memory_cap(lua_State *L) {
    lua_pushcfunction(L, ms_lua_memory_cap);
    lua_setfield(L, LUA_REGISTRYINDEX, "moonshard.memory_cap");
    lua_pushcfunction(L, ms_lua_memory_refused);
    lua_setfield(L, LUA_REGISTRYINDEX, "moonshard.memory_refused");
}
