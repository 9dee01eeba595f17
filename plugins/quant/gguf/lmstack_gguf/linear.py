"""`GGUFLinear`: a linear layer that keeps a GGUF checkpoint's tensors as stored.

`weight` holds this rank's rows as uint8 [out, bytes per row] in the file's encoding once the
layer is finalized (`ggml_type` set). Q4_0 / Q4_1 / Q8_0 layers take the legacy kernels (block
kernel, panels, dense copies: `GGUFOptions.prefill`). The K-quants and Q5_0 / Q5_1 (`KQ_TYPES`)
and F16 / BF16 matrices (kept in their own dtype, [out, in]) are held as `segments`: runs of
output rows of one type each (Q4_K_M's fused qkv is Q4_K q and k rows, then Q6_K v rows), each
multiplied on its own — decode batches by `kq_matmul_q8`, larger ones dequantized a slab at a
time into a reused buffer — with no dense copy. With panels (`prefill: panels`), a Q5_0 / Q5_1 /
Q4_K / Q5_K / Q6_K segment, and a legacy one beside other types, is held only as 16-row panels
of its blocks' bytes and multiplies every batch by them (`segment_panels`) — the K-quants up to
`kq_max_rows` rows, then slabs rebuilt from the panels, as their blocks would be; several
segments all in panels multiply such batches in one call (`gguf_matmul_panel_segments`); Q2_K / Q3_K
(and Q6_K where AVX2 is the widest code: `panel_types`) keep their blocks. A part in
any other encoding (IQ*, TQ*, ..., or a tensor-parallel cut inside a block) is dequantized at load
into fp32 rows (`dequantized` records the type and the bytes it costs; the quantizer logs it),
which is what `quant.weights: none` would serve; F32 parts stay fp32.

The weight loader keeps each part (q, k, v of a fused qkv; gate, up) as it arrives, cut to this
rank's rows (whole rows: GGUF blocks run along a row) and input columns (on block boundaries);
`finalize()`, called by the quantizer after loading, joins them.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from lmstack.interfaces import LinearSpec
from lmstack.kernels.scratch import reused_buffer
from lmstack.model.checkpoint import CheckpointTensor, GGUFTensor, to_dense
from lmstack.model.quantized_linear import QuantizedLinear
from lmstack_gguf.kernel import (
    F16,
    FLOAT_TYPES,
    KEPT_TYPES,
    KQ_MAX_ROWS,
    KQ_TYPES,
    NATIVE_MAX_ROWS,
    PANEL_KQUANTS,
    SLAB_BYTES,
    block_bytes,
    block_matmul,
    block_values,
    dequant_matmul,
    dequantize_blocks,
    kept_types,
    kernel_takes,
    kq_kernels,
    kq_matmul_q8,
    native_kernel,
    panel_types,
    type_name,
)

LEGACY_TYPES = frozenset(int(t) for t in KEPT_TYPES)


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
        kq_max_rows: int | None = KQ_MAX_ROWS,
        slab_dtype: torch.dtype = torch.float32,
        kq_panels_every_batch: bool = False,
    ) -> None:
        """`int8_activations`: the kernel rounds x to int8 per 32-block (`block_matmul`).
        `kernel_max_rows`: the largest batch the kernel takes (None: any; larger ones multiply
        by the dense copy or dequantize). `copy_dtype`: the dense copy's dtype; bfloat16 rounds
        x to bfloat16 for those batches (`GGUFOptions.prefill`). `panels`: batches over
        `kernel_max_rows` multiply by the blocks re-laid out in 16-row panels (int8 activations,
        AVX2 or AVX-512 VNNI: `gguf_matmul_panels`). `copy_min_rows` (with `panels` and
        `dense_copy`): batches from this many rows multiply by the dense copy instead of the
        panels (`prefill: panels+bf16`: a CPU with AMX tiles multiplies large bfloat16 batches
        faster than the int8 panels). `kq_max_rows`: the largest batch a K-quant / Q5_x segment
        multiplies by `kq_max_rows` (int8 activations; None: any); larger ones, and every batch
        with fp32 activations, dequantize it in slabs of `slab_dtype` (bfloat16 on a
        native-bf16 CPU with int8 activations; a BF16 matrix is then multiplied as it is).
        `kq_panels_every_batch`: a Q4_K / Q5_K / Q6_K segment kept as panels takes them for
        every batch whatever `kq_max_rows` (`kquant_batches: auto` where AVX-512 VNNI runs)."""
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
        self.kq_max_rows = sys.maxsize if kq_max_rows is None else kq_max_rows
        # The same limit for the K-quant segments kept as panels.
        self.kq_panel_max_rows = sys.maxsize if kq_panels_every_batch else self.kq_max_rows
        self.slab_dtype = slab_dtype
        # (ggml type or None for fp32 rows, rows in the type's layout) per run of output rows of
        # one type: every kept layer that is not a legacy one (module docstring).
        self.segments: list[tuple[int | None, torch.Tensor]] | None = None
        # Per segment: its rows where it is held as 16-row panels (`panels`: Q5_0 / Q5_1 / Q4_K /
        # Q5_K / Q6_K, and a legacy type beside other types), else None (rows in the type's layout).
        self.segment_panels: list[int | None] = []
        # GGML type name -> bytes the parts of that type dequantized at load cost over the file's.
        self.dequantized: dict[str, int] = {}
        self._dense_from: dict[int, tuple[str, int]] = {}  # part -> (type name, file bytes), until finalize

    # --- loading ------------------------------------------------------------------------------

    @torch.no_grad()
    def _load_weight(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None) -> None:
        keep = kept_types()
        for part, tensor in self.parts(loaded, shard_id):
            want = (part.size, self.spec.in_features)
            if tuple(tensor.shape) != want:
                raise ValueError(f"expected shape {want}, got {tuple(tensor.shape)}")
            mine, cols = self.kept_rows(tensor, part), self.shard.columns
            if isinstance(mine, GGUFTensor):
                t, per = int(mine.ggml_type), block_values(int(mine.ggml_type))
                if t in keep and cols.start % per == 0 and cols.stop % per == 0:
                    size = block_bytes(t)
                    raw = mine.raw()[:, cols.start // per * size : cols.stop // per * size].contiguous()
                    if t in FLOAT_TYPES:  # an F16 / BF16 matrix: its own dtype, [rows, cols]
                        raw = raw.view(FLOAT_TYPES[t])
                    self._parts[part.index] = (t, raw)
                    continue
                if mine.ggml_type.name != "F32":
                    name = mine.ggml_type.name + (" (cut inside a block)" if t in keep else "")
                    share = (cols.stop - cols.start) / want[1]
                    self._dense_from[part.index] = (name, int(mine.data.nbytes * share))
            self._parts[part.index] = (None, to_dense(mine, torch.float32)[:, cols].contiguous())

    def set_blocks(self, ggml_type: int, blocks: torch.Tensor) -> None:
        """The whole local weight at once, already in blocks (the LM head's table)."""
        if len(self.spec.output_sizes) != 1:
            raise ValueError(f"{self.spec.name}: set_blocks takes a layer of one part")
        self._parts = {0: (int(ggml_type), blocks)}
        self.finalize()

    @torch.no_grad()
    def finalize(self) -> None:
        """Join the loaded parts: one block tensor when every part kept the same legacy type,
        `segments` when the parts keep other types (or several), else one dense fp32 weight
        (every part dequantized, or the kernels not built)."""
        if not self._parts:
            return  # finalized already
        missing = [i for i in range(len(self.spec.output_sizes)) if i not in self._parts]
        if missing:
            raise ValueError(f"{self.spec.name}: weight part(s) {missing} were never loaded")
        parts = [self._parts[i] for i in range(len(self.spec.output_sizes))]
        types = {t for t, _ in parts}
        built = native_kernel() is not None
        if built and len(types) == 1 and types <= LEGACY_TYPES:
            self._finalize_legacy(types.pop(), parts)
        elif built and types != {None}:
            self._finalize_segments(parts)
        else:
            k = self.in_features
            for i, (t, rows) in enumerate(parts):
                if t is not None:  # kept at load, but the kernels did not build
                    self._dense_from[i] = (type_name(t), rows.nbytes)
            self.dense = torch.cat(
                [rows if t is None else dequantize_blocks(rows, t, k) for t, rows in parts]
            )
            self.weight.data = torch.empty(self.out_features, 0, dtype=torch.uint8)
        for i, (name, file_bytes) in self._dense_from.items():
            dense_bytes = parts[i][1].shape[0] * self.in_features * 4
            self.dequantized[name] = self.dequantized.get(name, 0) + dense_bytes - file_bytes
        self._dense_from = {}
        self._parts = {}

    def _finalize_legacy(self, ggml_type: int, parts: list) -> None:
        """Q4_0 / Q4_1 / Q8_0: the blocks, and the panels or dense copy `prefill` asks for."""
        self.ggml_type = ggml_type
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

    def _finalize_segments(self, parts: list) -> None:
        """Runs of consecutive parts of one type joined into segments; one segment is also
        `weight` (and `ggml_type` its type), several leave `weight` empty."""
        runs: list[tuple[int | None, list[torch.Tensor]]] = []
        for t, rows in parts:
            if runs and runs[-1][0] == t:
                runs[-1][1].append(rows)
            else:
                runs.append((t, [rows]))
        self.segments = [(t, torch.cat(rows) if len(rows) > 1 else rows[0]) for t, rows in runs]
        # With panels (int8 activations, AVX2 / AVX-512 VNNI), a segment of a panel type keeps only
        # its panels (the blocks' bytes re-laid) and multiplies every batch by them: one-row
        # decode and prefill alike, every row computed alike whatever the batch.
        self.segment_panels = [None] * len(self.segments)
        ext = native_kernel()
        if self.use_panels and self.use_native and ext is not None and ext.best_isa() >= 1:
            kinds = panel_types(ext.best_isa())
            for i, (t, w) in enumerate(self.segments):
                if t in kinds:
                    self.segments[i] = (t, ext.gguf_pack_panels(w, t, self.in_features))
                    self.segment_panels[i] = w.shape[0]
        if len(self.segments) == 1:
            t, w = self.segments[0]
            self.ggml_type = t
            if self.segment_panels[0] is not None:
                self.weight.data = torch.empty(self.out_features, 0, dtype=torch.uint8)
                most = self.kq_panel_max_rows if t in PANEL_KQUANTS else sys.maxsize
                self._fast = (ext.gguf_matmul_panels, (w, t, self.out_features), most)
                return
            self.weight.data = w
            if t in KQ_TYPES and self.int8_activations and self.use_native:
                ext = kq_kernels()
                op = ext.kq_matmul_q8 if ext is not None else kq_matmul_q8
                self._fast = (op, (self.weight.data, t), self.kq_max_rows)
        else:
            self.weight.data = torch.empty(self.out_features, 0, dtype=torch.uint8)
            self._bind_segments_fast(ext)

    def _bind_segments_fast(self, ext) -> None:
        """Several segments, every one in panels: batches up to the smallest segment limit (a
        K-quant's `kq_max_rows`) take one native call — x rounded to int8 once, one parallel
        region over every segment's panels, one output — the bits of `_segment_matmul` per segment
        joined, without its per-segment calls and join (SmolLM2's Q5_0 + Q8_0 qkv at batch 1, one
        thread: 12.9 us a call, 25 us by the segments)."""
        held = self.segment_panels
        if ext is None or None in held or not hasattr(ext, "gguf_matmul_panel_segments"):
            return  # a segment keeps its blocks, or an extension built before the op
        types = [t for t, _ in self.segments]
        most = min(self.kq_panel_max_rows if t in PANEL_KQUANTS else sys.maxsize for t in types)
        packed = [w for _, w in self.segments]
        self._fast = (ext.gguf_matmul_panel_segments, (packed, types, list(held)), most)

    def _segment_matmul(
        self, x: torch.Tensor, t: int | None, w: torch.Tensor, panel_rows: int | None = None
    ) -> torch.Tensor:
        """fp32 x [M, in] times one segment's rows -> fp32 [M, rows] (`panel_rows`: w is the
        panels of that many rows)."""
        if t is None:
            return F.linear(x, w)
        if panel_rows is not None:
            if t in PANEL_KQUANTS and x.shape[0] > self.kq_panel_max_rows:
                return self._panel_slabs(x, t, w, panel_rows)
            return native_kernel().gguf_matmul_panels(
                x if x.stride(-1) == 1 else x.contiguous(), w, t, panel_rows
            )
        k = self.in_features
        if t in LEGACY_TYPES:
            return block_matmul(
                x, w, t, k, self.use_native, int8_activations=self.int8_activations, max_rows=NATIVE_MAX_ROWS
            )
        if t in KQ_TYPES and self.int8_activations and self.use_native and x.shape[0] <= self.kq_max_rows:
            return kq_matmul_q8(x if x.stride(-1) == 1 else x.contiguous(), w, t)
        if w.dtype == torch.bfloat16 and self.slab_dtype == torch.bfloat16:
            return F.linear(x.to(torch.bfloat16), w).float()
        # F16 is widened to fp32 (bfloat16 would round its mantissa).
        dtype = torch.float32 if t == F16 else self.slab_dtype
        return dequant_matmul(x.to(dtype), w, t, k).float()

    def _panel_slabs(self, x: torch.Tensor, t: int, packed: torch.Tensor, n: int) -> torch.Tensor:
        """x @ W^T for a K-quant kept as panels, `SLAB_BYTES` of fp32 rows at a time rebuilt in
        `slab_dtype` (the blocks' values bit for bit, as `dequant_matmul` rebuilds blocks)."""
        k, ext = self.in_features, native_kernel()
        xs = x.to(self.slab_dtype)
        step = min(n, max(1, SLAB_BYTES // (4 * k)))
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for r in range(0, n, step):
            rows = min(step, n - r)
            slab = ext.kq_panel_dequantize(packed, t, k, r, r + rows, reused_buffer(rows, k, self.slab_dtype))
            out[:, r : r + rows] = F.linear(xs, slab)
        return out

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
        if self.segments is not None:
            return self._segment_rows(ids)
        if self.ggml_type is None:
            return self.dense[ids]
        if self.panels_only:
            blocks = native_kernel().gguf_panel_blocks(self.panels, self.ggml_type, self.in_features, ids)
            return dequantize_blocks(blocks, self.ggml_type, self.in_features)
        return dequantize_blocks(self.weight.data[ids].contiguous(), self.ggml_type, self.in_features)

    def fast_op(self) -> tuple | None:
        """(op, most rows): the bound kernel `forward` calls for fp32 rows [M, in] with a
        contiguous last dim, up to that many rows (a decoder's fast path calls it directly,
        `lmstack.model.fast_layers`); None where forward has no such path."""
        if self._fast is None or self.bias is not None:
            return None
        op, args, most = self._fast
        return (lambda x: op(x, *args)), most

    def _panels_avx512(self, op_name: str) -> tuple | None:
        """(the native op `op_name`, the panel kernel's arguments after x, most rows) where
        `fast_op` is one weight's panel kernel with AVX-512 VNNI (the fused variants'
        condition), else None."""
        ext = native_kernel()
        if (
            self._fast is None
            or self.bias is not None
            or ext is None
            or self._fast[0] is not getattr(ext, "gguf_matmul_panels", None)
            or ext.best_isa() < 2
            or not hasattr(ext, op_name)
        ):
            return None
        return getattr(ext, op_name), self._fast[1], self._fast[2]

    def fast_add_op(self) -> tuple | None:
        """(op, most rows): op(x, out) adds x @ W^T into the fp32 [M, out] tensor `out` in place
        and returns it, the products added as the kernel's tiles store them
        (`gguf_matmul_panels_add_`: a residual stream without a product tensor written and read
        back); bit for bit `fast_op`'s output then torch's `add_`. None where `fast_op` is not one
        weight's panels with AVX-512 VNNI."""
        found = self._panels_avx512("gguf_matmul_panels_add_")
        if found is None:
            return None
        op, (packed, ggml_type, n), most = found
        return (lambda x, out: op(x, packed, ggml_type, n, out)), most

    def fast_swiglu_op(self) -> tuple | None:
        """(op, most rows) for a SwiGLU gate_up layer (two equal output parts, gate then up):
        silu(gate) * up -> fp32 [M, out / 2] in one native call, the gate and up products
        combined in the kernel's tiles instead of written whole and read back
        (`gguf_matmul_panels_swiglu`); bit for bit `fast_op`'s output put through
        `layer_ops.silu_mul`. None unless the layer multiplies every batch its fast path takes
        by one weight's panels with AVX-512 VNNI and each half is a multiple of 16 rows."""
        found = self._panels_avx512("gguf_matmul_panels_swiglu")
        sizes = self.spec.output_sizes
        if found is None or len(sizes) != 2 or sizes[0] != sizes[1] or sizes[0] % 16:
            return None
        op, (packed, ggml_type, n), most = found
        return (lambda x: op(x, packed, ggml_type, n)), most

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
        if self.segments is not None:
            x32 = x2.float()
            outs = [
                self._segment_matmul(x32, t, w, n) for (t, w), n in zip(self.segments, self.segment_panels)
            ]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
            if self.bias is not None:
                out = out + self.bias
            return out.to(x.dtype).reshape(*lead, self.out_features)
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

    def _segment_rows(self, ids: torch.Tensor) -> torch.Tensor:
        k, first = self.in_features, 0
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        for (t, w), panel_rows in zip(self.segments, self.segment_panels):
            n = w.shape[0] if panel_rows is None else panel_rows
            sel = (ids >= first) & (ids < first + n)
            if panel_rows is not None:  # the blocks back from the panels, byte for byte
                picked = native_kernel().gguf_panel_blocks(w, t, k, ids[sel] - first)
            else:
                picked = w[ids[sel] - first].contiguous()
            out[sel] = picked if t is None else dequantize_blocks(picked, t, k)
            first += n
        return out

    def extra_repr(self) -> str:
        if self.segments is not None:
            runs = ", ".join(
                f"{n} rows {type_name(t)} in 16-row panels"
                if n is not None
                else f"{w.shape[0]} rows {'fp32' if t is None else type_name(t)}"
                for (t, w), n in zip(self.segments, self.segment_panels)
            )
            return f"in={self.in_features}, out={self.out_features}, {runs} (no copy)"
        kind = "dense fp32" if self.ggml_type is None else f"GGML type {self.ggml_type} blocks"
        if self.panels is not None:
            over = f"batches over {self.kernel_max_rows} rows" if self.kernel_max_rows else "every batch"
            kind += f", 16-row panels for {over}"
        if self.ggml_type is not None and self.dense is not None:
            first = self.copy_min_rows if self.panels is not None else (self.kernel_max_rows or 0) + 1
            kind += f", {str(self.dense.dtype).removeprefix('torch.')} copy for batches from {first} rows"
        return f"in={self.in_features}, out={self.out_features}, {kind}"
