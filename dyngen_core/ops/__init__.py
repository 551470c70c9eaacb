"""Ops with a Triton kernel and a torch twin (the skinny matmul, fused element-wise ops), and
where the optional Triton kernels run (`triton_support`): the bottom of the data plane, imported
by the model, the KV cache and the sampler."""
