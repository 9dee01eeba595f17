"""`GGUFLinear`: a linear layer that keeps a GGUF checkpoint's Q4_0 / Q4_1 / Q8_0 blocks.

`weight` holds this rank's rows as uint8 [out, bytes per row] in the file's encoding once the
layer is finalized (`ggml_type` set); a layer whose parts came in any other encoding (F32, F16,
K-quants, parts of different types, a tensor-parallel cut inside a block) is dequantized at load
into `dense` fp32 [out, in] instead, which is what `quant.weights: none` would serve.

The weight loader keeps each part (q, k, v of a fused qkv; gate, up) as it arrives, cut to this
rank's rows (whole rows: GGUF blocks run along a row) and input columns (on block boundaries);
`finalize()`, called by the quantizer after loading, joins them.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor, to_dense
from lmstack.model.quantized_linear import QuantizedLinear
from lmstack_gguf.kernel import (
    KEPT_TYPES,
    NATIVE_MAX_ROWS,
    QK,
    block_bytes,
    block_matmul,
    dequantize_blocks,
    kernel_takes,
    native_kernel,
)


class GGUFLinear(QuantizedLinear):
    def __init__(
        self,
        spec: LinearSpec,
        use_native: bool = True,
        dense_copy: bool = False,
        *,
        int8_activations: bool = False,
        kernel_max_rows: int | None = NATIVE_MAX_ROWS,
        copy_dtype: torch.dtype = torch.float32,
        panels: bool = False,
        copy_min_rows: int | None = None,
    ) -> None:
        """`int8_activations`: the kernel rounds x to int8 per 32-block (`block_matmul`).
        `kernel_max_rows`: the largest batch the kernel takes (None: any; larger ones multiply
        by the dense copy or dequantize). `copy_dtype`: the dense copy's dtype; bfloat16 rounds
        x to bfloat16 for those batches (`GGUFOptions.prefill`). `panels`: batches over
        `kernel_max_rows` multiply by the blocks re-laid out in 16-row panels (int8 activations,
        AVX2 or AVX-512 VNNI: `gguf_matmul_panels`). `copy_min_rows` (with `panels` and
        `dense_copy`): batches from this many rows multiply by the dense copy instead of the
        panels (`prefill: panels+bf16`: a CPU with AMX tiles multiplies large bfloat16 batches
        faster than the int8 panels)."""
        super().__init__(spec)
        self.use_native = use_native
        self.int8_activations = int8_activations
        self.kernel_max_rows = kernel_max_rows
        # Also hold the weight in fp32 for batches the kernel does not take (prefill): no
        # dequantization per call, for 4 more bytes a weight resident.
        self.dense_copy = dense_copy
        self.copy_dtype = copy_dtype
        self.use_panels = panels and int8_activations
        self.copy_min_rows = copy_min_rows if self.use_panels and dense_copy else None
        self.weight = self.loaded_parameter(
            torch.empty(self.out_features, 0, dtype=torch.uint8), self._load_weight
        )
        self.ggml_type: int | None = None
        # fp32 [out, in]: when the blocks are not kept, or as the dense copy.
        self.register_buffer("dense", None)
        # part -> (ggml type, uint8 block rows) or (None, fp32 rows), until finalize().
        self._parts: dict[int, tuple[int | None, torch.Tensor]] = {}
        # (op, its arguments after x, most rows it takes) once finalized with the kernels built:
        # what `forward` calls directly on fp32 rows (`_bind_fast`).
        self._fast: tuple | None = None
        # uint8 panels of the blocks (`panels`) and their kernel, bound by finalize().
        self.panels: torch.Tensor | None = None
        self._panel_matmul = None
        # Panels for every batch and no copy: the blocks are dropped after packing (`rows` reads
        # them back from the panels), so the layer holds 0.75 bytes a weight, not 1.3.
        self.panels_only = False

    # --- loading ------------------------------------------------------------------------------

    @torch.no_grad()
    def _load_weight(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        for part, tensor in self.parts(loaded, shard_id):
            want = (part.size, self.spec.in_features)
            if tuple(tensor.shape) != want:
                raise ValueError(f"expected shape {want}, got {tuple(tensor.shape)}")
            mine, cols = self.kept_rows(tensor, part), self.shard.columns
            kept = isinstance(mine, GGUFTensor) and mine.ggml_type in KEPT_TYPES
            if kept and cols.start % QK == 0 and cols.stop % QK == 0:
                per = block_bytes(int(mine.ggml_type))
                raw = mine.raw()[:, cols.start // QK * per : cols.stop // QK * per]
                self._parts[part.index] = (int(mine.ggml_type), raw.contiguous())
            else:
                self._parts[part.index] = (None, to_dense(mine, torch.float32)[:, cols].contiguous())

    def set_blocks(self, ggml_type: int, blocks: torch.Tensor) -> None:
        """The whole local weight at once, already in blocks (the LM head's table)."""
        if len(self.spec.output_sizes) != 1:
            raise ValueError(f"{self.spec.name}: set_blocks takes a layer of one part")
        self._parts = {0: (int(ggml_type), blocks)}
        self.finalize()

    @torch.no_grad()
    def finalize(self) -> None:
        """Join the loaded parts: one block tensor when every part kept the same type and the
        kernels are built, else one dense fp32 weight."""
        if not self._parts:
            return  # finalized already
        missing = [i for i in range(len(self.spec.output_sizes)) if i not in self._parts]
        if missing:
            raise ValueError(f"{self.spec.name}: weight part(s) {missing} were never loaded")
        parts = [self._parts[i] for i in range(len(self.spec.output_sizes))]
        types = {t for t, _ in parts}
        if len(types) == 1 and None not in types and native_kernel() is not None:
            self.ggml_type = types.pop()
            self.weight.data = torch.cat([rows for _, rows in parts]) if len(parts) > 1 else parts[0][1]
            if self.use_panels and self.use_native:
                ext = native_kernel()
                self.panels = ext.gguf_pack_panels(self.weight.data, self.ggml_type, self.in_features)
                self._panel_matmul = ext.gguf_matmul_panels
            if self.dense_copy and (self.panels is None or self.copy_min_rows is not None):
                self.dense = dequantize_blocks(self.weight.data, self.ggml_type, self.in_features).to(
                    self.copy_dtype
                )
            if self.panels is not None and self.kernel_max_rows == 0 and self.dense is None:
                self.panels_only = True
                self.weight.data = torch.empty(self.out_features, 0, dtype=torch.uint8)
            if self.use_native:
                self._bind_fast()
        else:
            k = self.in_features
            self.dense = torch.cat(
                [rows if t is None else dequantize_blocks(rows, t, k) for t, rows in parts]
            )
            self.weight.data = torch.empty(self.out_features, 0, dtype=torch.uint8)
        self._parts = {}

    def _bind_fast(self) -> None:
        """The decode path, bound once: a module's parameter and buffer lookups and the checks of
        `block_matmul` cost ~30 us a call, three times the kernel's own time for a small layer at
        batch 1. The block kernel up to `kernel_max_rows`; with panels for every batch
        (`kernel_max_rows` 0: an AVX2-only CPU), the panel kernel up to the copy's first row."""
        ext = native_kernel()
        if self.panels is not None and self.kernel_max_rows == 0:
            most = self.copy_min_rows - 1 if self.copy_min_rows and self.dense is not None else sys.maxsize
            self._fast = (ext.gguf_matmul_panels, (self.panels, self.ggml_type, self.out_features), most)
        else:
            op = ext.gguf_matmul_q8 if self.int8_activations else ext.gguf_matmul
            most = sys.maxsize if self.kernel_max_rows is None else self.kernel_max_rows
            self._fast = (op, (self.weight.data, self.ggml_type), most)

    # --- computing ----------------------------------------------------------------------------

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Output rows `ids` of the weight in fp32 (the embedding lookup of a block table)."""
        if self.ggml_type is None:
            return self.dense[ids]
        if self.panels_only:
            blocks = native_kernel().gguf_panel_blocks(self.panels, self.ggml_type, self.in_features, ids)
            return dequantize_blocks(blocks, self.ggml_type, self.in_features)
        return dequantize_blocks(self.weight.data[ids].contiguous(), self.ggml_type, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast, limit = self._fast, self.kernel_max_rows
        if (
            fast is not None
            and x.dim() == 2
            and x.dtype == torch.float32
            and x.stride(1) == 1
            and x.shape[0] <= fast[2]
            and self.bias is None
        ):
            return fast[0](x, *fast[1])  # what the paths below would run, without their checks
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows, copy_from = x2.shape[0], self.copy_min_rows
        if self.panels_only or (
            self.panels is not None
            and x2.dtype == torch.float32
            and rows > (limit or 0)
            and (copy_from is None or self.dense is None or rows < copy_from)
        ):
            x32 = x2 if x2.dtype == torch.float32 and x2.stride(-1) == 1 else x2.float().contiguous()
            out = self._panel_matmul(x32, self.panels, self.ggml_type, self.out_features)
            if self.bias is not None:
                out = out + self.bias
            return out.to(x.dtype).reshape(*lead, self.out_features)
        if self.ggml_type is not None and (
            self.dense is None or kernel_takes(x2, self.use_native, self.kernel_max_rows)
        ):
            out = block_matmul(
                x2,
                self.weight.data,
                self.ggml_type,
                self.in_features,
                self.use_native,
                int8_activations=self.int8_activations,
                max_rows=self.kernel_max_rows,
            )
        elif self.dense.dtype != x.dtype:  # the bfloat16 copy
            out = torch.nn.functional.linear(x2.to(self.dense.dtype), self.dense).to(x.dtype)
        else:
            out = torch.nn.functional.linear(x2, self.dense)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        kind = "dense fp32" if self.ggml_type is None else f"GGML type {self.ggml_type} blocks"
        if self.panels is not None:
            over = f"batches over {self.kernel_max_rows} rows" if self.kernel_max_rows else "every batch"
            kind += f", 16-row panels for {over}"
        if self.ggml_type is not None and self.dense is not None:
            first = self.copy_min_rows if self.panels is not None else (self.kernel_max_rows or 0) + 1
            kind += f", {str(self.dense.dtype).removeprefix('torch.')} copy for batches from {first} rows"
        return f"in={self.in_features}, out={self.out_features}, {kind}"
