"""CUDA C++ sources of LMPool kernels; `lmpool.ops` builds and binds them."""
