"""The CPU backend (`backend.CpuBackend`), its compiled kernels and matmul strategies."""
