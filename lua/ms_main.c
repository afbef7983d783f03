/*
 * ms_main.c: the moonshard executable (and moonshard-jit, built from the same source).
 *
 *   moonshard [-n N] script.lua [args...]      run the script on N ranks (SPMD)
 *   moonshard [-n N] -e CODE [args...]
 *   mpirun -np N moonshard script.lua [args...]  the same, one rank per process over MPI
 */
#include "moonshard.h"
#include "ms_lua.h"

#include <lauxlib.h>
#include <lua.h>

/* One source, two executables: moonshard runs each rank on a Lua 5.4 state with the C
 * binding (ms_lua*.c); moonshard-jit, built with MOONSHARD_LUAJIT, on a LuaJIT state that
 * reaches the same core through the FFI (ms_luajit.c).  Both provide ms_lua_setup. */
#ifdef MOONSHARD_LUAJIT
#include <luajit.h>
#define PROG "moonshard-jit"
#define INTERPRETER LUAJIT_VERSION
#else
#define PROG "moonshard"
#define INTERPRETER LUA_RELEASE
#endif
/* the counting allocator, whose limit the policy sandbox sets (ms_alloc.c) */
#define NEWSTATE() ms_lua_newstate()
#define CLOSESTATE(L) ms_lua_close(L)

#ifdef MOONSHARD_HAVE_MPI
#include <mpi.h>
#endif

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
    MAX_RANKS = 4096,
    GRACE_S = 3 /* how long ranks may keep running after another rank failed */
};

static const char *usage_text =
    "usage: " PROG " [options] script.lua [args...]\n"
    "       " PROG " [options] -e CODE [args...]\n"
    "       " PROG " plan --help        plan a model's sharding on a mesh (no GPUs; plan\n"
    "                                  comes first)\n"
    "       " PROG " compare --help     two plans' JSON side by side, term by term\n"
    "       " PROG " sweep --help       every layout of N ranks planned, those that fit ranked\n"
    "       " PROG " checkpoint --help  a checkpoint's contents (info), checksums (verify),\n"
    "                                  Hugging Face safetensors of it (export)\n"
    "\n"
    "Runs a Lua script on N ranks, each a thread with its own Lua state (SPMD: every rank\n"
    "runs the same script; ms.rank() tells them apart).  Collectives between the ranks move\n"
    "real data through shared memory.  Interpreter: " INTERPRETER ".\n"
    "\n"
    "options:\n"
    "  -n N, --ranks N   number of ranks (default 1, at most 4096)\n"
    "  -e CODE           run CODE instead of a script file\n"
    "  --timeout S       seconds a collective waits for a missing rank before failing\n"
    "                    (on nccl also making the communicators; default:\n"
    "                    $MOONSHARD_TIMEOUT, else 300)\n"
    "  --backend B       threads: N ranks as threads of this process; mpi: this process is\n"
    "                    one rank of an MPI job (mpirun -np N " PROG " ...; -n must then be\n"
    "                    1 or absent); nccl: this process is one rank on one GPU, its rank\n"
    "                    from MPI (mpirun) or from RANK, WORLD_SIZE, MASTER_ADDR and\n"
    "                    MASTER_PORT (torchrun style), else a world of one; collectives take\n"
    "                    cuda tensors (cpu tensors are staged through the GPU).  Default: mpi\n"
    "                    when started by an MPI launcher, else threads\n"
    "  --version         print the version and exit\n"
    "  -h, --help        print this help and exit\n"
    "\n"
    "environment:\n"
    "  MOONSHARD_TIMEOUT   collective timeout in seconds (default 300)\n"
    "  MOONSHARD_BACKEND   threads, mpi or nccl, as --backend (the option wins)\n"
    "  LOCAL_RANK          nccl: this rank's GPU (default: rank mod the GPUs)\n"
    "  MOONSHARD_LUA_DIR   directory holding moonshard/init.lua (default: the installed\n"
    "                      Lua files, else the source tree this binary was built from)\n"
    "\n"
    "exit status: 1 when any rank failed or the output could not be written, 2 on a usage\n"
    "error, else the largest integer a rank's script returned or gave os.exit (0 when none\n"
    "did; 1 for one outside 0..255); under MPI, each process its own rank's.  os.exit ends\n"
    "only its rank's script: peers waiting for that rank in a collective fail at once.\n";

/* ---------------------------------------------------------------- ranks */

typedef struct {
    int rank;
    ms_world *world;
    const char *script; /* NULL when code is set */
    const char *code;
    int argc;
    char **argv;
    char *error; /* malloc'd message + traceback when the rank failed */
    int status;  /* the integer the script returned, else 0 */
    bool failed, done;
} rank_job;

static pthread_mutex_t done_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static int ranks_done;

/* ---------------------------------------------------------------- Lua 5.4 / LuaJIT (5.1 API) */

#if LUA_VERSION_NUM >= 503
#define push_as_string(L, i) ((void)luaL_tolstring(L, i, NULL))
#else
/* Lua 5.1 has no luaL_tolstring; its print converts with the global tostring, as here. */
static void push_as_string(lua_State *L, int i) {
    lua_getglobal(L, "tostring");
    lua_pushvalue(L, i);
    lua_call(L, 1, 1);
    if (!lua_isstring(L, -1)) luaL_error(L, "'tostring' must return a string to 'print'");
}
#endif

/* Sets *status to the integer the script returned, when it returned one: 0..255 as it is;
 * any other integer would reach the shell modulo 256 (256 as success), so it becomes 1,
 * with a note. */
static void take_exit_status(lua_State *L, int idx, int rank, int *status) {
    lua_Number v;
#if LUA_VERSION_NUM >= 503
    if (!lua_isinteger(L, idx)) return;
    v = (lua_Number)lua_tointeger(L, idx);
#else /* numbers are doubles: an integral one counts */
    v = lua_tonumber(L, idx);
    if (lua_type(L, idx) != LUA_TNUMBER || v != floor(v)) return;
#endif
    if (v >= 0 && v <= 255) {
        *status = (int)v;
        return;
    }
    fprintf(stderr, "moonshard: rank %d returned %.14g, not an exit status (0 to 255): exit status 1\n", rank, (double)v);
    *status = 1;
}

/* ---------------------------------------------------------------- a rank's state */

/* The errno of the first failed write to stdout (a full disk, a closed pipe): the job then
 * fails, so a truncated output never passes for a whole one. */
static _Atomic int stdout_errno;

/* Flushes stdout; on a failed write says so and turns the exit status into a failure. */
static int check_stdout(int status) {
    if (fflush(stdout) != 0 && !stdout_errno) stdout_errno = errno ? errno : EIO;
    if (!stdout_errno && !ferror(stdout)) return status;
    fprintf(stderr, "moonshard: cannot write the standard output: %s\n", strerror(stdout_errno ? stdout_errno : EIO));
    return status ? status : 1;
}

/* print() that writes each line in one piece, so ranks' lines do not interleave. */
static int l_print(lua_State *L) {
    int n = lua_gettop(L);
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    for (int i = 1; i <= n; i++) {
        if (i > 1) luaL_addchar(&b, '\t');
        push_as_string(L, i);
        luaL_addvalue(&b);
    }
    luaL_addchar(&b, '\n');
    luaL_pushresult(&b);
    size_t len;
    const char *s = lua_tolstring(L, -1, &len);
    flockfile(stdout);
    if (fwrite(s, 1, len, stdout) != len || fflush(stdout) != 0) stdout_errno = errno ? errno : EIO;
    funlockfile(stdout);
    return 0;
}

#define EXIT_KEY "moonshard.exit" /* registry: the sentinel os.exit raises */

/* os.exit(code) in a rank's script ends that rank's script with the status, as `return code`
 * would, by raising a sentinel that only run_rank catches (the script's pcall and xpcall
 * pass it on): the rank then leaves its world as finished, so peers waiting in a collective
 * fail at once instead of waiting out the timeout (under MPI the process would otherwise
 * exit without a word to them), and the other ranks of a threads world run on. */
static const char exit_code[] =
    "local EXIT = ...\n"
    "local raw_pcall, raw_xpcall, error, rawequal, type = pcall, xpcall, error, rawequal, type\n"
    "local function pass(ok, ...)\n"
    "  if not ok and rawequal((...), EXIT) then error(EXIT, 0) end\n"
    "  return ok, ...\n"
    "end\n"
    "function pcall(f, ...) return pass(raw_pcall(f, ...)) end\n"
    "function xpcall(f, handler, ...)\n"
    "  return pass(raw_xpcall(f, function(e) if rawequal(e, EXIT) then return e end return handler(e) end, ...))\n"
    "end\n"
    "function os.exit(code)\n"
    "  if code == nil or code == true then code = 0 elseif code == false then code = 1 end\n"
    "  if type(code) ~= 'number' then error(\"bad argument #1 to 'exit' (number or boolean expected)\", 2) end\n"
    "  EXIT.code = code\n"
    "  error(EXIT, 0)\n"
    "end\n";

static bool is_exit(lua_State *L, int idx) {
    lua_getfield(L, LUA_REGISTRYINDEX, EXIT_KEY);
    bool exit = lua_rawequal(L, idx < 0 ? idx - 1 : idx, -1);
    lua_pop(L, 1);
    return exit;
}

static int traceback(lua_State *L) {
    if (is_exit(L, 1)) return 1; /* os.exit: no error, no traceback */
    const char *msg = lua_tostring(L, 1);
    if (!msg) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
        msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    luaL_traceback(L, L, msg, 1);
    return 1;
}

static void setup_state(lua_State *L, rank_job *job, ms_comm *world) {
    ms_lua_setup(L, world);
    lua_pushcfunction(L, l_print);
    lua_setglobal(L, "print");
    /* arg: arg[0] = script, arg[1..] = its arguments */
    lua_createtable(L, job->argc, 1);
    lua_pushstring(L, job->script ? job->script : "-e");
    lua_rawseti(L, -2, 0);
    for (int i = 0; i < job->argc; i++) {
        lua_pushstring(L, job->argv[i]);
        lua_rawseti(L, -2, i + 1);
    }
    lua_setglobal(L, "arg");
    /* Lua's own xpcall, for the policy sandbox's budget (policy_budget.lua): between a policy
     * call's return and the restore of its hook no Lua frame may run, and the wrapper
     * below would be one. */
    lua_getglobal(L, "xpcall");
    lua_setfield(L, LUA_REGISTRYINDEX, "moonshard.raw_xpcall");
    lua_newtable(L);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, EXIT_KEY);
    if (luaL_loadbuffer(L, exit_code, sizeof exit_code - 1, "=os.exit") != LUA_OK) lua_error(L);
    lua_insert(L, -2);
    lua_call(L, 1, 0);
}

/* Runs the job on a fresh Lua state; returns NULL or a malloc'd error text. */
static char *run_rank(rank_job *job, ms_comm *world) {
    lua_State *L = NEWSTATE();
    if (!L) return strdup("cannot create a Lua state (out of memory)");
    setup_state(L, job, world);
    lua_pushcfunction(L, traceback);
    int st = job->script ? luaL_loadfilex(L, job->script, NULL) : luaL_loadbufferx(L, job->code, strlen(job->code), "=(command line)", "t");
    /* the arguments go on the stack: room for them first (a long command line overflowed
     * the default 20 slots) */
    if (st == LUA_OK && !lua_checkstack(L, job->argc + 1)) {
        lua_close(L);
        char buf[96];
        snprintf(buf, sizeof buf, "too many arguments (%d) for the Lua stack", job->argc);
        return strdup(buf);
    }
    if (st == LUA_OK) {
        for (int i = 0; i < job->argc; i++) lua_pushstring(L, job->argv[i]);
        st = lua_pcall(L, job->argc, 1, 1);
        if (st != LUA_OK && is_exit(L, -1)) { /* os.exit(code) */
            lua_getfield(L, -1, "code");
            st = LUA_OK;
        }
        if (st == LUA_OK) take_exit_status(L, -1, job->rank, &job->status);
    }
    char *err = NULL;
    if (st != LUA_OK) {
        const char *msg = lua_tostring(L, -1);
        err = strdup(msg ? msg : "(error object is not a string)");
    }
    CLOSESTATE(L); /* releases the rank's tensors, meshes and groups */
    return err;
}

static void *rank_main(void *arg) {
    rank_job *job = arg;
    ms_comm *world = NULL;
    ms_status st = ms_world_comm(job->world, job->rank, &world);
    if (st) {
        char buf[1200];
        snprintf(buf, sizeof buf, "moonshard %s error: %s", ms_status_name(st), ms_last_error());
        job->error = strdup(buf);
    } else {
        job->error = run_rank(job, world);
    }
    job->failed = job->error != NULL;
    ms_world_rank_done(job->world, job->rank, job->failed);
    ms_comm_release(world);
    pthread_mutex_lock(&done_mu);
    job->done = true;
    ranks_done++;
    pthread_cond_broadcast(&done_cv);
    pthread_mutex_unlock(&done_mu);
    return NULL;
}

/* ---------------------------------------------------------------- reporting */

/* Prints each distinct error once: "[rank 2] ..." or "[ranks 0,1,3] ...", every line of the
 * message and traceback prefixed. */
static void report_errors(const rank_job *jobs, const bool *finished, int n) {
    bool *printed = calloc((size_t)n, sizeof *printed);
    /* root causes first: a rank that failed because a peer did comes after that peer */
    for (int pass = 0; pass < (printed ? 2 : 1); pass++)
    for (int r = 0; r < n; r++) {
        if (!finished[r] || !jobs[r].failed || (printed && printed[r])) continue;
        /* the first line (the message) decides the grouping */
        size_t head = strcspn(jobs[r].error, "\n");
        const char *pf = strstr(jobs[r].error, "peer_failed error");
        if (printed && (pf && (size_t)(pf - jobs[r].error) < head) != (pass == 1)) continue;
        char who[256];
        int len = snprintf(who, sizeof who, "rank %d", jobs[r].rank);
        int same = 0;
        for (int q = r + 1; q < n && printed; q++)
            if (finished[q] && jobs[q].failed && strncmp(jobs[q].error, jobs[r].error, head) == 0 &&
                (jobs[q].error[head] == '\n' || jobs[q].error[head] == '\0')) {
                printed[q] = true;
                if (len < (int)sizeof who - 16)
                    len += snprintf(who + len, sizeof who - (size_t)len, ",%d", jobs[q].rank);
                same++;
            }
        if (same) {
            memmove(who + 5, who + 4, strlen(who + 4) + 1); /* "rank" -> "ranks" */
            who[4] = 's';
        }
        const char *p = jobs[r].error;
        while (*p) {
            size_t l = strcspn(p, "\n");
            fprintf(stderr, "[%s] %.*s\n", who, (int)l, p);
            p += l + (p[l] == '\n');
        }
    }
    free(printed);
}

/* ---------------------------------------------------------------- one rank a process: MPI, NCCL */

/* This process as one rank of the MPI world (the backend when an MPI launcher started the
 * process, or when --backend / MOONSHARD_BACKEND asks for it) or of the NCCL world: runs the
 * job on this thread; on failure prints the rank's error as the threads backend does and
 * ends the whole job (MPI_Abort under an MPI launcher, so the launcher ends the other ranks
 * instead of leaving them waiting in a collective; else the exit status, on which
 * torchrun-style launchers end the others). */
static int run_process_rank(rank_job *job, double timeout, const char *backend, bool chosen_by_launcher) {
    ms_world *world;
    bool nccl = strcmp(backend, "nccl") == 0;
    ms_status st = nccl ? ms_nccl_world_new(&world, timeout, &job->rank) : ms_mpi_world_new(&world, timeout);
    if (st) {
        fprintf(stderr, "moonshard: %s error: %s\n", ms_status_name(st), ms_last_error());
        if (st == MS_ERR_NOT_BUILT && chosen_by_launcher)
            fprintf(stderr, "moonshard: started by an MPI launcher; rebuild with MPI found, or pass "
                            "--backend threads to run each process on its own\n");
        return 1;
    }
#ifdef MOONSHARD_HAVE_MPI
    if (!nccl) MPI_Comm_rank(MPI_COMM_WORLD, &job->rank);
#endif
    job->world = world;
    rank_main(job);
    if (job->failed) {
        bool finished = true;
        fflush(stdout);
        report_errors(job, &finished, 1);
        fflush(stderr);
#ifdef MOONSHARD_HAVE_MPI
        /* The peers may be waiting for this rank in a collective: end them all now. */
        if (ms_mpi_launched()) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
        _exit(1);
    }
    free(job->error);
    ms_world_release(world); /* tells the peers this rank finished; MPI_Finalize runs at exit */
    return check_stdout(job->status);
}

/* ---------------------------------------------------------------- main */

static bool known_backend(const char *b) {
    return strcmp(b, "threads") == 0 || strcmp(b, "mpi") == 0 || strcmp(b, "nccl") == 0;
}

static int usage_error(const char *fmt, const char *arg) {
    fprintf(stderr, "moonshard: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(try '" PROG " --help')\n");
    return 2;
}

int main(int argc, char **argv) {
    int nranks = 1;
    double timeout = 0;
    const char *code = NULL, *script = NULL;
    const char *backend = NULL; /* --backend, else MOONSHARD_BACKEND, else by launcher */
    bool nranks_given = false;
    int i = 1;
    if (argc > 1 && (strcmp(argv[1], "plan") == 0 || strcmp(argv[1], "compare") == 0 ||
                     strcmp(argv[1], "sweep") == 0)) {
        /* The planner's commands are Lua programs: one rank, their arguments passed through
           (sweep is told whether stderr is a terminal, for its progress line). */
        code = strcmp(argv[1], "plan") == 0      ? "return require('moonshard.plan_cli').main({...})"
               : strcmp(argv[1], "compare") == 0 ? "return require('moonshard.plan_compare').main({...})"
               : isatty(2)                       ? "return require('moonshard.plan_sweep').main({...}, true)"
                                                 : "return require('moonshard.plan_sweep').main({...}, false)";
        backend = "threads";
        i = 2;
        goto run;
    }
    if (argc > 1 && strcmp(argv[1], "checkpoint") == 0) { /* moonshard.checkpoint_cli: one rank */
        code = "return require('moonshard.checkpoint_cli').main({...})";
        backend = "threads";
        i = 2;
        goto run;
    }
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(usage_text, stdout);
            return 0;
        } else if (strcmp(a, "--version") == 0) {
            printf(PROG " %s (%s, libmoonshard %s)\n", MOONSHARD_VERSION, INTERPRETER, ms_version());
            return 0;
        } else if (strcmp(a, "-n") == 0 || strcmp(a, "--ranks") == 0 || strncmp(a, "-n", 2) == 0 ||
                   strncmp(a, "--ranks=", 8) == 0) {
            const char *v = a[1] == 'n' && a[2] ? a + 2 : a[7] == '=' ? a + 8 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) return usage_error("%s needs a number of ranks", a);
            char *end;
            errno = 0;
            long n = strtol(v, &end, 10);
            if (errno || end == v || *end || n < 1 || n > MAX_RANKS)
                return usage_error("bad number of ranks '%s' (expected 1 to 4096)", v);
            nranks = (int)n;
            nranks_given = true;
        } else if (strcmp(a, "-e") == 0) {
            if (i + 1 >= argc) return usage_error("%s needs a chunk of Lua code", a);
            if (code) return usage_error("%s given twice (one chunk of code per run)", a);
            code = argv[++i];
        } else if (strcmp(a, "--timeout") == 0 || strncmp(a, "--timeout=", 10) == 0) {
            const char *v = a[9] == '=' ? a + 10 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) return usage_error("%s needs a number of seconds", a);
            char *end;
            timeout = strtod(v, &end);
            if (end == v || *end || !(timeout > 0) || !isfinite(timeout))
                return usage_error("bad timeout '%s' (expected a finite number of seconds > 0)", v);
        } else if (strcmp(a, "--backend") == 0 || strncmp(a, "--backend=", 10) == 0) {
            backend = a[9] == '=' ? a + 10 : (i + 1 < argc ? argv[++i] : NULL);
            if (!backend) return usage_error("%s needs a backend (threads, mpi or nccl)", a);
            if (!known_backend(backend))
                return usage_error("unknown backend '%s' (expected threads, mpi or nccl)", backend);
        } else if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (a[0] == '-' && a[1]) {
            return usage_error("unknown option '%s'", a);
        } else {
            break;
        }
    }
run:;
    const char *env_timeout = getenv("MOONSHARD_TIMEOUT");
    if (!timeout && env_timeout && *env_timeout) {
        char *end;
        double t = strtod(env_timeout, &end);
        if (end == env_timeout || *end || !(t > 0) || !isfinite(t))
            return usage_error("MOONSHARD_TIMEOUT='%s' is not a finite number of seconds > 0", env_timeout);
    }
    const char *lua_dir = getenv("MOONSHARD_LUA_DIR");
    if (lua_dir && *lua_dir) {
        char init[PATH_MAX + 32];
        snprintf(init, sizeof init, "%s/moonshard/init.lua", lua_dir);
        if (access(init, R_OK) != 0)
            return usage_error("MOONSHARD_LUA_DIR='%s' holds no readable moonshard/init.lua (unset it to use the "
                               "installed Lua files)", lua_dir);
    }
    if (!code) {
        if (i >= argc) return usage_error("%s", "no script given (" PROG " [-n N] script.lua, or -e CODE)");
        script = argv[i++];
        struct stat sb;
        errno = 0;
        if (access(script, R_OK) != 0 || stat(script, &sb) != 0 || S_ISDIR(sb.st_mode)) {
            fprintf(stderr, "moonshard: cannot read script '%s': %s\n", script,
                    errno ? strerror(errno) : "is a directory");
            if (strcmp(script, "plan") == 0 || strcmp(script, "compare") == 0 || strcmp(script, "sweep") == 0 ||
                strcmp(script, "checkpoint") == 0)
                fprintf(stderr, "moonshard: '%s' is a command only as the first argument: " PROG " %s --help\n",
                        script, script);
            return 2;
        }
    }

    bool by_launcher = false;
    if (!backend) {
        const char *env = getenv("MOONSHARD_BACKEND");
        if (env && *env) {
            if (!known_backend(env))
                return usage_error("MOONSHARD_BACKEND='%s' is not a backend (expected threads, mpi or nccl)", env);
            backend = env;
        } else {
            by_launcher = ms_mpi_launched();
            backend = by_launcher ? "mpi" : "threads";
        }
    }
    if (strcmp(backend, "threads") != 0) {
        if (nranks_given && nranks != 1) {
            char n[16];
            snprintf(n, sizeof n, "%d", nranks);
            return usage_error(strcmp(backend, "mpi") == 0
                                   ? "-n %s: with the mpi backend each process is one rank; start N ranks with "
                                     "mpirun -np N " PROG " ..."
                                   : "-n %s: with the nccl backend each process is one rank on one GPU; start N "
                                     "ranks with mpirun -np N or a launcher that sets RANK and WORLD_SIZE",
                               n);
        }
        rank_job job = {.script = script, .code = code, .argc = argc - i, .argv = argv + i};
        return run_process_rank(&job, timeout, backend, by_launcher);
    }

    /* The threads backend, the embedded default with no launcher and no network: each rank is
     * a thread with its own Lua state, joined to one threads world. */
    ms_world *world;
    ms_status st = ms_threads_world_new(&world, nranks, timeout);
    if (st) {
        fprintf(stderr, "moonshard: %s error: %s\n", ms_status_name(st), ms_last_error());
        return 1;
    }
    rank_job *jobs = calloc((size_t)nranks, sizeof *jobs);
    pthread_t *threads = calloc((size_t)nranks, sizeof *threads);
    if (!jobs || !threads) {
        fprintf(stderr, "moonshard: out of memory for %d ranks\n", nranks);
        return 1;
    }
    int started = 0;
    for (int r = 0; r < nranks; r++) {
        jobs[r] = (rank_job){.rank = r, .world = world, .script = script, .code = code,
                             .argc = argc - i, .argv = argv + i};
        if (pthread_create(&threads[r], NULL, rank_main, &jobs[r]) != 0) {
            fprintf(stderr, "moonshard: cannot start the thread of rank %d: %s\n", r, strerror(errno));
            /* The ranks already started fail at their first collective with this one. */
            for (int q = r; q < nranks; q++) ms_world_rank_done(world, q, 1);
            break;
        }
        started++;
    }

    /* Wait for every rank.  Once one has failed, the others fail fast in their collectives
     * (a failed peer is noticed at once); a rank stuck outside any collective gets GRACE_S
     * seconds and is then abandoned, so the job ends (non-zero) and says so instead of
     * waiting for it.  Each failed rank's error and traceback are printed once, prefixed by
     * the rank, ranks with the same message together (report_errors). */
    pthread_mutex_lock(&done_mu);
    struct timespec deadline = {0};
    bool have_deadline = false;
    while (ranks_done < started) {
        bool any_failed = false;
        for (int r = 0; r < nranks; r++) any_failed |= jobs[r].done && jobs[r].failed;
        if (any_failed && !have_deadline) {
            clock_gettime(CLOCK_REALTIME, &deadline);
            deadline.tv_sec += GRACE_S;
            have_deadline = true;
        }
        int rc = have_deadline ? pthread_cond_timedwait(&done_cv, &done_mu, &deadline)
                               : pthread_cond_wait(&done_cv, &done_mu);
        if (rc == ETIMEDOUT) break;
    }
    bool stuck = ranks_done < started;
    /* What the ranks still running may not change under us: who had finished by now. */
    bool *finished = calloc((size_t)nranks, sizeof *finished);
    for (int r = 0; finished && r < nranks; r++) finished[r] = jobs[r].done;
    pthread_mutex_unlock(&done_mu);
    if (!finished) _exit(1);

    int failed = started < nranks;
    if (!stuck)
        for (int r = 0; r < started; r++) pthread_join(threads[r], NULL);
    int status = 0;
    for (int r = 0; r < started; r++) {
        failed |= finished[r] && jobs[r].failed;
        if (finished[r] && jobs[r].status > status) status = jobs[r].status;
    }
    fflush(stdout);
    report_errors(jobs, finished, started);
    for (int r = 0; stuck && r < started; r++)
        if (!finished[r])
            fprintf(stderr, "[rank %d] still running %d s after another rank failed; abandoned\n", r, GRACE_S);
    fflush(stderr);
    if (stuck) _exit(1); /* threads still run: do not tear down what they use */
    for (int r = 0; r < nranks; r++) free(jobs[r].error);
    free(finished);
    free(jobs);
    free(threads);
    ms_world_release(world);
    return check_stdout(failed ? 1 : status);
}
