"""The GPU backends: fused Triton kernels (`kernels`), weight-only quantization (`quant`, with
the int4 tensor-core kernel `mma`), the decode megakernel (`megakernel`), CUDA-graph replay
(`cuda_graphs`) and the product kernel's tuning (`tune`). Each has a PyTorch path that the CPU
runs and the tests compare against."""
