"""The Llama-family model for paged KV: config, layers, weight loading, GGUF conversion."""
