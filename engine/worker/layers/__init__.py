"""Building blocks the model files compose: linear layers that own their weight loading (and a `LinearMethod`
each for their weights' layout and matmul), norms, rotary embeddings, activations (`CustomOp`s: native,
Triton or C++ implementations) and the attention module, all choosing their kernels once from a
`KernelConfig`."""
