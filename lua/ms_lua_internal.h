/*
 * ms_lua_internal.h: what the files of the Lua 5.4 binding share (ms_lua.c and the classes'
 * ms_lua_tensor.c, ms_lua_mesh.c, ms_lua_unit.c).  Hidden: none of it leaves the library or
 * executable the binding is linked into.  Hosts use ms_lua.h.
 *
 * The binding is raw (lua/moonshard/raw.lua lists its functions): arguments arrive checked
 * by the Lua API (moonshard.args), a failed core call returns nil and the message, and the
 * few checks here only keep a direct caller of moonshard.core from crashing.
 */
#ifndef MS_LUA_INTERNAL_H
#define MS_LUA_INTERNAL_H

#include "moonshard.h"
#include "ms_lua.h"

#include <lauxlib.h>
#include <lua.h>

#include <stdint.h>

#if defined(__GNUC__)
#define MS_LUA_HIDDEN __attribute__((visibility("hidden")))
#else
#define MS_LUA_HIDDEN
#endif

/* The classes' metatables in the registry, in the order of ms_lua_class. */
typedef enum { CLASS_TENSOR, CLASS_MESH, CLASS_GROUP, CLASS_UNIT, CLASS_COUNT } ms_lua_class;
MS_LUA_HIDDEN extern const char *const ms_lua_class_mt[CLASS_COUNT];   /* "moonshard.Tensor", ... */
MS_LUA_HIDDEN extern const char *const ms_lua_class_word[CLASS_COUNT]; /* "tensor", ... */

/* ---------------------------------------------------------------- results (ms_lua.c) */

/* A failed core call: pushes nil and "moonshard <status> error: <message>"; returns 2. */
MS_LUA_HIDDEN int ms_lua_failed(lua_State *L, ms_status st);

/* Returns the failure from the raw function when the core call fails. */
#define TRY(L, call)                                  \
    do {                                              \
        ms_status st_ = (call);                       \
        if (st_ != MS_OK) return ms_lua_failed(L, st_); \
    } while (0)

/* Pushes true: the result of a raw function that only acts. */
MS_LUA_HIDDEN int ms_lua_done(lua_State *L);

/* ---------------------------------------------------------------- boxes (ms_lua.c) */

typedef struct { void *h; } box;

/* A new box of class c, closed until its handle is set, on the stack. */
MS_LUA_HIDDEN box *box_new(lua_State *L, ms_lua_class c);
/* The live handle of the box of class c at idx (a plain error otherwise). */
MS_LUA_HIDDEN void *box_get(lua_State *L, int idx, ms_lua_class c);
/* Pushes a box of class c around h (a new reference the box owns), or fails on st. */
#define BOXED(L, c, call, out)                     \
    do {                                           \
        box *b_ = box_new(L, c);                   \
        TRY(L, call);                              \
        b_->h = (out);                             \
        return 1;                                  \
    } while (0)

#define check_tensor(L, i) ((ms_tensor *)box_get(L, i, CLASS_TENSOR))
#define check_mesh(L, i) ((ms_mesh *)box_get(L, i, CLASS_MESH))
#define check_group(L, i) ((ms_comm *)box_get(L, i, CLASS_GROUP))
#define check_unit(L, i) ((ms_unit *)box_get(L, i, CLASS_UNIT))

/* ---------------------------------------------------------------- values (ms_lua.c) */

/* A Lua sequence of integers (a shape, a list of sizes, at most MS_MAX_DIMS); its length. */
MS_LUA_HIDDEN int int_list(lua_State *L, int idx, int64_t *out);
MS_LUA_HIDDEN void push_int_list(lua_State *L, const int64_t *v, int n);
/* An integer argument the core takes as a C int (checked to fit by the Lua API). */
#define int_arg(L, i) ((int)luaL_checkinteger(L, i))

/* ---------------------------------------------------------------- the classes' functions */

/* Each class file adds its functions to the module table on the top of the stack. */
MS_LUA_HIDDEN void ms_lua_open_tensor(lua_State *L); /* ms_lua_tensor.c */
MS_LUA_HIDDEN void ms_lua_open_mesh(lua_State *L);   /* ms_lua_mesh.c: world, meshes, groups, layouts */
MS_LUA_HIDDEN void ms_lua_open_unit(lua_State *L);   /* ms_lua_unit.c */
MS_LUA_HIDDEN void ms_lua_open_quant(lua_State *L);  /* ms_lua_quant.c */
MS_LUA_HIDDEN void ms_lua_open_ckpt(lua_State *L);   /* ms_lua_ckpt.c */

#endif
