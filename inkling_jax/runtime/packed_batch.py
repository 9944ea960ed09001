"""A step's host batch as one transfer: every array of a `StepBatch` as 32-bit words in one int32 buffer.

A step brings about twenty small arrays (tokens, spans, lanes, flags, the page table, the sampling columns);
sent one by one, each is its own host-to-device copy and its own argument of the step program. Packed, the
host makes one [replicas, words] buffer (a replica's slots, tokens and lanes in its row, so the buffer splits
by replica as the arrays do) and the step program takes the arrays back out of it by static offsets: bools as
0 / 1 words, float32 and uint32 by their bits, so the values are the host's exactly. The resample program's
`Redraw` (rows, masks and their sampling columns) travels the same way, over one replica.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.step import Redraw, StepBatch

WORD = np.dtype(np.int32)
KINDS = ("bool", "int32", "uint32", "float32")  # what a StepBatch holds


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where each array of a StepBatch lies in the packed buffer: the batch's tree structure and, per leaf in
    its order, the shape on one replica and the dtype's name. Hashable: a static argument of the step."""

    tree: jax.tree_util.PyTreeDef
    leaves: tuple[tuple[tuple[int, ...], str], ...]
    replicas: int

    @classmethod
    def of(cls, batch: StepBatch | Redraw, replicas: int) -> BatchLayout:
        """The layout of a host batch whose arrays split by replica along their first axis."""
        leaves, tree = jax.tree.flatten(batch)
        fields = []
        for leaf in leaves:
            leaf = np.asarray(leaf)
            if leaf.dtype.name not in KINDS or leaf.shape[0] % replicas:
                raise ValueError(f"a {leaf.dtype} array of shape {leaf.shape} does not pack over {replicas} replicas")
            fields.append(((leaf.shape[0] // replicas, *leaf.shape[1:]), leaf.dtype.name))
        return cls(tree, tuple(fields), replicas)

    @property
    def words(self) -> int:
        """A replica's words in the buffer."""
        return sum(int(np.prod(shape)) for shape, _ in self.leaves)

    def pack(self, batch: StepBatch | Redraw) -> np.ndarray:
        """The host batch as [replicas, words] int32 (numpy); ValueError for a batch of another layout."""
        leaves, tree = jax.tree.flatten(batch)
        if tree != self.tree:
            raise ValueError(f"a batch of structure {tree} where the layout has {self.tree}")
        rows = []
        for leaf, (shape, kind) in zip(leaves, self.leaves, strict=True):
            if np.shape(leaf) != (self.replicas * shape[0], *shape[1:]):
                raise ValueError(f"an array of shape {np.shape(leaf)} where the layout has {shape} per replica")
            leaf = np.asarray(leaf, kind).reshape(self.replicas, -1)
            rows.append(leaf.astype(WORD) if kind == "bool" else leaf.view(WORD))
        return np.concatenate(rows, axis=1) if rows else np.zeros((self.replicas, 0), WORD)

    def unpack(self, packed: jax.Array) -> StepBatch | Redraw:
        """The batch a packed [replicas, words] buffer holds (inside the program)."""
        leaves, offset = [], 0
        for shape, kind in self.leaves:
            size = int(np.prod(shape))
            words = packed[:, offset : offset + size].reshape(self.replicas * shape[0], *shape[1:])
            offset += size
            if kind == "bool":
                leaves.append(words != 0)
            elif kind == "int32":
                leaves.append(words)
            else:
                leaves.append(jax.lax.bitcast_convert_type(words, jnp.dtype(kind)))
        return jax.tree.unflatten(self.tree, leaves)
