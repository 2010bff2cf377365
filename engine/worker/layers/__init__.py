"""Building blocks the model files compose: linear layers that own their weight loading, norms, rotary
embeddings, activations and the attention module."""
