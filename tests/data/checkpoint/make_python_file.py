# make_python_file.py: python_written.safetensors, written by Python's safetensors, which
# checkpoint_spec.lua reads back with moonshard's reader (header, pread of each tensor,
# CRC32C).  Run in a venv with torch and safetensors: python make_python_file.py
import torch
from safetensors.torch import save_file

a = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8
b = (torch.arange(6, dtype=torch.float32) - 2.5).to(torch.bfloat16).reshape(2, 3)
c = torch.tensor([1, -2, 3], dtype=torch.int64)
save_file({"a": a, "b": b, "c": c}, "python_written.safetensors", metadata={"format": "pt"})
