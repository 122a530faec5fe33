{
  description = "kda-kernels: KDA and Gated DeltaNet kernels (cpu, cuda, metal, neuron) for the Kernel Hub";

  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  # kernel-builder reads build.toml and produces build/<variant>/ for every supported torch/backend.
  # scripts/build.py produces the same layout where Nix is not available (our CI).
  outputs =
    { self, kernel-builder }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}
