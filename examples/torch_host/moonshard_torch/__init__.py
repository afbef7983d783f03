"""moonshard_torch: PyTorch as a moonshard host.

A moonshard Lua policy plans a torch nn.Module (described to moonshard's embedding library
through ctypes: names, shapes, dtypes, module types, requires_grad, tied parameters), and
the plan is applied with PyTorch's own FSDP2 API, then checked on every rank.  No compiled
extension: libmoonshard_embed is found by find_library() (MOONSHARD_EMBED_LIB, the
repository's build/, or the system's).
"""
from ._embed import Interp, MoonshardError, find_library
from .host import apply_plan, check_plan, describe, load_plan, model_description, parse_mesh, plan_model

__all__ = ["Interp", "MoonshardError", "find_library", "apply_plan", "check_plan", "describe", "load_plan",
           "model_description", "parse_mesh", "plan_model"]
