"""Which rows and columns of a linear layer's whole weight one tensor-parallel rank holds.

This is the one place that arithmetic lives: `LinearSpec`'s local sizes, the core's weight
loaders (`lmstack.model.weight_loader`) and the quantizers' layers
(`lmstack.model.quantized_linear`) all read a `Shard`.

A weight is [out, in]; a fused projection stacks its parts along out (Llama's qkv_proj: q, k, v;
gate_up_proj: gate, up), and a checkpoint stores them one tensor per part or as one whole tensor.

- "column" (split outputs): rank r keeps rows [r * n / tp, (r + 1) * n / tp) of every part of n
  rows, and its local output is those slices concatenated in part order. Splitting each part,
  not the stacked whole, keeps every rank's q, k and v heads together. Replicated KV heads are
  no exception: the model widens the K / V parts first (`tensor_parallel.expand_kv_heads`).
- "row" (split inputs): rank r keeps input columns [r * in / tp, (r + 1) * in / tp) of every row.
  Its output is a partial sum the model reduces over the tp group, so only rank 0 keeps the
  bias (the others hold zeros) or the sum would add it tp times.
- "replicated", or tp 1: everything.

A degree that does not divide what it splits is a ValueError naming the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lmstack.interfaces import LinearSpec, ParallelHint


@dataclass(frozen=True)
class Part:
    """One output part of a shard: where its rows come from and where they go."""

    index: int  # in the layer's `output_sizes` (the weight loaders' shard id)
    size: int  # the whole part's rows (its checkpoint tensor's first dimension)
    fused_start: int  # its first row in a whole fused tensor (all parts stacked)
    start: int  # the first of its rows this rank keeps
    rows: int  # how many rows this rank keeps
    offset: int  # where they go in the local output

    @property
    def kept(self) -> slice:
        """This rank's rows of the part's whole tensor."""
        return slice(self.start, self.start + self.rows)

    @property
    def local(self) -> slice:
        """Where those rows go in the local weight (or bias)."""
        return slice(self.offset, self.offset + self.rows)


@dataclass(frozen=True)
class Shard:
    """One rank's share of a linear layer; the fields describe the whole layer and the split,
    the properties what this rank keeps. Built from a `LinearSpec` by `Shard.of`."""

    output_sizes: tuple[int, ...]  # rows of each part of the whole layer
    in_features: int  # input columns of the whole layer (0 for a lone bias: it has none)
    parallel: ParallelHint = "replicated"
    tp_rank: int = 0
    tp_size: int = 1
    name: str = ""  # the layer, for error messages

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_sizes", tuple(int(n) for n in self.output_sizes))
        if not self.output_sizes:
            raise ValueError(f"linear {self.name}: no output parts")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"linear {self.name}: tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        split = self.output_sizes if self.splits_rows else (self.in_features,) if self.splits_columns else ()
        bad = [n for n in split if n % self.tp_size]
        if bad:
            dim = "output part" if self.splits_rows else "input size"
            raise ValueError(f"linear {self.name}: {dim} {bad[0]} is not divisible by tp={self.tp_size}")

    @classmethod
    def of(cls, spec: LinearSpec) -> Shard:
        return cls(spec.output_sizes, spec.in_features, spec.parallel, spec.tp_rank, spec.tp_size, spec.name)

    @property
    def splits_rows(self) -> bool:
        """Whether ranks keep different output rows (a column split)."""
        return self.parallel == "column" and self.tp_size > 1

    @property
    def splits_columns(self) -> bool:
        """Whether ranks keep different input columns (a row split)."""
        return self.parallel == "row" and self.tp_size > 1

    @cached_property
    def parts(self) -> tuple[Part, ...]:
        parts, fused_start, offset = [], 0, 0
        for index, size in enumerate(self.output_sizes):
            rows = size // self.tp_size if self.splits_rows else size
            start = self.tp_rank * rows if self.splits_rows else 0
            parts.append(Part(index, size, fused_start, start, rows, offset))
            fused_start, offset = fused_start + size, offset + rows
        return tuple(parts)

    def part(self, index: int) -> Part:
        """Part `index`; ValueError out of range (a loader's shard id the layer does not have)."""
        if not 0 <= index < len(self.output_sizes):
            raise ValueError(f"shard {index} out of range for a linear of {len(self.output_sizes)} parts")
        return self.parts[index]

    @property
    def local_output_sizes(self) -> tuple[int, ...]:
        return tuple(p.rows for p in self.parts)

    @property
    def local_out_features(self) -> int:
        return sum(self.local_output_sizes)

    @property
    def local_in_features(self) -> int:
        return self.in_features // self.tp_size if self.splits_columns else self.in_features

    @property
    def columns(self) -> slice:
        """This rank's input columns of the whole weight."""
        count = self.local_in_features
        start = self.tp_rank * count if self.splits_columns else 0
        return slice(start, start + count)

    def column_slice(self, per: int, unit: str = "units") -> slice:
        """This rank's input columns in units of `per` columns (values per packed byte or word, a
        scale group): the last unit of an unsplit layer may be partial and counts. ValueError
        where a row split's share is not whole units (`unit` names them in the message)."""
        count = self.local_in_features
        if self.splits_columns and count % per:
            raise ValueError(
                f"linear {self.name}: a row split of {self.in_features} inputs over tp={self.tp_size} "
                f"keeps {count} per rank, not a multiple of {per} ({unit})"
            )
        first = self.columns.start // per
        return slice(first, first + -(-count // per))

    @property
    def keeps_bias(self) -> bool:
        """Whether this rank adds the bias (see the module docstring)."""
        return not (self.splits_columns and self.tp_rank != 0)

    def cut(self, value: torch.Tensor, part: Part, per: int = 1) -> torch.Tensor:
        """This rank's rows and input columns of `value`, a whole part's 2-D tensor in rows by
        input columns, `per` columns per value (a view)."""
        return value[part.kept, self.column_slice(per)]
