/*
 * ms_lua.h: what the moonshard executable and embedding hosts use of the Lua binding.
 */
#ifndef MS_LUA_H
#define MS_LUA_H

#include "moonshard.h"

#include <lua.h>

/* Opens the "moonshard.core" module (the Lua 5.4 binding). */
int luaopen_moonshard_core(lua_State *L);
/* Makes `world` (not retained: it must outlive L) this Lua state's rank and world. */
void ms_lua_set_world(lua_State *L, ms_comm *world);

#endif
