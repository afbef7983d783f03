/*
 * ms_lua.h: what the moonshard executable and embedding hosts use of the Lua binding.
 */
#ifndef MS_LUA_H
#define MS_LUA_H

#include "moonshard.h"
#include "ms_luadir.h" /* ms_lua_dir */

#include <lua.h>

/* Opens the "moonshard.core" module (the Lua 5.4 binding). */
int luaopen_moonshard_core(lua_State *L);
/* Makes `world` (not retained: it must outlive L) this Lua state's rank and world. */
void ms_lua_set_world(lua_State *L, ms_comm *world);
/* Opens the standard libraries, puts moonshard's Lua files first on package.path, links
 * moonshard.core in and sets the world: a Lua state ready for a rank's script. */
void ms_lua_setup(lua_State *L, ms_comm *world);
/* ms_alloc.c, for Lua 5.4 and LuaJIT alike: a new state on a counting allocator whose
 * limit memory_cap sets (the policy sandbox's hard memory cap), with luaL_newstate's panic
 * function; NULL when out of memory.  Close it with ms_lua_close. */
lua_State *ms_lua_newstate(void);
/* Closes a state from ms_lua_newstate (or any other: then as lua_close). */
void ms_lua_close(lua_State *L);
/* memory_cap(bytes | nil) -> whether the state counts (Lua may hold `bytes` more than now);
 * memory_refused() -> whether the cap refused an allocation since it was set. */
int ms_lua_memory_cap(lua_State *L);
int ms_lua_memory_refused(lua_State *L);
/* Puts both in the registry as "moonshard.memory_cap" and "moonshard.memory_refused". */
void ms_lua_register_memory_cap(lua_State *L);
/* The unit a Lua value at idx holds (borrowed), or NULL when it is not a unit. */
ms_unit *ms_lua_to_unit(lua_State *L, int idx);

#endif
