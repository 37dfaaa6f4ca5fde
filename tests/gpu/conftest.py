"""tests/gpu: the engine on CUDA against the same model in GPU memory. Every test passes
``device="cuda"`` explicitly (the suite's conftest sets INFINITY_DEVICE=cpu for the CPU tests).

cuBLAS needs a fixed workspace configuration before its first use for deterministic results
(``torch.use_deterministic_algorithms``); it is set here, before any CUDA work."""
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
