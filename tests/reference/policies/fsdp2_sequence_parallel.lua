-- fsdp2_sequence_parallel.lua: the shipped fsdp2_default with its tensor-parallel plan's
-- sequence-parallel variant (tests/reference/fsdp2_layouts.py).
return require("fsdp2_default").with{ sequence_parallel = true }
