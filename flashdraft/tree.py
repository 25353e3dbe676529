"""Token trees: which cache slots a tree node's query may see, and where its rope puts it.

A verification pass over a tree writes its T nodes into consecutive cache slots start ..
start + T - 1, as a chain's would be, but a node's place in the sequence is its depth, not its
slot: node i is read at rope position start + depth(i) and attends to the committed context
(slots < start), its ancestors and itself, never to its siblings' branches. The tree is given
by parent indices (parents[i] < i, so the nodes are in topological order; -1: a child of the
last committed token). A chain, parents = (-1, 0, 1, ...), is exactly the causal pass.

After acceptance the accepted path's keys and values are moved to the slots a chain would
have given them (`KVCache.compact`), so the cache reads as if only that path had been decoded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True, eq=False)
class TreeMask:
    """A token tree's visibility: `from_parents` builds it (and checks the parents)."""

    parents: tuple[int, ...]  # parents[i] < i, or -1 (a child of the last committed token)
    depth: torch.Tensor = field(repr=False)  # [T] int64: 0 for the children of the context
    ancestors: torch.Tensor = field(repr=False)  # [T, T] bool: [i, j] j is i or an ancestor of i
    # [T] int64: ancestors as bit sets (bit j of row i), the fused attention kernel's form;
    # None above 63 nodes
    bits: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_parents(cls, parents: Sequence[int], device: torch.device | str = "cpu") -> "TreeMask":
        parents = tuple(int(p) for p in parents)
        if not parents:
            raise ValueError("a token tree needs at least one node: parents is empty")
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"parents[{i}] = {p}: a node's parent must come before it "
                                 f"(-1 <= parent < {i}; -1: the last committed token), in "
                                 f"parents {list(parents)}")
        n = len(parents)
        depth = [0] * n
        ancestors = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(parents):
            if p >= 0:  # a parent's row is complete before its children's (p < i)
                depth[i] = depth[p] + 1
                ancestors[i] |= ancestors[p]
        bits = None
        if n <= 63:
            bits = (ancestors.long() << torch.arange(n)).sum(1).to(device)
        return cls(parents, torch.tensor(depth, dtype=torch.int64, device=device),
                   ancestors.to(device), bits)

    @property
    def size(self) -> int:
        return len(self.parents)

    def check(self, tokens: torch.Tensor) -> None:
        """That tokens [batch, T] carry one token per node."""
        if tokens.shape[1] != self.size:
            raise ValueError(f"the tree has {self.size} nodes (parents {list(self.parents)}) "
                             f"but {tokens.shape[1]} tokens were given: one token per node")

    def rope_positions(self, slots: torch.Tensor) -> torch.Tensor:
        """Rope positions [batch, T] of the nodes at cache slots [batch, T] (start .. start +
        T - 1): start + depth."""
        return slots[:, :1] + self.depth.to(slots.device)

    def visible(self, slots: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[batch, T, kv_len] bool: whether node i (at slots[:, i], start .. start + T - 1) sees
        cache slot s: every slot before start, and the slots of its ancestors and itself."""
        start = slots[:, :1]  # [batch, 1]
        rel = torch.arange(kv_len, device=slots.device) - start  # [batch, kv_len]: node index
        in_tree = (rel >= 0) & (rel < self.size)
        ancestors = self.ancestors.to(slots.device)  # a no-op where built on that device
        seen = ancestors[:, rel.clamp(0, self.size - 1)].transpose(0, 1)  # [batch, T, kv_len]
        return (rel < 0).unsqueeze(1) | (in_tree.unsqueeze(1) & seen)

    def check_path(self, path: Sequence[int]) -> list[int]:
        """path: node indices from a child of the context down to a node, each the parent of
        the next; returned as a list of ints."""
        path = [int(i) for i in path]
        for j, node in enumerate(path):
            want = path[j - 1] if j else -1
            if not 0 <= node < self.size or self.parents[node] != want:
                parent = "-1 (the committed context)" if j == 0 else want
                raise ValueError(f"path {path} is not a path of the tree (parents "
                                 f"{list(self.parents)}): node {node} at step {j} should be a "
                                 f"child of {parent}")
        return path


def spine_leaves(widths: Sequence[int], k: int) -> tuple[int, ...]:
    """Leaves at depths 1 … k of a spine tree verified with `widths` candidates a depth
    (depths past the list: one, the spine's)."""
    return tuple(max(int(widths[i]) - 1, 0) if i < len(widths) else 0 for i in range(k))


@dataclass(frozen=True, eq=False)
class SpineTree:
    """A draft of a spine d_1 … d_k, each d_i with `leaves[i - 1]` alternatives beside it:
    other candidates for position i, which end there (a leaf has no children). Drafters build
    it from their top candidates a position (a draft model's top-w, DFlash's block logits);
    `verify.spine_tree_greedy` and `verify.SpineTreeVerify` accept its longest path.

    The draft's tokens are [d_1 … d_k, then the leaves depth by depth] (its nodes 0 … T - 1);
    the verification pass runs over [last committed token, nodes] (`mask`: T + 1 tokens, the
    last one its root). A leaf of depth i is a child of d_{i-1} (of the root for i = 1), so
    the target scores it on the row of d_{i-1}, as it scores d_i.
    """

    k: int
    leaves: tuple[int, ...]  # [k]: alternatives at depths 1 … k
    mask: TreeMask = field(repr=False)  # the verification pass's, root included
    # [L] int64: the pass row whose distribution a leaf is a candidate of (its depth - 1)
    leaf_rows: torch.Tensor = field(repr=False)

    @staticmethod
    def parents(k: int, leaves: Sequence[int]) -> list[int]:
        """Parents of the verification pass's tokens: the root (-1), the spine, the leaves."""
        return [-1] + list(range(k)) + [d for d, m in enumerate(leaves) for _ in range(m)]

    @property
    def size(self) -> int:
        """Draft nodes (the root not counted)."""
        return self.mask.size - 1

    def path(self, n: int, leaf: int) -> list[int]:
        """Draft nodes of the accepted path: n spine tokens, then the leaf (-1: none)."""
        return list(range(n)) + ([leaf] if leaf >= 0 else [])


_SPINE_TREES: dict = {}


def spine_tree(k: int, leaves: Sequence[int], device: torch.device | str) -> SpineTree:
    """The SpineTree of k spine tokens with `leaves` alternatives a depth, one object per shape
    and device: CUDA graphs and verifiers key on it."""
    leaves = tuple(int(m) for m in leaves)
    if len(leaves) != k or k < 1 or min(leaves) < 0:
        raise ValueError(f"a spine tree of k = {k} tokens needs k leaf counts >= 0, got "
                         f"{list(leaves)}")
    device = torch.device(device)
    key = (k, leaves, str(device))
    tree = _SPINE_TREES.get(key)
    if tree is None:
        mask = TreeMask.from_parents(SpineTree.parents(k, leaves), device)
        rows = torch.tensor([d for d, m in enumerate(leaves) for _ in range(m)],
                            dtype=torch.int64, device=device)
        tree = _SPINE_TREES[key] = SpineTree(k, leaves, mask, rows)
    return tree


def alternatives(rows: torch.Tensor, chosen: torch.Tensor, leaves: Sequence[int]) -> torch.Tensor:
    """For each row i of rows [r, V], the leaves[i] highest-scoring tokens other than chosen[i]
    (chosen: [r] token ids), best first, row after row: [sum(leaves)] int64, on the rows'
    device (one top-k for all rows)."""
    most = max(leaves)
    candidates = rows.topk(most + 1, dim=-1).indices  # [r, most + 1]
    # Each row's chosen token moved to its end (a stable sort of "is it the chosen one").
    order = torch.argsort((candidates == chosen.view(-1, 1)).int(), dim=-1, stable=True)
    candidates = candidates.gather(1, order)[:, :most].reshape(-1)  # [r * most]
    keep = [i * most + j for i, m in enumerate(leaves) for j in range(m)]
    return candidates.index_select(0, torch.tensor(keep, device=rows.device))
