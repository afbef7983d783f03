"""ctypes over libmoonshard_embed: an interpreter that plans a described model.

The interpreter runs moonshard's Lua policies in its sandbox. Here it only plans: each
process describes the same model and plans it on the job's mesh; the plan is deterministic,
so every rank gets the same one without talking to the others.
"""
import ctypes
import ctypes.util
import json
import os

# moonshard.h's ms_status, by value
STATUS = ["ok", "invalid_argument", "out_of_memory", "overflow", "shape", "dtype", "device", "mismatch",
          "timeout", "peer_failed", "not_built", "state", "io", "internal"]
# moonshard.h's ms_dtype, by name
DTYPE = {"f32": 0, "f16": 1, "bf16": 2, "f8e4m3": 3, "f8e5m2": 4, "f64": 5, "i64": 6, "i32": 7, "i8": 8,
         "u8": 9, "bool": 10}


class MoonshardError(RuntimeError):
    """A failure moonshard reported: .status is its ms_status name, the message says what and where."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def find_library():
    """The path of libmoonshard_embed: $MOONSHARD_EMBED_LIB, else the repository's build/ (this
    package lives in examples/torch_host/), else the system's (ld.so's search)."""
    env = os.environ.get("MOONSHARD_EMBED_LIB")
    if env:
        if not os.path.exists(env):
            raise MoonshardError("io", "MOONSHARD_EMBED_LIB=%s: no such file" % env)
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.normpath(os.path.join(here, "..", "..", ".."))
    for cand in (os.path.join(repo, "build", "libmoonshard_embed.so"),):
        if os.path.exists(cand):
            return cand
    found = ctypes.util.find_library("moonshard_embed")
    if found:
        return found
    raise MoonshardError("io", "libmoonshard_embed not found: build the repository (its README's first command) or "
                         "set MOONSHARD_EMBED_LIB to the library's path")


_lib = None


def lib():
    """The loaded library, its functions typed (loaded once)."""
    global _lib
    if _lib is not None:
        return _lib
    L = ctypes.CDLL(find_library())
    c_int, c_char_p, c_void_p, c_double, c_int64 = ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_double, \
        ctypes.c_int64
    P = ctypes.POINTER
    sig = {
        "ms_last_error": (c_char_p, []),
        "ms_version": (c_char_p, []),
        "ms_threads_world_new": (c_int, [P(c_void_p), c_int, c_double]),
        "ms_world_comm": (c_int, [c_void_p, c_int, P(c_void_p)]),
        "ms_world_release": (None, [c_void_p]),
        "ms_comm_release": (None, [c_void_p]),
        "ms_interp_new": (c_int, [P(c_void_p), c_void_p]),
        "ms_interp_free": (None, [c_void_p]),
        "ms_interp_model_param": (c_int, [c_void_p, c_char_p, c_int, P(c_int64), c_int, c_int]),
        "ms_interp_model_tie": (c_int, [c_void_p, c_char_p, c_char_p]),
        "ms_interp_model_module_type": (c_int, [c_void_p, c_char_p, c_char_p]),
        "ms_interp_set_option": (c_int, [c_void_p, c_char_p]),
        "ms_interp_set_optimizer": (c_int, [c_void_p, c_char_p]),
        "ms_interp_plan": (c_int, [c_void_p, c_char_p, c_char_p, P(c_int)]),
        "ms_interp_plan_json": (c_int, [c_void_p, P(c_void_p)]),
        "ms_interp_warning_count": (c_int, [c_void_p]),
        "ms_interp_warning": (c_char_p, [c_void_p, c_int]),
    }
    for name, (res, args) in sig.items():
        f = getattr(L, name)
        f.restype, f.argtypes = res, args
    _lib = L
    return L


def _check(status):
    if status:
        L = lib()
        name = STATUS[status] if 0 <= status < len(STATUS) else str(status)
        raise MoonshardError(name, L.ms_last_error().decode("utf-8", "replace"))


class Interp:
    """One moonshard interpreter (a world of one rank: it plans, it moves no data)."""

    def __init__(self):
        L = lib()
        self._world, self._comm, self._in = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(L.ms_threads_world_new(ctypes.byref(self._world), 1, 0.0))
        _check(L.ms_world_comm(self._world, 0, ctypes.byref(self._comm)))
        _check(L.ms_interp_new(ctypes.byref(self._in), self._comm))

    def close(self):
        L = lib()
        if self._in:
            L.ms_interp_free(self._in)
            self._in = ctypes.c_void_p()
        if self._comm:
            L.ms_comm_release(self._comm)
            self._comm = ctypes.c_void_p()
        if self._world:
            L.ms_world_release(self._world)
            self._world = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def add_param(self, fqn, shape, dtype, requires_grad):
        if dtype not in DTYPE:
            raise MoonshardError("dtype", "parameter %s: dtype %s has no moonshard dtype (known: %s)"
                                 % (fqn, dtype, ", ".join(sorted(DTYPE))))
        arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        _check(lib().ms_interp_model_param(self._in, fqn.encode(), len(shape), arr, DTYPE[dtype], int(requires_grad)))

    def tie(self, fqn, target):
        _check(lib().ms_interp_model_tie(self._in, fqn.encode(), target.encode()))

    def module_type(self, name, type_name):
        _check(lib().ms_interp_model_module_type(self._in, name.encode(), type_name.encode()))

    def set_option(self, setting):
        _check(lib().ms_interp_set_option(self._in, setting.encode()))

    def set_optimizer(self, name):
        _check(lib().ms_interp_set_optimizer(self._in, name.encode()))

    def plan(self, mesh, policy):
        units = ctypes.c_int()
        _check(lib().ms_interp_plan(self._in, mesh.encode(), policy.encode(), ctypes.byref(units)))
        return units.value

    def plan_json(self):
        """The plan as a dict (the plan JSON of `moonshard plan --json`)."""
        L = lib()
        out = ctypes.c_void_p()
        _check(L.ms_interp_plan_json(self._in, ctypes.byref(out)))
        try:
            return json.loads(ctypes.string_at(out).decode("utf-8"))
        finally:
            libc = ctypes.CDLL(None)
            libc.free.argtypes = [ctypes.c_void_p]
            libc.free(out)

    def warnings(self):
        L = lib()
        return [L.ms_interp_warning(self._in, i).decode("utf-8", "replace")
                for i in range(L.ms_interp_warning_count(self._in))]
