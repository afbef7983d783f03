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
/* The unit a Lua value at idx holds (borrowed), or NULL when it is not a unit. */
ms_unit *ms_lua_to_unit(lua_State *L, int idx);

#endif
