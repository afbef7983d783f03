/*
 * test_embed_luajit.c: a host that has a Lua of its own (LuaJIT, linked in) and loads
 * moonshard's embedding library, which runs on Lua 5.4.  Both define lua_newstate,
 * lua_settop, ...; loaded the ordinary way, the library's calls to the functions both have
 * bind to the host's LuaJIT and the others to Lua 5.4, and a state of one handed to the
 * other would crash.  Checked here, in two processes:
 *
 *   - loaded plainly (dlopen without RTLD_DEEPBIND, as a link-time dependency is bound),
 *     ms_interp_new refuses with MS_ERR_STATE, naming both libraries and the remedy;
 *   - loaded with RTLD_DEEPBIND, the library binds to its own Lua 5.4: it plans a model
 *     while the host's LuaJIT state keeps working.
 *
 * The host links the core (libmoonshard, which has no Lua) and LuaJIT, and reaches the
 * embedding API through dlsym.  AddressSanitizer refuses RTLD_DEEPBIND: skipped there.
 */
#include "check.h"

#include "moonshard_embed.h"

#include <dlfcn.h>
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef MOONSHARD_EMBED_LIB
#error "MOONSHARD_EMBED_LIB: the path of libmoonshard_embed"
#endif
#ifndef MOONSHARD_SOURCE_DIR
#error "MOONSHARD_SOURCE_DIR: the source tree (for examples/configs and policies)"
#endif

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

/* The embedding API, from the library dlopen loaded. */
typedef struct api {
    __typeof__(&ms_interp_new) interp_new;
    __typeof__(&ms_interp_model_config) model_config;
    __typeof__(&ms_interp_plan) plan;
    __typeof__(&ms_interp_plan_json) plan_json;
    __typeof__(&ms_interp_free) interp_free;
} api;

static int load(void *h, api *a) {
    void *p[5] = {dlsym(h, "ms_interp_new"), dlsym(h, "ms_interp_model_config"), dlsym(h, "ms_interp_plan"),
                  dlsym(h, "ms_interp_plan_json"), dlsym(h, "ms_interp_free")};
    for (int i = 0; i < 5; i++)
        if (!p[i]) return 0;
    memcpy(&a->interp_new, &p[0], sizeof p[0]);
    memcpy(&a->model_config, &p[1], sizeof p[1]);
    memcpy(&a->plan, &p[2], sizeof p[2]);
    memcpy(&a->plan_json, &p[3], sizeof p[3]);
    memcpy(&a->interp_free, &p[4], sizeof p[4]);
    return 1;
}

/* The host's own LuaJIT: a state that computes. */
static lua_State *host_lua(void) {
    lua_State *L = luaL_newstate();
    CHECK(L != NULL);
    if (!L) return NULL;
    luaL_openlibs(L);
    CHECK(luaL_dostring(L, "x = 6 * 7") == 0);
    return L;
}

static void host_lua_still_works(lua_State *L) {
    CHECK(luaL_dostring(L, "x = x + 1; assert(jit and jit.version)") == 0);
    lua_getglobal(L, "x");
    CHECK(lua_tointeger(L, -1) == 43);
    lua_close(L);
}

/* Loaded plainly: refused, not crashed. */
static int plain(ms_comm *c) {
    lua_State *L = host_lua();
    void *h = dlopen(MOONSHARD_EMBED_LIB, RTLD_NOW);
    CHECK(h != NULL);
    api a;
    if (!h || !load(h, &a)) return 1;
    ms_interp *in = NULL;
    CHECK_ERR(a.interp_new(&in, c), MS_ERR_STATE, "this process binds Lua's C functions to two libraries");
    CHECK(in == NULL && strstr(ms_last_error(), "libluajit") && strstr(ms_last_error(), "liblua5.4") &&
          strstr(ms_last_error(), "RTLD_DEEPBIND"));
    printf("loaded plainly: %s\n", ms_last_error());
    host_lua_still_works(L);
    return check_failed != 0;
}

/* Loaded with RTLD_DEEPBIND: plans. */
static int deep(ms_comm *c) {
    lua_State *L = host_lua();
    void *h = dlopen(MOONSHARD_EMBED_LIB, RTLD_NOW | RTLD_DEEPBIND);
    CHECK(h != NULL);
    api a;
    if (!h || !load(h, &a)) return 1;
    ms_interp *in = NULL;
    CHECK_OK(a.interp_new(&in, c));
    if (!in) return 1;
    CHECK_OK(a.model_config(in, MOONSHARD_SOURCE_DIR "/examples/configs/llama3.1_8b.json"));
    int units = 0;
    CHECK_OK(a.plan(in, "dp_shard=8", MOONSHARD_SOURCE_DIR "/policies/fsdp2_default.lua", &units));
    char *json = NULL;
    CHECK_OK(a.plan_json(in, &json));
    CHECK(units == 33 && json && strstr(json, "\"moonshard_plan\":1") && strstr(json, "model.layers.31"));
    printf("loaded with RTLD_DEEPBIND: planned Llama-3.1-8B on dp_shard=8 (%d units, %zu bytes of plan JSON) beside "
           "the host's LuaJIT\n", units, json ? strlen(json) : 0);
    free(json);
    a.interp_free(in);
    host_lua_still_works(L);
    return check_failed != 0;
}

int main(void) {
#ifdef UNDER_ASAN
    printf("test_embed_luajit: skipped: AddressSanitizer does not allow RTLD_DEEPBIND\n");
    return 77;
#endif
    ms_world *w = NULL;
    ms_comm *c = NULL;
    CHECK_OK(ms_threads_world_new(&w, 1, 60));
    CHECK_OK(ms_world_comm(w, 0, &c));
    if (!c) return check_summary("test_embed_luajit");
    int (*const runs[2])(ms_comm *) = {plain, deep};
    for (int i = 0; i < 2; i++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            const int rc = runs[i](c);
            printf("  (child: %d passed, %d failed)\n", check_passed, check_failed);
            fflush(stdout);
            _exit(rc);
        }
        int status = 0;
        CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    ms_world_rank_done(w, 0, 0);
    ms_comm_release(c);
    ms_world_release(w);
    return check_summary("test_embed_luajit");
}
