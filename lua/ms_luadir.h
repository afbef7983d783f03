/*
 * ms_luadir.h: where moonshard's Lua files are, for the executables and hosts of either
 * interpreter (Lua 5.4 and LuaJIT); no Lua header needed.
 */
#ifndef MS_LUADIR_H
#define MS_LUADIR_H

/* Where moonshard/init.lua lives: $MOONSHARD_LUA_DIR, the install tree next to the running
 * library or executable, the configured install prefix, else the source tree. */
const char *ms_lua_dir(void);
/* Where moonshard/cdef.lua (generated at build time) lives: ms_lua_dir() when it holds it
 * (an install), else the build tree this code was built in. */
const char *ms_lua_gen_dir(void);

#endif
