"""The native layer: the CUDA kernel library through ctypes (``kernels``: its C ABI, configurations, loading) and
the direct NCCL binding over a process group's own communicator (``nccl_direct``)."""
