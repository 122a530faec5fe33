"""nn.Modules for kernels.kernelize (filled in by the Transformers integration)."""
