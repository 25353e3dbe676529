"""Weight-only quantization of the model's linear layers: int8 per channel, int4 in groups of 128.

Decoding one sequence reads every weight once per step and does two flops per weight, so its
time is bytes of weights over memory bandwidth: int8 halves it against bf16, int4 quarters it
(plus one scale and one zero per 128 weights). Activations stay bf16/fp16; weights are
dequantized inside the matrix product, tile by tile, never materialised.

Formats (one place, shared by every path):
- int8: q [out, in] int8, symmetric per output channel: w ≈ q * scale[out].
- int4: asymmetric per group of 128 inputs, as in gpt-fast / torch's tinygemm:
  w ≈ (q - 8) * scale[g, out] + zero[g, out], q in [0, 15]. Stored packed as uint8
  [in / 2, out]: within each group of 128 inputs, byte i holds input i (low nibble) and input
  i + 64 (high nibble), so a kernel reads both halves of a group with contiguous loads.
  scale and zero are bf16.

Paths, chosen per layer at run time (`QuantLinear.backend`):
- "reference": dequantize the whole weight in PyTorch, then F.linear. Works everywhere (CPU);
  the definition the fast paths are tested against.
- "triton": `kernels.skinny_quant_kernel` for up to 64 rows: the bf16 products' kernel with
  the weights dequantized in registers for the tensor cores (int4: a bit-or makes each code a
  float, then (q - 8) · s + z in paired FMAs; see `kernels.quant_linear`), K
  split by the weight's shape alone, the slices added by the last program of a tile;
  batch-invariant, so quantized speculative decoding returns the tokens of quantized plain
  decoding. More rows (prefill) dequantize the weight and use cuBLAS.
- "mma" (int4, bfloat16 only): `flashdraft.backends.mma`, a CUDA kernel compiled at run time
  (NVRTC) for up to 32 rows, with the weights shuffled at load into the tensor-core operand
  layout so each thread turns 32 weights into operands from one 16-byte load;
  batch-invariant. Stores only that layout (prefill dequantizes it with a second kernel, then
  cuBLAS).
`quantize_model(..., backend="auto")` picks mma for bfloat16 int4 on CUDA where NVRTC serves,
else triton on CUDA when Triton imports, else reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import KernelConfig
from . import kernels, mma
from .formats import (GROUP, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8,
                      unpack_int4)

triton = kernels.triton  # None where Triton is not installed: the reference path serves

MODES = ("int8", "int4")
BACKENDS = ("auto", "reference", "triton", "mma")


# -- the Triton path ---------------------------------------------------------------------------

def triton_matmul(x: torch.Tensor, layer: "QuantLinear", cfg=None) -> torch.Tensor:
    """x [M, K] (M <= kernels.QUANT_MAX_ROWS, contiguous rows) -> x @ W^T + bias [M, N] in x's
    dtype, through `kernels.skinny_quant_kernel` (launch parameters cfg, else
    `kernels.quant_config`'s)."""
    return kernels.quant_linear(x, layer.qweight, layer.scale, layer.zero, layer.bias,
                                layer.out_features, cfg, layer.kernel_config)


# -- the layer ----------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """A drop-in for nn.Linear with weight-only int8 or int4 weights."""

    def __init__(self, linear: nn.Linear, mode: str, backend: str = "auto",
                 gate_up: bool = False, kernel_config: KernelConfig = kernels.DEFAULT):
        """gate_up: the layer is an MLP's [gate; up] product, whose SiLU(gate) · up
        `forward_gated` may compute in the product's kernel (mma: rows stored interleaved).
        kernel_config: the model's (`Transformer.kernel_config`)."""
        super().__init__()
        self.kernel_config = kernel_config
        if mode not in MODES:
            raise ValueError(f"quantization {mode!r} is not one of {', '.join(MODES)}")
        if backend not in BACKENDS:
            raise ValueError(f"quantization backend {backend!r} is not one of "
                             f"{', '.join(BACKENDS)}")
        w = linear.weight.detach()
        self.mode, self.in_features, self.out_features = mode, w.shape[1], w.shape[0]
        self.gated_layout = False
        self.dtype = w.dtype
        if mode == "int4" and self.in_features % GROUP:
            raise ValueError(f"int4 needs input features in multiples of {GROUP}; this layer "
                             f"has {self.in_features}: use int8 for this model")
        backend = self._backend(backend, w)
        with torch.no_grad():
            if mode == "int8":
                q, scale = quantize_int8(w)
                # Stored [in, out] so that a kernel's loads run along out (coalesced).
                self.register_buffer("qweight", q.t().contiguous())  # [in, out] int8
                self.register_buffer("scale", scale)  # [out] float32
                self.zero = None
            elif backend == "mma":  # only the kernel's own layout (see flashdraft.backends.mma)
                # [gate; up] rows in the gated kernel's order (mma.gate_up_order)
                self.gated_layout = gate_up and linear.bias is None
                rows = (mma.gate_up_order(self.out_features, w.device) if self.gated_layout
                        else slice(None))
                qweight, scales = mma.pack_int4(*quantize_int4(w[rows]))
                self.register_buffer("qweight", qweight)  # [out/16, in/128, 2, 32, 4] int32
                self.register_buffer("scale", scales)  # [out/16, in/128, 8, 2] int32
                self.zero = None
            else:
                packed, scale, zero = quantize_int4(w)
                self.register_buffer("qweight", packed)  # [in/2, out] uint8
                self.register_buffer("scale", scale)  # [in/128, out] bf16
                self.register_buffer("zero", zero)  # [in/128, out] bf16
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)
        self.backend = backend

    def _backend(self, backend: str, w: torch.Tensor) -> str:
        """backend, with "auto" resolved and the choice checked against this layer."""
        if backend == "auto":
            # The kernels walk K in whole blocks of 128.
            fast = self.kernel_config.backend == "triton"  # "torch": the reference path
            if (fast and self.mode == "int4" and self.out_features % 16 == 0
                    and mma.unavailable(w.device, w.dtype) is None):
                return "mma"
            fits = fast and triton is not None and w.is_cuda and self.in_features % GROUP == 0
            return "triton" if fits else "reference"
        if backend == "triton" and (triton is None or not w.is_cuda or self.in_features % GROUP):
            raise ValueError(f"the triton quantization backend needs CUDA, Triton and input "
                             f"features in multiples of {GROUP} (this layer: {self.in_features}); "
                             f"use backend='reference' or 'auto'")
        if backend == "mma":
            why = mma.unavailable(w.device, w.dtype)
            if why is None and (self.mode != "int4" or self.out_features % 16):
                why = "it is int4 with output features in multiples of 16 only"
            if why:
                raise ValueError(f"the mma quantization backend cannot serve this {self.mode} "
                                 f"layer ({self.in_features} -> {self.out_features}, {w.dtype}, "
                                 f"{w.device}): {why}; use backend='auto'")
        return backend

    def dequantized(self, dtype=None) -> torch.Tensor:
        """The weight the layer computes with, [out, in]."""
        dtype = dtype or self.dtype
        if self.mode == "int8":
            return dequantize_int8(self.qweight.t(), self.scale, dtype)
        if self.backend == "mma":
            w = mma.dequantize(self.qweight, self.scale, self.out_features, self.in_features)
            return self._stored_to_true(w, 0).to(dtype)
        return dequantize_int4(self.qweight, self.scale, self.zero, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        if self.backend == "mma":
            if rows <= mma.MAX_ROWS:
                y = mma.linear(x2, self.qweight, self.scale, self.bias, self.out_features,
                               kc=self.kernel_config)
            else:  # prefill, as below, with the weight in its stored row order
                w = mma.dequantize(self.qweight, self.scale, self.out_features, self.in_features)
                y = F.linear(x2, w.to(x.dtype), self.bias)
            y = self._stored_to_true(y, -1)
        elif self.backend == "reference" or rows > kernels.QUANT_MAX_ROWS:
            # Prefill: compute-bound, so dequantizing the weight once is cheap next to it.
            y = F.linear(x2, self.dequantized(x.dtype), self.bias)
        else:  # the bias is added inside the kernel
            y = triton_matmul(x2.contiguous(), self)
        return y.reshape(*shape[:-1], self.out_features)

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) · up of self(x) = [gate, up]: [..., out / 2]; in the product's own kernel
        where the rows are stored for it (mma, up to mma.MAX_ROWS rows)."""
        x2 = x.reshape(-1, x.shape[-1])
        if self.gated_layout and x2.shape[0] <= mma.MAX_ROWS:
            y = mma.linear(x2, self.qweight, self.scale, None, self.out_features, gated=True,
                           kc=self.kernel_config)
            return y.reshape(*x.shape[:-1], self.out_features // 2)
        return kernels.silu_mul(self(x), self.kernel_config)

    def _stored_to_true(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """t indexed by stored output row along dim -> by the layer's output feature."""
        if not self.gated_layout:
            return t
        return t.index_select(dim, mma.gate_up_order(self.out_features, t.device, inverse=True))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.mode}, backend={self.backend}"


def quantize_linear(name: str, linear: nn.Linear, mode: str, backend: str = "auto",
                    kernel_config: KernelConfig = kernels.DEFAULT) -> "QuantLinear":
    """The QuantLinear replacing the model's Linear `name` (an MLP's [gate; up] product,
    `w_gate_up`, is stored for the gated kernel). A tied LM head gets its own quantized copy."""
    return QuantLinear(linear, mode, backend, gate_up=name.rpartition(".")[2] == "w_gate_up",
                       kernel_config=kernel_config)


def quantize_model(model: nn.Module, mode: str, backend: str = "auto",
                   include_lm_head: bool = True) -> nn.Module:
    """Replace the model's nn.Linear layers by QuantLinear, in place; returns the model.

    Run after loading (bf16/fp16 checkpoints, or GGUF dequantized at load) a model whose norms
    are not folded (`Transformer.fold_norms`; load_model folds unquantized models unless asked
    not to, `load_model(..., fold_norms=False)`). Embeddings and
    norms stay as they are. A tied LM head gets its own quantized copy; the embedding table
    keeps its full-precision weights.
    """
    if mode not in MODES:
        raise ValueError(f"quantization {mode!r} is not one of {', '.join(MODES)}")
    if getattr(model, "norms_folded", False):
        raise ValueError("this model's RMSNorm weights are folded into its products (load_model "
                         "folds unquantized models), which would change what int4/int8 round; "
                         "quantize as it loads (load_model(..., quantization=...), "
                         "LLM(..., quantization=...)) or, to pick a backend, load it unfolded "
                         "(load_model(..., fold_norms=False))")
    # Names first, modules one at a time: each full-precision weight is freed as soon as its
    # replacement exists, so the peak is the model plus one layer, not two models.
    targets = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)
               and (include_lm_head or name != "lm_head")]
    for name in targets:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name,
                quantize_linear(name, getattr(parent, child_name), mode, backend,
                                getattr(model, "kernel_config", kernels.DEFAULT)))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads for the model's matrices (embedding rows excluded: one row a
    token), counting what each layer actually reads: quantized weights with their scales."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            tensors = ([module.qweight, module.scale]
                       + ([module.zero] if module.zero is not None else []))
            total += sum(t.numel() * t.element_size() for t in tensors)
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        if isinstance(module, (nn.Linear, QuantLinear)) and module.bias is not None:
            total += module.bias.numel() * module.bias.element_size()
    return total


@torch.no_grad()
def quality_report(reference_logits: torch.Tensor, quant_logits: torch.Tensor,
                   tokens: torch.Tensor) -> dict:
    """Logit error and perplexity of a quantized model against its unquantized self.

    *_logits: [1, T, vocab] over tokens [1, T]; perplexity scores tokens 1 … T-1.
    """
    ref, q = reference_logits.float(), quant_logits.float()
    rel = ((q - ref).norm() / ref.norm()).item()
    targets = tokens[0, 1:]
    ppl = lambda lg: torch.exp(F.cross_entropy(lg[0, :-1], targets)).item()
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"logit_rel_error": rel, "logit_max_abs_error": (q - ref).abs().max().item(),
            "top1_agreement": agree, "ppl_reference": ppl(ref), "ppl_quantized": ppl(q)}
