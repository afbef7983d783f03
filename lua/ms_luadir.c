/*
 * ms_luadir.c: finding moonshard's Lua files (ms_luadir.h).  Compiled into each binary
 * that needs it, so "next to the library" means the binary this code is in.
 */
#include "ms_luadir.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static bool dir_has(const char *dir, const char *file) {
    char path[PATH_MAX + 32];
    if (snprintf(path, sizeof path, "%s/%s", dir, file) >= (int)sizeof path) return false;
    return access(path, R_OK) == 0;
}

static bool is_dir_with_init(const char *dir) { return dir_has(dir, "moonshard/init.lua"); }

/* dir/../share/lua/5.4 or dir/../../share/lua/5.4 (multiarch libdir) when it holds init.lua */
static const char *share_near(char *buf, size_t cap, const char *file) {
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", file);
    char *slash = strrchr(dir, '/');
    if (!slash) return NULL;
    *slash = '\0';
    static const char *const rel[] = {"/../share/lua/5.4", "/../../share/lua/5.4"};
    for (int i = 0; i < 2; i++)
        if (snprintf(buf, cap, "%s%s", dir, rel[i]) < (int)cap && is_dir_with_init(buf)) return buf;
    return NULL;
}

const char *ms_lua_dir(void) {
    static _Thread_local char dir[PATH_MAX + 32];
    const char *env = getenv("MOONSHARD_LUA_DIR");
    if (env && *env) return env;
    /* next to the library or module this code was loaded from (an installed host's case) */
    Dl_info info;
    if (dladdr((void *)ms_lua_dir, &info) && info.dli_fname && share_near(dir, sizeof dir, info.dli_fname)) return dir;
    /* next to the executable (an installed moonshard) */
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        if (share_near(dir, sizeof dir, exe)) return dir;
    }
    if (is_dir_with_init(MOONSHARD_INSTALL_LUA_DIR)) return MOONSHARD_INSTALL_LUA_DIR;
    return MOONSHARD_SOURCE_LUA_DIR;
}

const char *ms_lua_gen_dir(void) {
    const char *dir = ms_lua_dir();
    return dir_has(dir, "moonshard/cdef.lua") ? dir : MOONSHARD_BUILD_LUA_DIR;
}
