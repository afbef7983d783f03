/*
 * test_embed.c: the embedding API (moonshard_embed.h, lua/ms_embed.c, moonshard/embed.lua)
 * as a demanding host uses it, errors checked by status and message.
 *
 *   - unit pointers stay valid until ms_interp_free: a second plan or materialize is
 *     refused (MS_ERR_STATE) instead of replacing the units, and the units live on when
 *     the Lua side drops every reference to them (checked under AddressSanitizer);
 *   - no Lua error reaches the host: a replaced package.loaded["moonshard.embed"], a
 *     module whose __index raises or whose functions were replaced, error objects that are
 *     not strings (their __tostring, raising or not), out of memory;
 *   - calls that used to be ignored: a module type after the plan or for a module that does
 *     not exist, parameters and a config mixed, params added after a failed plan;
 *   - statuses: MS_ERR_IO for an unreadable config, MS_ERR_STATE for calls out of order,
 *     MS_ERR_OOM (in a child process with its address space capped); no message starts
 *     with a position inside moonshard's Lua files;
 *   - ms_unit_scale_grads refuses a scale that is not finite;
 *   - with ep = 2 the interpreter holds ep-local units beyond the plan's count, and
 *     ms_interp_unit_count counts them.
 */
#include "check_mt.h"

#include "moonshard_embed.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* A huge allocation must come back NULL under AddressSanitizer too (the OOM check). */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

#ifndef MOONSHARD_SOURCE_DIR
#error "MOONSHARD_SOURCE_DIR: the source tree (for examples/configs and policies)"
#endif

static char dir[256];  /* scratch directory with the test's policies */
static ms_world *W1;   /* a world of one rank */
static ms_comm *C1;

/* Whether a message names a position inside moonshard's own Lua files ("...moonshard/x.lua:12:"). */
static int internal_position(const char *msg) {
    for (const char *p = strstr(msg, ".lua:"); p; p = strstr(p + 1, ".lua:")) {
        const char *s = p;
        while (s > msg && s[-1] != ' ') s--;
        char token[512];
        size_t n = (size_t)(p - s) < sizeof token - 1 ? (size_t)(p - s) : sizeof token - 1;
        memcpy(token, s, n);
        token[n] = '\0';
        if (strstr(token, "moonshard/")) return 1;
    }
    return 0;
}

/* The call fails with `want`, a message containing needle, and no internal position. */
#define CHECK_ERR(call, want, needle)                                                            \
    do {                                                                                         \
        CHECK_ST(call, want, needle);                                                            \
        CHECK(!internal_position(ms_last_error()), "(a position in moonshard's Lua files: %s)", \
              ms_last_error());                                                                  \
    } while (0)

static void write_file(const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        exit(1);
    }
    fputs(text, f);
    fclose(f);
}

/* The path of a scratch file (a ring of buffers: use it at once). */
static const char *at(const char *name) {
    static char path[8][512];
    static int next;
    char *p = path[next++ % 8];
    snprintf(p, sizeof path[0], "%s/%s", dir, name);
    return p;
}

static char good[512]; /* the path of good.lua, a policy that plans model() in 2 units */

/* A fresh interpreter on the one-rank world with a three-parameter model. */
static ms_interp *model(void) {
    ms_interp *in = NULL;
    if (ms_interp_new(&in, C1)) {
        fprintf(stderr, "interp_new: %s\n", ms_last_error());
        exit(1);
    }
    const int64_t w[2] = {8, 6}, b[1] = {8}, n[1] = {6};
    CHECK_OK(ms_interp_model_param(in, "layers.0.weight", 2, w, MS_F32, 1));
    CHECK_OK(ms_interp_model_param(in, "layers.0.bias", 1, b, MS_F32, 1));
    CHECK_OK(ms_interp_model_param(in, "norm.weight", 1, n, MS_F32, 1));
    return in;
}

/* ---------------------------------------------------------------- 1: unit lifetime */

static void unit_lifetime(void) {
    ms_interp *in = model();
    int units = 0;
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", good, &units));
    CHECK(units == 2);
    CHECK(ms_interp_unit(in, 0) == NULL);
    CHECK(strstr(ms_last_error(), "interp_unit: no units yet: materialise the plan first"), "(%s)", ms_last_error());
    CHECK_OK(ms_interp_materialize(in));
    CHECK(ms_interp_unit_count(in) == 2);
    ms_unit *u = ms_interp_unit(in, 0);
    CHECK(u != NULL && strcmp(ms_unit_name(u), "layers.0") == 0);
    /* the reproduction: plan + materialize again, then the Lua GC */
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", good, NULL), MS_ERR_STATE,
              "moonshard state error: embed: the plan cannot change after its units were materialised");
    CHECK_ERR(ms_interp_materialize(in), MS_ERR_STATE, "embed: the units were already materialised");
    CHECK_OK(ms_interp_exec(in, "collectgarbage() collectgarbage()"));
    CHECK(ms_interp_unit(in, 0) == u);
    CHECK_OK(ms_unit_unshard(u));
    CHECK_OK(ms_unit_wait(u));
    CHECK_OK(ms_unit_reshard(u));
    /* still the same units: the second materialize changed nothing */
    CHECK(ms_interp_unit_count(in) == 2);
    CHECK(ms_interp_unit(in, 2) == NULL);
    CHECK(strstr(ms_last_error(), "interp_unit: no unit 2 (there are 2, numbered from 0)"), "(%s)", ms_last_error());
    CHECK(ms_interp_unit(in, -1) == NULL);
    /* the Lua side drops every reference it has to the units: the interpreter's C
     * references keep them alive */
    CHECK_OK(ms_interp_exec(in, "package.loaded['moonshard.embed'] = nil "
                                "debug.getregistry()['moonshard.embed.module'] = nil "
                                "collectgarbage() collectgarbage()"));
    for (int i = 0; i < ms_interp_unit_count(in); i++) {
        ms_unit *v = ms_interp_unit(in, i);
        CHECK(v && ms_unit_param_count(v) > 0);
        CHECK_OK(ms_unit_unshard(v));
        CHECK_OK(ms_unit_wait(v));
        CHECK(ms_tensor_numel(ms_unit_param_full(v, 0)) > 0);
        CHECK_OK(ms_unit_release_unsharded(v));
    }
    /* and the calls that need the module fail cleanly */
    int ui, pi;
    CHECK_ERR(ms_interp_find_param(in, "norm.weight", &ui, &pi), MS_ERR_INTERNAL,
              "embed: the module moonshard.embed is not loaded");
    /* a unit the host retained outlives the interpreter */
    ms_unit_retain(u);
    CHECK_OK(ms_unit_unshard(u));
    ms_interp_free(in);
    CHECK_OK(ms_unit_wait(u));
    CHECK(strcmp(ms_unit_name(u), "layers.0") == 0);
    CHECK_OK(ms_unit_reshard(u));
    ms_unit_release(u);

    /* the plan may change until materialize; a failed plan keeps the previous one, and the
     * model may still grow after a failed plan (each plan starts from the model as now) */
    in = model();
    CHECK_ERR(ms_interp_plan(in, "dp_shard=0", good, NULL), MS_ERR_ARG, "dp_shard = 0");
    const int64_t e[1] = {4};
    CHECK_OK(ms_interp_model_param(in, "layers.0.extra", 1, e, MS_F32, 1));
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", good, &units));
    CHECK_ERR(ms_interp_plan(in, "foo=1", good, NULL), MS_ERR_ARG, "unknown axis 'foo'");
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", good, &units));
    CHECK_OK(ms_interp_materialize(in));
    CHECK_OK(ms_interp_find_param(in, "layers.0.extra", &ui, &pi));
    CHECK(ui == 0 && pi >= 0 && pi < ms_unit_param_count(ms_interp_unit(in, 0)));
    ms_interp_free(in);
}

/* ---------------------------------------------------------------- 2 and 3: Lua errors */

static void lua_errors(void) {
    const int64_t s1[1] = {4};
    /* package.loaded replaced: the interpreter keeps the module it loaded */
    ms_interp *in = model();
    CHECK_OK(ms_interp_exec(in, "package.loaded['moonshard.embed'] = 42"));
    CHECK_OK(ms_interp_model_param(in, "a.w", 1, s1, MS_F32, 1));
    CHECK_OK(ms_interp_exec(in, "package.loaded['moonshard.embed'] = setmetatable({}, {__index = function() "
                                "error('boom') end})"));
    CHECK_OK(ms_interp_model_param(in, "a.v", 1, s1, MS_F32, 1));
    int units = 0;
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", good, &units));
    CHECK(units == 2);
    ms_interp_free(in);

    /* the module itself broken from Lua: errors, not a panic */
    in = model();
    CHECK_OK(ms_interp_exec(in, "local e = require 'moonshard.embed' e.add_param = nil "
                                "setmetatable(e, {__index = function(_, k) error('index ' .. k .. ' raised', 0) end})"));
    CHECK_ERR(ms_interp_model_param(in, "a.w", 1, s1, MS_F32, 1), MS_ERR_ARG, "index add_param raised");
    CHECK_OK(ms_interp_exec(in, "require('moonshard.embed').plan = 42"));
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", good, NULL), MS_ERR_INTERNAL,
              "embed: moonshard.embed.plan is not a function (was it replaced?)");
    CHECK_OK(ms_interp_exec(in, "require('moonshard.embed').prefetch = function() return 'x', {} end"));
    int f, b;
    CHECK_ERR(ms_interp_prefetch(in, &f, &b), MS_ERR_INTERNAL, "embed: prefetch returned string, not an integer");
    CHECK_OK(ms_interp_exec(in, "require('moonshard.embed').plan_json = function() return 7 end"));
    char *json = NULL;
    CHECK_ERR(ms_interp_plan_json(in, &json), MS_ERR_INTERNAL, "plan_json returned no string");
    CHECK(json == NULL);
    ms_interp_free(in);

    /* error objects that are not strings */
    in = model();
    CHECK_ERR(ms_interp_exec(in, "error({code = 42})"), MS_ERR_ARG, "(error object is a table value)");
    CHECK_ERR(ms_interp_exec(in, "error()"), MS_ERR_ARG, "(error object is a nil value)");
    CHECK_ERR(ms_interp_exec(in, "error(42)"), MS_ERR_ARG, "42");
    CHECK_ERR(ms_interp_exec(in, "error(setmetatable({}, {__tostring = function() return 'tostring works' end}))"),
              MS_ERR_ARG, "tostring works");
    CHECK_ERR(ms_interp_exec(in, "error(setmetatable({}, {__tostring = function() return "
                                 "'moonshard io error: from __tostring' end}))"),
              MS_ERR_IO, "moonshard io error: from __tostring");
    CHECK_ERR(ms_interp_exec(in, "error(setmetatable({}, {__tostring = function() error('boom in tostring', 0) end}))"),
              MS_ERR_ARG, "(error object is a table value; its __tostring failed: boom in tostring)");
    CHECK_ERR(ms_interp_exec(in, "error(setmetatable({}, {__tostring = function() return {} end}))"), MS_ERR_ARG,
              "(error object is a table value; its __tostring failed: '__tostring' must return a string)");
    CHECK_ERR(ms_interp_exec(in, "error('from exec')"), MS_ERR_ARG, "(host):1: from exec");
    CHECK_ERR(ms_interp_exec(in, "this is not lua"), MS_ERR_ARG, "(host):1: syntax error near 'is'");
    /* the same from a policy, through the sandbox */
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("tableerr.lua"), NULL), MS_ERR_ARG,
              "tableerr.lua:2: error object (a table) is not a string: {code = 42}");
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("nilerr.lua"), NULL), MS_ERR_ARG,
              "nilerr.lua:2: error object is nil (error() without a message)");
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("tostringerr.lua"), NULL), MS_ERR_ARG, "policy error 42 from __tostring");
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("tostringboom.lua"), NULL), MS_ERR_ARG,
              "tostringboom.lua:3: error object (a table) whose __tostring failed: ");
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("tostringboom.lua"), NULL), MS_ERR_ARG, "boom in tostring");
    /* the interpreter is still usable after all of that */
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", good, &units));
    ms_interp_free(in);
}

/* ---------------------------------------------------------------- tied parameters */

/* A tied lm_head.weight: one parameter in two modules, counted once; fsdp2_default sees it
 * tied (neither the embedding nor the head a unit of its own: the root owns it). */
static void tied_params(void) {
    ms_interp *in = NULL;
    CHECK_OK(ms_interp_new(&in, C1));
    const int64_t emb[2] = {10, 4}, w[2] = {4, 4};
    CHECK_OK(ms_interp_model_param(in, "model.embed_tokens.weight", 2, emb, MS_F32, 1));
    CHECK_OK(ms_interp_model_param(in, "model.layers.0.mlp.weight", 2, w, MS_F32, 1));
    CHECK_OK(ms_interp_model_param(in, "model.layers.1.mlp.weight", 2, w, MS_F32, 1));
    CHECK_ERR(ms_interp_model_tie(in, "lm_head.weight", "model.embed.weight"), MS_ERR_ARG,
              "embed: tie 'lm_head.weight' to 'model.embed.weight': no parameter 'model.embed.weight' was described");
    CHECK_ERR(ms_interp_model_tie(in, "model.layers.0.mlp.weight", "model.embed_tokens.weight"), MS_ERR_ARG,
              "parameter 'model.layers.0.mlp.weight' is already described");
    CHECK_ERR(ms_interp_model_tie(in, "model.layers", "model.embed_tokens.weight"), MS_ERR_ARG,
              "'model.layers' is already a module of the parameters described before");
    CHECK_OK(ms_interp_model_tie(in, "lm_head.weight", "model.embed_tokens.weight"));
    CHECK_ERR(ms_interp_model_tie(in, "out.weight", "lm_head.weight"), MS_ERR_ARG,
              "'lm_head.weight' is itself a tie of 'model.embed_tokens.weight'; tie to 'model.embed_tokens.weight'");
    CHECK_OK(ms_interp_model_module_type(in, "model.layers", "ModuleList"));
    int units = 0;
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", MOONSHARD_SOURCE_DIR "/policies/fsdp2_default.lua", &units));
    CHECK(units == 3, "(%d units: the two layers and the root, which owns the tied weight)", units);
    char *json = NULL;
    CHECK_OK(ms_interp_plan_json(in, &json));
    /* 40 + 16 + 16 elements: the tied weight once */
    CHECK(json && strstr(json, "\"params\":72"), "(%.300s)", json ? json : "");
    CHECK(json && !strstr(json, "\"name\":\"lm_head\""), "(lm_head is no unit of its own)");
    free(json);
    CHECK_ERR(ms_interp_model_tie(in, "late.weight", "model.embed_tokens.weight"), MS_ERR_STATE,
              "the model cannot change after it was planned");
    ms_interp_free(in);
}

/* ---------------------------------------------------------------- 4: calls that were ignored */

static void ignored_calls(void) {
    const char *config = MOONSHARD_SOURCE_DIR "/examples/configs/inkling2_small.json";
    const int64_t s1[1] = {4};
    /* a module type after the plan: refused like a parameter */
    ms_interp *in = model();
    CHECK_OK(ms_interp_model_module_type(in, "layers.0", "MyLayer"));
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", at("typecheck.lua"), NULL));
    CHECK_ERR(ms_interp_model_module_type(in, "layers", "LateType"), MS_ERR_STATE,
              "moonshard state error: embed: module 'layers': its type cannot change after the model was planned");
    CHECK_ERR(ms_interp_model_param(in, "late.w", 1, s1, MS_F32, 1), MS_ERR_STATE,
              "embed: parameter 'late.w': the model cannot change after it was planned");
    CHECK_ERR(ms_interp_model_config(in, config), MS_ERR_STATE, "the model cannot change after it was planned");
    ms_interp_free(in);
    /* the type reaches the policy (typecheck.lua refuses the plan otherwise) */
    in = model();
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("typecheck.lua"), NULL), MS_ERR_ARG, "layers.0 is a Module");
    ms_interp_free(in);

    /* a module that does not exist: refused at the call */
    in = model();
    CHECK_ERR(ms_interp_model_module_type(in, "nosuchmodule", "X"), MS_ERR_ARG,
              "embed: no module 'nosuchmodule' to give the type X among the modules of the 3 parameters (the first "
              "'layers.0.weight')");
    CHECK_ERR(ms_interp_model_module_type(in, "layers.0.weight", "X"), MS_ERR_ARG, "no module 'layers.0.weight'");
    CHECK_ERR(ms_interp_model_module_type(in, "layers..0", "X"), MS_ERR_ARG, "module name 'layers..0' has an empty segment");
    CHECK_OK(ms_interp_model_module_type(in, "", "MyModel"));
    CHECK_OK(ms_interp_model_module_type(in, "layers", "ModuleList"));
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", at("good.lua"), NULL));
    ms_interp_free(in);
    ms_interp *empty = NULL;
    CHECK_OK(ms_interp_new(&empty, C1));
    CHECK_ERR(ms_interp_model_module_type(empty, "layers", "X"), MS_ERR_ARG,
              "no module 'layers' to give the type X: describe the model's parameters first");
    ms_interp_free(empty);

    /* parameters and a config mixed: refused, naming both */
    in = model();
    CHECK_ERR(ms_interp_model_config(in, config), MS_ERR_STATE, "inkling2_small.json: the model was already described "
              "by 3 parameters (the first 'layers.0.weight'); describe it by parameters or by a config, not both");
    ms_interp_free(in);
    CHECK_OK(ms_interp_new(&in, C1));
    CHECK_OK(ms_interp_model_config(in, config));
    CHECK_ERR(ms_interp_model_param(in, "layers.0.weight", 1, s1, MS_F32, 1), MS_ERR_STATE,
              "parameter 'layers.0.weight': the model was already given by the config ");
    CHECK_ERR(ms_interp_model_config(in, config), MS_ERR_STATE, "the model was already given by the config");
    /* module types on a config's model: checked against it */
    CHECK_ERR(ms_interp_model_module_type(in, "model.nosuch", "X"), MS_ERR_ARG,
              "no module 'model.nosuch' to give the type X in the model of the config");
    CHECK_OK(ms_interp_model_module_type(in, "model.layers.0", "MyLayer"));
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("typecheck_config.lua"), NULL), MS_ERR_ARG,
              "the policy saw model.layers.0 as a MyLayer");
    ms_interp_free(in);
}

/* ---------------------------------------------------------------- 5: statuses and messages */

static void statuses(void) {
    ms_interp *in = NULL;
    CHECK_OK(ms_interp_new(&in, C1));
    CHECK_ERR(ms_interp_model_config(in, "/nonexistent/config.json"), MS_ERR_IO,
              "moonshard io error: embed: cannot read the config /nonexistent/config.json: No such file or directory");
    CHECK_ERR(ms_interp_model_config(in, dir), MS_ERR_IO, "embed: cannot read the config ");
    CHECK(strstr(ms_last_error(), dir) && strstr(ms_last_error(), "is a directory, not a regular file"), "(%s)", ms_last_error());
    /* what is no regular file is refused before it is opened (a FIFO would block the open) */
    CHECK_ERR(ms_interp_model_config(in, "/dev/zero"), MS_ERR_IO,
              "embed: cannot read the config /dev/zero: is a character device, not a regular file");
    CHECK(!strstr(ms_last_error(), "json"), "(%s)", ms_last_error());
    CHECK_ERR(ms_interp_model_config(in, ""), MS_ERR_ARG, "embed: the config path is empty");
    CHECK_ERR(ms_interp_model_config(in, at("bad.json")), MS_ERR_ARG, "bad.json:2:1: unexpected end of input");
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", MOONSHARD_SOURCE_DIR "/policies/fsdp2_default.lua", NULL), MS_ERR_STATE,
              "embed: no model yet: describe its parameters or give a config first");
    /* a failed config leaves the interpreter free to take another */
    CHECK_OK(ms_interp_model_config(in, MOONSHARD_SOURCE_DIR "/examples/configs/inkling2_small.json"));
    ms_interp_free(in);

    /* calls out of order */
    in = model();
    int f, b, ui, pi;
    char *json = NULL;
    CHECK_ERR(ms_interp_prefetch(in, &f, &b), MS_ERR_STATE, "embed: no plan yet: plan the model first");
    CHECK_ERR(ms_interp_plan_json(in, &json), MS_ERR_STATE, "embed: no plan yet");
    CHECK_ERR(ms_interp_materialize(in), MS_ERR_STATE, "embed: plan the model before materialising it");
    CHECK_ERR(ms_interp_find_param(in, "norm.weight", &ui, &pi), MS_ERR_STATE, "embed: materialise the plan first");
    CHECK(ms_interp_unit_count(in) == 0);

    /* the host's parameters checked at the call, by name, not by a position in moonshard */
    const int64_t sh[2] = {4, 4}, neg[2] = {-4, 4};
    CHECK_ERR(ms_interp_model_param(in, "x.w", 2, neg, MS_F32, 1), MS_ERR_SHAPE,
              "interp_model_param: x.w: size of dim 0 is -4; sizes must be >= 0");
    const int64_t huge[2] = {INT64_MAX, 4}, big[1] = {INT64_MAX / 2};
    CHECK_ERR(ms_interp_model_param(in, "x.w", 2, huge, MS_F32, 1), MS_ERR_OVERFLOW,
              "interp_model_param: x.w: shape [9223372036854775807, 4] has more than 2^63 elements");
    CHECK_ERR(ms_interp_model_param(in, "x.w", 1, big, MS_F32, 1), MS_ERR_OVERFLOW,
              "interp_model_param: x.w: 4611686018427387903 elements of f32 are more than 2^63 bytes");
    CHECK_ERR(ms_interp_model_param(in, "layers.0.weight", 2, sh, MS_F32, 1), MS_ERR_ARG,
              "moonshard: embed: parameter 'layers.0.weight' is already described");
    CHECK_ERR(ms_interp_model_param(in, "x.ids", 2, sh, MS_I64, 1), MS_ERR_ARG,
              "moonshard: embed: parameter 'x.ids': a parameter of dtype i64 cannot require gradients; only floating "
              "dtypes can");
    CHECK_ERR(ms_interp_model_param(in, "", 2, sh, MS_F32, 1), MS_ERR_ARG, "embed: parameter name '' has an empty segment");
    CHECK_ERR(ms_interp_model_param(in, "x..w.", 2, sh, MS_F32, 1), MS_ERR_ARG,
              "embed: parameter name 'x..w.' has an empty segment");
    {   /* names past the module tree's limits (64 dotted parts, 1024 bytes) */
        char deep[200] = "", wide[1100];
        for (int i = 0; i < 65; i++) strcat(deep, i ? ".a" : "a");
        CHECK_ERR(ms_interp_model_param(in, deep, 2, sh, MS_F32, 1), MS_ERR_ARG,
                  "has 65 dotted parts, more than the 64-part limit on names");
        memset(wide, 'w', 1025);
        wide[1025] = '\0';
        CHECK_ERR(ms_interp_model_param(in, wide, 2, sh, MS_F32, 1), MS_ERR_ARG,
                  "(1025 bytes)' is 1025 bytes, more than the 1024-byte limit on names");
        deep[127] = '\0'; /* 64 parts */
        CHECK_OK(ms_interp_model_param(in, deep, 2, sh, MS_F32, 1));
    }
    CHECK_ERR(ms_interp_model_param(in, "layers.0.weight.sub", 2, sh, MS_F32, 1), MS_ERR_ARG,
              "parameter 'layers.0.weight.sub': 'layers.0.weight' is already a parameter, so it cannot be a module");
    CHECK_ERR(ms_interp_model_param(in, "layers.0", 2, sh, MS_F32, 1), MS_ERR_ARG,
              "parameter 'layers.0': 'layers.0' is already a module");
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", "", NULL), MS_ERR_ARG, "embed: the policy path is empty");
    CHECK_ERR(ms_interp_plan(in, "", at("good.lua"), NULL), MS_ERR_ARG, "moonshard: mesh: ");
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("nonexistent.lua"), NULL), MS_ERR_IO,
              "nonexistent.lua: No such file or directory");
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("unowned.lua"), NULL), MS_ERR_ARG, "left unowned: norm.weight");
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("badprefetch.lua"), NULL), MS_ERR_ARG,
              "moonshard: plan: the policy's prefetch.backward is 'x'; expected an integer >= 0 (units fetched ahead)");
    /* a core error raised inside moonshard's runtime: the status and the host's names, no
     * position in moonshard's Lua files (a 2^48-byte parameter cannot be allocated) */
    ms_interp *big_model = model();
    const int64_t too_big[1] = {(int64_t)1 << 46};
    CHECK_OK(ms_interp_model_param(big_model, "x.w", 1, too_big, MS_F32, 1));
    CHECK_OK(ms_interp_plan(big_model, "dp_shard=1", good, NULL));
    CHECK_ERR(ms_interp_materialize(big_model), MS_ERR_OOM, "moonshard out_of_memory error: ");
    CHECK(strncmp(ms_last_error(), "moonshard out_of_memory error: ", 31) == 0, "(%s)", ms_last_error());
    CHECK(ms_interp_unit_count(big_model) == 0);
    ms_interp_free(big_model);
    /* none of the refused parameters went in: the model plans as before */
    int units = 0;
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", at("good.lua"), &units));
    CHECK(units == 2);
    CHECK_OK(ms_interp_plan_json(in, &json));
    CHECK(json && strstr(json, "{\"moonshard_plan\":1,"));
    free(json);
    CHECK_OK(ms_interp_prefetch(in, &f, &b));
    CHECK(f == 1 && b == 2);
    CHECK_OK(ms_interp_materialize(in));
    CHECK_ERR(ms_interp_find_param(in, "nope", &ui, &pi), MS_ERR_ARG, "embed: the plan has no parameter 'nope'");
    CHECK_OK(ms_interp_find_param(in, "norm.weight", &ui, &pi));
    CHECK(ui == 1 && pi == 0);

    /* 6: a scale that is not finite is refused like a divide factor */
    ms_unit *u = ms_interp_unit(in, 0);
    CHECK_OK(ms_unit_unshard(u));
    CHECK_OK(ms_unit_wait(u));
    CHECK_OK(ms_tensor_fill(ms_unit_grad_full(u, 0), 1.0));
    CHECK_OK(ms_tensor_fill(ms_unit_grad_full(u, 1), 1.0));
    CHECK_OK(ms_unit_reduce_grads(u));
    CHECK_OK(ms_unit_wait(u));
    CHECK_ERR(ms_unit_scale_grads(u, NAN), MS_ERR_ARG, "unit 'layers.0': scale_grads: scale nan: expected a finite scale");
    CHECK_ERR(ms_unit_scale_grads(u, INFINITY), MS_ERR_ARG, "scale inf: expected a finite scale");
    CHECK_ERR(ms_unit_scale_grads(u, -INFINITY), MS_ERR_ARG, "scale -inf: expected a finite scale");
    double sq = -1;
    CHECK_OK(ms_unit_grad_sq_norm(u, &sq));
    CHECK(sq == 8 * 6 + 8, "(sum of squares %g: the refused scales changed the gradients)", sq);
    CHECK_OK(ms_unit_scale_grads(u, 0.5));
    CHECK_OK(ms_unit_grad_sq_norm(u, &sq));
    CHECK(sq == (8 * 6 + 8) / 4.0, "(sum of squares %g)", sq);
    ms_interp_free(in);
}

/* ---------------------------------------------------------------- 5: out of memory */

/* In a child process whose address space is capped: a Lua allocation that fails inside a
 * call is MS_ERR_OOM (the raw LUA_ERRMEM of a growing table, and Lua's "not enough memory"
 * of a library buffer), and the interpreter is still usable afterwards.  Run first, while
 * the process has no other thread. */
static void out_of_memory(void) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        ms_world *w = NULL;
        ms_comm *c = NULL;
        ms_interp *in = NULL;
        if (ms_threads_world_new(&w, 1, 60) || ms_world_comm(w, 0, &c) || ms_interp_new(&in, c)) _exit(100);
        long pages = 0;
        FILE *f = fopen("/proc/self/statm", "r");
        if (!f || fscanf(f, "%ld", &pages) != 1) _exit(101);
        fclose(f);
        struct rlimit lim = {.rlim_cur = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + ((rlim_t)256 << 20)};
        lim.rlim_max = RLIM_INFINITY;
        if (setrlimit(RLIMIT_AS, &lim)) _exit(102);
        CHECK_ERR(ms_interp_exec(in, "local t = {} for i = 1, 1e10 do t[i] = i end"), MS_ERR_OOM, "not enough memory");
        CHECK_ERR(ms_interp_exec(in, "collectgarbage() local s = string.rep('x', (1 << 31) - 1)"), MS_ERR_OOM,
                  "not enough memory");
        CHECK_OK(ms_interp_exec(in, "collectgarbage() assert(#string.rep('x', 1000) == 1000)"));
        ms_interp_free(in);
        ms_comm_release(c);
        ms_world_release(w);
        _exit(atomic_load(&failed) ? 1 : 0);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "(the out-of-memory child: %s %d)", WIFEXITED(status) ? "exit" : "signal",
          WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
}

/* ---------------------------------------------------------------- 7: ep-local units */

typedef struct {
    int rank, ok, planned, held, ep_named, gathered_all;
} ep_rank;

static ms_world *W2;

static void *ep_main(void *p) {
    ep_rank *r = p;
    ms_comm *world = NULL;
    ms_interp *in = NULL;
    CHECK_OK(ms_world_comm(W2, r->rank, &world));
    CHECK_OK(ms_interp_new(&in, world));
    CHECK_OK(ms_interp_model_config(in, MOONSHARD_SOURCE_DIR "/tests/lua/configs/inkling2_tiny.json"));
    CHECK_OK(ms_interp_plan(in, "dp_shard=2,ep=2", MOONSHARD_SOURCE_DIR "/policies/inkling2", &r->planned));
    CHECK_OK(ms_interp_materialize(in));
    r->held = ms_interp_unit_count(in);
    r->gathered_all = 1;
    for (int i = 0; i < r->held; i++) {
        ms_unit *u = ms_interp_unit(in, i);
        if (!u) {
            r->gathered_all = 0;
            continue;
        }
        if (i >= r->planned && strstr(ms_unit_name(u), "[ep]")) r->ep_named++;
        if (ms_unit_unshard(u) || ms_unit_wait(u) || ms_unit_release_unsharded(u)) r->gathered_all = 0;
    }
    CHECK(ms_interp_unit(in, r->held) == NULL);
    ms_interp_free(in);
    ms_world_rank_done(W2, r->rank, 0);
    ms_comm_release(world);
    return NULL;
}

static void ep_local_units(void) {
    CHECK_OK(ms_threads_world_new(&W2, 2, 60));
    pthread_t t[2];
    ep_rank r[2] = {{.rank = 0}, {.rank = 1}};
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, ep_main, &r[i]);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    ms_world_release(W2);
    for (int i = 0; i < 2; i++) {
        CHECK(r[i].planned > 0 && r[i].held > r[i].planned, "(rank %d: %d planned, %d held)", i, r[i].planned, r[i].held);
        CHECK(r[i].ep_named == r[i].held - r[i].planned, "(rank %d: %d ep-local units named [ep] of %d)", i,
              r[i].ep_named, r[i].held - r[i].planned);
        CHECK(r[i].gathered_all, "(rank %d)", i);
    }
}

/* ---------------------------------------------------------------- 7b: hostile policies */

/* A policy planned by a host is held to the sandbox as in the CLI (tests/lua/hostile_spec.lua
 * has the whole list): no file read through the helpers it may require, its callbacks in its
 * budget after fully_shard returned to it, the planner's bookkeeping out of its reach. */
static void hostile_policies(void) {
    ms_interp *in = model();
    if (!in) return;
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("leak.lua"), NULL), MS_ERR_ARG, "leak.lua:3: attempt to call");
    CHECK(!strstr(ms_last_error(), "root:"), "(the message shows /etc/passwd: %s)", ms_last_error());
    CHECK_OK(ms_interp_set_policy_limits(in, 1e6, 256));
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("spin.lua"), NULL), MS_ERR_ARG,
              "spin.lua: instruction budget of 1000000 exceeded (an infinite loop?) at line 3");
    CHECK_OK(ms_interp_set_policy_limits(in, 200e6, 256));
    /* work in C the count does not see ends at the host's wall clock */
    CHECK_ERR(ms_interp_set_policy_seconds(in, 0), MS_ERR_ARG, "expected at least 1 second");
    CHECK_ERR(ms_interp_set_policy_seconds(in, 0.5), MS_ERR_ARG, "expected at least 1 second");
    CHECK_OK(ms_interp_set_policy_seconds(in, 1));
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", at("slow.lua"), NULL), MS_ERR_ARG, "slow.lua: time limit of 1 s exceeded");
    CHECK_OK(ms_interp_set_policy_seconds(in, 60));
    int units = 0;
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", at("tamper.lua"), &units));
    CHECK(units == 2, "(%d units: the policy's writes to ctx changed the plan)", units);
    ms_interp_free(in);
}

/* ---------------------------------------------------------------- 8: plan options and warnings */

/* torch_adamw planned and materialised (the units keep bf16 moments, no master weights),
 * its warning readable from C; the policy sandbox's limits from C. */
static void plan_options(void) {
    ms_interp *in = NULL;
    CHECK_OK(ms_interp_new(&in, C1));
    if (!in) return;
    CHECK(ms_interp_warning_count(in) == 0 && ms_interp_warning(in, 0) == NULL);
    CHECK_OK(ms_interp_model_config(in, MOONSHARD_SOURCE_DIR "/tests/lua/configs/inkling2_tiny.json"));
    CHECK_ERR(ms_interp_set_optimizer(in, "sgd"), MS_ERR_ARG, "embed: optimizer 'sgd': expected adamw, torch_adamw or none");
    CHECK_ERR(ms_interp_set_policy_limits(in, 0, 256), MS_ERR_ARG, "expected at least 1 instruction");
    CHECK_ERR(ms_interp_set_policy_limits(in, 1e6, -1), MS_ERR_ARG, "at least 1 MiB");
    CHECK_ERR(ms_interp_set_policy_limits(in, 1e6, 1e-5), MS_ERR_ARG, "at least 1 MiB");
    CHECK_OK(ms_interp_set_policy_limits(in, 1000, 256));
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", MOONSHARD_SOURCE_DIR "/policies/inkling2", NULL), MS_ERR_ARG,
              "instruction budget of 1000 exceeded");
    CHECK_OK(ms_interp_set_policy_limits(in, 200e6, 256));
    /* the policy's options, as `moonshard plan --set` sets them */
    CHECK_ERR(ms_interp_set_option(in, "prefetch.forward"), MS_ERR_ARG, "expected NAME=VALUE");
    CHECK_OK(ms_interp_set_option(in, "no_such_option=1"));
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", MOONSHARD_SOURCE_DIR "/policies/inkling2", NULL), MS_ERR_ARG,
              "unknown option 'no_such_option'");
    CHECK_OK(ms_interp_set_option(in, "prefetch.forward=3"));
    CHECK_OK(ms_interp_set_option(in, "activation_checkpointing=false"));
    CHECK_OK(ms_interp_set_option(in, "prefetch.forward=2")); /* replaces the 3 */
    CHECK_OK(ms_interp_set_option(in, "no_such_option=none"));
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", MOONSHARD_SOURCE_DIR "/policies/inkling2", NULL), MS_ERR_ARG,
              "unknown option 'no_such_option'");
    ms_interp_free(in);
    in = NULL;
    CHECK_OK(ms_interp_new(&in, C1));
    if (!in) return;
    CHECK_OK(ms_interp_model_config(in, MOONSHARD_SOURCE_DIR "/tests/lua/configs/inkling2_tiny.json"));
    CHECK_OK(ms_interp_set_option(in, "prefetch.forward=3"));
    CHECK_OK(ms_interp_set_option(in, "activation_checkpointing=false"));
    CHECK_OK(ms_interp_set_option(in, "prefetch.forward=2"));
    CHECK_OK(ms_interp_set_optimizer(in, "torch_adamw"));
    /* the batch, as --seq-len --micro-batch --global-batch give it: refused by the plan when
     * it does not split, counted when it does */
    CHECK_ERR(ms_interp_set_batch(in, -1, 0, 0), MS_ERR_ARG, "expected numbers from 0 to 2^40");
    CHECK_OK(ms_interp_set_batch(in, 64, 2, 3));
    CHECK_ERR(ms_interp_plan(in, "dp_shard=1", MOONSHARD_SOURCE_DIR "/policies/inkling2", NULL), MS_ERR_ARG,
              "tokens: global batch 3 is not a multiple of micro-batch 2 x data-parallel ranks 1 = 2");
    CHECK_OK(ms_interp_set_batch(in, 64, 2, 8));
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", MOONSHARD_SOURCE_DIR "/policies/inkling2", NULL));
    int ahead_fwd = 0, ahead_bwd = 0;
    CHECK_OK(ms_interp_prefetch(in, &ahead_fwd, &ahead_bwd));
    CHECK(ahead_fwd == 2 && ahead_bwd == 1, "(prefetch %d/%d)", ahead_fwd, ahead_bwd);
    int found = 0;
    for (int i = 0; i < ms_interp_warning_count(in); i++)
        found += strstr(ms_interp_warning(in, i), "torch_adamw keeps the AdamW moments of") != NULL;
    CHECK(found == 1, "(%d warnings)", ms_interp_warning_count(in));
    char *json = NULL;
    CHECK_OK(ms_interp_plan_json(in, &json));
    CHECK(json && strstr(json, "\"optimizer\":\"torch_adamw\""));
    CHECK(json && strstr(json, "\"checkpointed\":[]"), "(activation_checkpointing=false: no layer wrapped)");
    CHECK(json && strstr(json, "\"tokens\":{\"seq_len\":64,\"micro_batch\":2,\"global_batch\":8,\"accumulation\":4}"));
    free(json);
    CHECK_OK(ms_interp_materialize(in));
    CHECK_ERR(ms_interp_set_optimizer(in, "adamw"), MS_ERR_STATE, "set the optimizer before planning");
    CHECK_ERR(ms_interp_set_option(in, "prefetch.forward=1"), MS_ERR_STATE, "set options before planning");
    CHECK_ERR(ms_interp_set_batch(in, 64, 1, 0), MS_ERR_STATE, "set the batch before planning");
    int bf16_units = 0;
    for (int k = 0; k < ms_interp_unit_count(in); k++) {
        ms_unit *u = ms_interp_unit(in, k);
        ms_tensor *m = u ? ms_unit_adamw_state(u, 0, MS_ADAMW_EXP_AVG) : NULL;
        if (!m || ms_tensor_dtype(ms_unit_param_shard(u, 0)) != MS_BF16) continue;
        bf16_units++;
        CHECK(ms_tensor_dtype(m) == MS_BF16 && !ms_unit_adamw_state(u, 0, MS_ADAMW_MASTER_WEIGHTS) &&
                  !ms_last_error()[0],
              "(unit %s)", ms_unit_name(u));
    }
    CHECK(bf16_units > 0);
    ms_interp_free(in);
}

/* ---------------------------------------------------------------- 9: materialize is collective */

typedef struct {
    int rank, variant; /* 0 plans dp_shard=2; 1 dp_shard=2,ep=2; 2 plans and leaves without materialising */
    ms_status st;
    char msg[1024];
} agree_rank;

static ms_world *WA;

static void *agree_main(void *p) {
    agree_rank *r = p;
    ms_comm *world = NULL;
    ms_interp *in = NULL;
    CHECK_OK(ms_world_comm(WA, r->rank, &world));
    CHECK_OK(ms_interp_new(&in, world));
    CHECK_OK(ms_interp_model_config(in, MOONSHARD_SOURCE_DIR "/tests/lua/configs/inkling2_tiny.json"));
    CHECK_OK(ms_interp_plan(in, r->variant == 1 ? "dp_shard=2,ep=2" : "dp_shard=2",
                            MOONSHARD_SOURCE_DIR "/policies/inkling2", NULL));
    if (r->variant != 2) {
        r->st = ms_interp_materialize(in);
        snprintf(r->msg, sizeof r->msg, "%s", ms_last_error());
    }
    ms_interp_free(in);
    ms_world_rank_done(WA, r->rank, 0);
    ms_comm_release(world);
    return NULL;
}

/* Rank 1 planned another mesh: both ranks refused before any unit gathers, naming the
 * other; rank 1 never materialises: rank 0 fails instead of waiting. */
static void plans_agree(void) {
    for (int c = 0; c < 2; c++) {
        CHECK_OK(ms_threads_world_new(&WA, 2, 5));
        pthread_t t[2];
        agree_rank r[2] = {{.rank = 0, .variant = 0}, {.rank = 1, .variant = c ? 2 : 1}};
        for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, agree_main, &r[i]);
        for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
        ms_world_release(WA);
        if (c == 0) {
            for (int i = 0; i < 2; i++) {
                char want[128];
                snprintf(want, sizeof want, "1 of the 2 ranks planned differently from rank %d", i);
                CHECK(r[i].st == MS_ERR_ARG && strstr(r[i].msg, want) &&
                          strstr(r[i].msg, "every rank must plan the same model on the same mesh with the same policy"),
                      "(rank %d: %s: %s)", i, ms_status_name(r[i].st), r[i].msg);
            }
        } else {
            CHECK(r[0].st == MS_ERR_PEER || r[0].st == MS_ERR_TIMEOUT, "(rank 0: %s: %s)", ms_status_name(r[0].st),
                  r[0].msg);
            printf("materialize with a peer that never does: %s: %s\n", ms_status_name(r[0].st), r[0].msg);
        }
    }
}

/* A recipe (ms_interp_set_recipe): its LoRA adapters appear in the plan, described by
 * ms_interp_param_info and ms_interp_lora, and materialise in the units. */
static void recipes(void) {
    ms_interp *in = NULL;
    CHECK_OK(ms_interp_new(&in, C1));
    if (!in) return;
    const char *cfg = MOONSHARD_SOURCE_DIR "/tests/lua/configs/inkling2_tiny.json";
    CHECK_OK(ms_interp_model_config(in, cfg));
    CHECK_ERR(ms_interp_set_recipe(in, at("nonexistent_recipe.lua")), MS_ERR_IO, "recipe ");
    CHECK_ERR(ms_interp_set_recipe(in, at("badrecipe.lua")), MS_ERR_ARG,
              "peft: unknown field 'rank' (peft's fields: ");
    CHECK_ERR(ms_interp_set_recipe(in, ""), MS_ERR_ARG, "embed: the recipe path is empty");
    ms_lora lora;
    int ran = -1;
    CHECK_ERR(ms_interp_lora(in, "lm_head", &lora), MS_ERR_STATE, "no plan yet");
    CHECK_ERR(ms_interp_recipe_ran(in, "peft", &ran), MS_ERR_STATE, "no plan yet");
    CHECK_OK(ms_interp_set_recipe(in, at("recipe.lua")));
    const char *policy = MOONSHARD_SOURCE_DIR "/policies/fsdp2_default.lua";
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", policy, NULL));
    CHECK_OK(ms_interp_recipe_ran(in, "peft", &ran));
    CHECK(ran == 1, "(peft ran %d)", ran);
    CHECK_OK(ms_interp_recipe_ran(in, "fp8", &ran));
    CHECK(ran == 0, "(fp8 ran %d)", ran);
    CHECK_ERR(ms_interp_recipe_ran(in, "lora", &ran), MS_ERR_ARG, "recipe step 'lora': expected quantization, peft");
    CHECK_OK(ms_interp_lora(in, "lm_head", &lora));
    CHECK(lora.dim == 4 && lora.alpha == 8 && lora.dropout == 0 && !lora.dropout_pre && lora.init_uniform,
          "(lm_head: dim %d alpha %g dropout %g pre %d uniform %d)", lora.dim, lora.alpha, lora.dropout,
          lora.dropout_pre, lora.init_uniform);
    CHECK_OK(ms_interp_lora(in, "model.norm", &lora));
    CHECK(lora.dim == 0, "(model.norm has no adapter: dim %d)", lora.dim);
    CHECK_ERR(ms_interp_lora(in, "no.such.module", &lora), MS_ERR_ARG, "the planned model has no module 'no.such.module'");
    int ndim = 0, rg = -1;
    int64_t shape[MS_MAX_DIMS];
    ms_dtype dt;
    CHECK_OK(ms_interp_param_info(in, "lm_head.lora_B.weight", &ndim, shape, &dt, &rg));
    int64_t vocab = 0;
    CHECK_OK(ms_interp_param_info(in, "lm_head.weight", &ndim, shape, &dt, &rg));
    vocab = shape[0];
    CHECK(ndim == 2 && rg == 0, "(lm_head.weight frozen: ndim %d requires_grad %d)", ndim, rg);
    CHECK_OK(ms_interp_param_info(in, "lm_head.lora_B.weight", &ndim, shape, &dt, &rg));
    CHECK(ndim == 2 && shape[0] == vocab && shape[1] == 4 && rg == 1, "(lora_B: %d dims [%lld, %lld] rg %d)", ndim,
          (long long)shape[0], (long long)shape[1], rg);
    CHECK_ERR(ms_interp_param_info(in, "lm_head.lora_C.weight", &ndim, shape, &dt, &rg), MS_ERR_ARG,
              "the planned model has no parameter 'lm_head.lora_C.weight'");
    CHECK_OK(ms_interp_materialize(in));
    int unit = -1, index = -1;
    CHECK_OK(ms_interp_find_param(in, "lm_head.lora_A.weight", &unit, &index));
    CHECK(unit >= 0 && index >= 0, "(lora_A in unit %d index %d)", unit, index);
    CHECK_ERR(ms_interp_set_recipe(in, at("recipe.lua")), MS_ERR_STATE, "set the recipe before planning");
    ms_interp_free(in);
}

/* ---------------------------------------------------------------- 10: checkpoints */

/* The model() planned with good.lua and materialised, each element of its shards set to
 * base + its index (rank 0 of one rank: the shards are the whole parameters). */
static ms_interp *materialised(float base) {
    ms_interp *in = model();
    CHECK_OK(ms_interp_plan(in, "dp_shard=1", good, NULL));
    CHECK_OK(ms_interp_materialize(in));
    for (int u = 0; u < ms_interp_unit_count(in); u++)
        for (int i = 0; i < ms_unit_param_count(ms_interp_unit(in, u)); i++) {
            ms_tensor *t = ms_unit_param_shard(ms_interp_unit(in, u), i);
            float *v = ms_tensor_data(t);
            for (int64_t j = 0; j < ms_tensor_numel(t); j++) v[j] = base + (float)(u * 100 + i * 10) + (float)j;
        }
    return in;
}

/* 1 when every shard of a holds the bits of b's. */
static int same_shards(ms_interp *a, ms_interp *b) {
    if (ms_interp_unit_count(a) != ms_interp_unit_count(b)) return 0;
    for (int u = 0; u < ms_interp_unit_count(a); u++)
        for (int i = 0; i < ms_unit_param_count(ms_interp_unit(a, u)); i++) {
            ms_tensor *x = ms_unit_param_shard(ms_interp_unit(a, u), i), *y = ms_unit_param_shard(ms_interp_unit(b, u), i);
            if (ms_tensor_numel(x) != ms_tensor_numel(y) ||
                memcmp(ms_tensor_data(x), ms_tensor_data(y), (size_t)ms_tensor_numel(x) * sizeof(float)))
                return 0;
        }
    return 1;
}

/* Save, load, read, keep_last, a Hugging Face export loaded back, and each error's status. */
static void checkpoints(void) {
    char root[300], hf[300], code[800];
    snprintf(root, sizeof root, "%s", at("ckpt"));
    snprintf(hf, sizeof hf, "%s", at("ckpt_hf"));
    ms_interp *early = model();
    CHECK_ERR(ms_interp_checkpoint_save(early, root, 1, NULL, 0), MS_ERR_STATE, "materialise the plan first");
    CHECK_ERR(ms_interp_checkpoint_load(early, root, NULL, NULL), MS_ERR_STATE, "materialise the plan first");
    CHECK_ERR(ms_ckpt_load_hf(early, root), MS_ERR_STATE, "materialise the plan first");
    ms_interp_free(early);

    ms_interp *a = materialised(1.0f);
    CHECK_ERR(ms_interp_checkpoint_save(a, root, 3, "{\"pos\": ", 0), MS_ERR_ARG, "extra_json is not JSON text");
    CHECK_ERR(ms_interp_checkpoint_save(a, root, -1, NULL, 0), MS_ERR_ARG, "step -1");
    CHECK_OK(ms_interp_checkpoint_save(a, root, 3, "{\"pos\": 51200, \"rng\": [7, 9], \"seed\": \"18446744073709551615\"}", 0));
    CHECK_ERR(ms_interp_checkpoint_save(a, root, 3, NULL, 0), MS_ERR_ARG, "exists already");
    int64_t step = -1;
    char *extra = NULL;
    CHECK_OK(ms_interp_checkpoint_read(a, root, &step, &extra));
    CHECK(step == 3 && extra && strstr(extra, "\"pos\":51200") && strstr(extra, "\"seed\":\"18446744073709551615\""),
          "(read: step %lld, extra %s)", (long long)step, extra ? extra : "NULL");
    free(extra);
    extra = NULL;

    ms_interp *b = materialised(-5.0f);
    CHECK(!same_shards(a, b), "(the shards differ before the load)");
    CHECK_OK(ms_interp_checkpoint_load(b, root, &step, &extra));
    CHECK(step == 3 && extra && strstr(extra, "\"rng\":[7,9]"), "(load: step %lld, extra %s)", (long long)step,
          extra ? extra : "NULL");
    CHECK(same_shards(a, b), "(the loaded shards are the saved ones, bit for bit)");
    free(extra);

    /* keep_last: steps 4 and 5 with keep_last 2 leave steps 4 and 5 */
    CHECK_OK(ms_interp_checkpoint_save(a, root, 4, NULL, 2));
    CHECK_OK(ms_interp_checkpoint_save(a, root, 5, "null", 2));
    struct stat st;
    char p3[400], p4[400];
    snprintf(p3, sizeof p3, "%s/step_00000003", root);
    snprintf(p4, sizeof p4, "%s/step_00000004", root);
    CHECK(stat(p3, &st) != 0 && stat(p4, &st) == 0, "(keep_last 2: step 3 removed, step 4 kept)");
    extra = (char *)"unset";
    CHECK_OK(ms_interp_checkpoint_load(b, p4, &step, &extra));
    CHECK(step == 4 && extra == NULL, "(a checkpoint without extra: step %lld)", (long long)step);

    /* the errors: no such path (io), not a checkpoint (io), another model (arg) */
    CHECK_ERR(ms_interp_checkpoint_load(b, at("no_such_ckpt"), &step, NULL), MS_ERR_IO, "no_such_ckpt: no such file or directory");
    CHECK_ERR(ms_interp_checkpoint_read(b, dir, &step, NULL), MS_ERR_IO, "holds no checkpoint");
    ms_interp *other = NULL;
    CHECK_OK(ms_interp_new(&other, C1));
    const int64_t w[2] = {8, 7};
    CHECK_OK(ms_interp_model_param(other, "layers.0.weight", 2, w, MS_F32, 1));
    CHECK_OK(ms_interp_plan(other, "dp_shard=1", good, NULL));
    CHECK_OK(ms_interp_materialize(other));
    CHECK_ERR(ms_interp_checkpoint_load(other, root, &step, NULL), MS_ERR_ARG, "layers.0.weight");
    ms_interp_free(other);

    /* a Hugging Face export of the checkpoint, loaded into fresh units: the same bits */
    snprintf(code, sizeof code, "require('moonshard.checkpoint').export_dir('%s', '%s')", root, hf);
    CHECK_OK(ms_interp_exec(a, code));
    ms_interp *c = materialised(9.0f);
    CHECK_ERR(ms_ckpt_load_hf(c, at("no_such_hf")), MS_ERR_IO, "no_such_hf");
    CHECK_OK(ms_ckpt_load_hf(c, hf));
    CHECK(same_shards(a, c), "(load_hf of the export: the checkpoint's bits)");
    ms_interp_free(c);
    ms_interp_free(b);
    ms_interp_free(a);
    snprintf(code, sizeof code, "rm -rf '%s' '%s'", root, hf);
    CHECK(system(code) == 0, "(%s)", code);
}

/* ---------------------------------------------------------------- main */

int main(void) {
    snprintf(dir, sizeof dir, "%s", "/tmp/ms_test_embed_XXXXXX");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    write_file("good.lua", "local M = {}\n"
                           "M.prefetch = { forward = 1, backward = 2 }\n"
                           "local mp = { param_dtype = 'bf16', reduce_dtype = 'f32' }\n"
                           "function M.parallelize(ctx)\n"
                           "  ctx:fully_shard('layers.0', { mp_policy = mp })\n"
                           "  ctx:fully_shard(ctx.model, { mp_policy = mp })\n"
                           "end\n"
                           "return M\n");
    write_file("typecheck.lua", "local M = {}\n"
                                "function M.parallelize(ctx)\n"
                                "  local t = ctx.model:get('layers.0').type\n"
                                "  if t ~= 'MyLayer' then error('layers.0 is a ' .. tostring(t), 0) end\n"
                                "  ctx:fully_shard('layers.0', {})\n"
                                "  ctx:fully_shard(ctx.model, {})\n"
                                "end\n"
                                "return M\n");
    write_file("typecheck_config.lua", "local M = {}\n"
                                       "function M.parallelize(ctx)\n"
                                       "  local t = ctx.model:get('model.layers.0').type\n"
                                       "  error('the policy saw model.layers.0 as a ' .. tostring(t), 0)\n"
                                       "end\n"
                                       "return M\n");
    write_file("unowned.lua", "local M = {}\n"
                              "function M.parallelize(ctx) ctx:fully_shard('layers.0', {}) end\n"
                              "return M\n");
    write_file("badprefetch.lua", "local M = {}\n"
                                  "M.prefetch = { forward = 3, backward = 'x' }\n"
                                  "function M.parallelize(ctx) ctx:fully_shard(ctx.model, {}) end\n"
                                  "return M\n");
    write_file("tableerr.lua", "local M = {}\nfunction M.parallelize(ctx) error({code = 42}) end\nreturn M\n");
    write_file("nilerr.lua", "local M = {}\nfunction M.parallelize(ctx) error() end\nreturn M\n");
    write_file("tostringerr.lua", "local M = {}\nfunction M.parallelize(ctx)\n"
                                  "  error(setmetatable({code = 42}, {__tostring = function(e) "
                                  "return 'policy error ' .. e.code .. ' from __tostring' end}))\n"
                                  "end\nreturn M\n");
    write_file("tostringboom.lua", "local M = {}\nfunction M.parallelize(ctx)\n"
                                   "  error(setmetatable({}, {__tostring = function() error('boom in tostring', 0) end}))\n"
                                   "end\nreturn M\n");
    write_file("bad.json", "{ \"architectures\": [\n");
    write_file("leak.lua", "local util = require 'moonshard.util'\n"
                           "local M = {}\n"
                           "function M.parallelize(ctx) error(util.read_file('/etc/passwd')) end\n"
                           "return M\n");
    write_file("spin.lua", "local M = {}\n"
                           "function M.parallelize(ctx)\n"
                           "  ctx:fully_shard(ctx.model, { shard_placement_fn = function() while true do end end })\n"
                           "end\n"
                           "return M\n");
    write_file("slow.lua", "local M = {}\n"
                           "function M.parallelize(ctx)\n"
                           "  local s = string.rep(string.rep('x', 4096), 4096)\n"
                           "  for _ = 1, 1e9 do local _ = s .. 'y' end\n"
                           "end\n"
                           "return M\n");
    write_file("tamper.lua", "local M = {}\n"
                             "function M.parallelize(ctx)\n"
                             "  ctx:fully_shard('layers.0', {}).params = {}\n"
                             "  ctx:fully_shard(ctx.model, {})\n"
                             "  ctx.units, ctx.owner = {}, {}\n"
                             "end\n"
                             "return M\n");
    write_file("recipe.lua", "return { peft = { target_modules = { 'lm_head' }, dim = 4, alpha = 8, "
                             "lora_A_init = 'uniform' } }\n");
    write_file("badrecipe.lua", "return { peft = { rank = 4 } }\n");
    snprintf(good, sizeof good, "%s", at("good.lua"));
    out_of_memory();
    if (ms_threads_world_new(&W1, 1, 60) || ms_world_comm(W1, 0, &C1)) {
        fprintf(stderr, "world: %s\n", ms_last_error());
        return 1;
    }

    unit_lifetime();
    tied_params();
    lua_errors();
    ignored_calls();
    statuses();
    ep_local_units();
    plan_options();
    hostile_policies();
    plans_agree();
    recipes();
    checkpoints();

    ms_comm_release(C1);
    ms_world_release(W1);
    const char *names[] = {"good.lua", "typecheck.lua", "typecheck_config.lua", "unowned.lua", "badprefetch.lua", "tableerr.lua",
                           "nilerr.lua", "tostringerr.lua", "tostringboom.lua", "bad.json", "leak.lua",
                           "spin.lua", "tamper.lua", "slow.lua", "recipe.lua", "badrecipe.lua"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) unlink(at(names[i]));
    rmdir(dir);
    printf("test_embed: %d passed, %d failed\n", atomic_load(&passed), atomic_load(&failed));
    return atomic_load(&failed) ? 1 : 0;
}
