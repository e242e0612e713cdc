"""The CUDA backend (`backend.CudaBackend`): Triton paged attention, CUDA graphs for decode."""
