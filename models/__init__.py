"""Pure PyTorch model code: FLUX.2 transformer, Qwen3 text encoder, FLUX.2 VAE, sampling, loading."""
