/*
 * ms_luajit.c: a rank's LuaJIT state, for moonshard-jit (ms_main.c built with
 * MOONSHARD_LUAJIT): the LuaJIT counterpart of ms_lua_setup in ms_lua.c, compiled against
 * LuaJIT's headers and never linked with the Lua 5.4 binding.
 *
 * There is no C binding here: under LuaJIT, moonshard/raw.lua selects the FFI binding
 * (moonshard/core_ffi.lua), which reaches the ms_* functions of this process through ffi.C
 * with the declarations generated at build time (moonshard/cdef.lua), and finds the rank's
 * world as a light userdata at registry["moonshard.world"].
 */
#include "ms_lua.h"

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include <string.h>

void ms_lua_setup(lua_State *L, ms_comm *world) {
    luaL_openlibs(L);
    const char *dir = ms_lua_dir(), *gen = ms_lua_gen_dir();
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "path");
    if (strcmp(gen, dir) == 0)
        lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", dir, dir, lua_tostring(L, -1));
    else /* the build tree: the sources, then the generated files */
        lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s/?.lua;%s", dir, dir, gen, lua_tostring(L, -1));
    lua_setfield(L, -3, "path");
    lua_pop(L, 2);
    lua_pushlightuserdata(L, world);
    lua_setfield(L, LUA_REGISTRYINDEX, "moonshard.world");
    ms_lua_register_memory_cap(L);
}
