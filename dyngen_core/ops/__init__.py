"""Ops with a Triton kernel and a torch twin (the skinny matmul, fused element-wise ops), where
the optional Triton kernels run (`triton_support`) and how a CUDA graph is captured
(`graph_capture`): the bottom of the data plane, imported by the model, the KV cache, the
sampler and the runtime."""
