"""Decoding ahead: what a verify asks once the target has already decoded tokens past the caller's context.

A session's verifier does not idle between verifies: while the caller drafts (or while its answer travels), the
engine decodes the target's own next tokens ("ahead" tokens; they are what target-only decoding would emit: the
argmax, a seeded session's seeded draw, an unseeded one's draw from p; with batch-invariant numerics from the same
numbers a verify forward would compute). Which sessions may: verifier_service/decode_ahead.py. When the next verify
arrives, its drafts are first checked against those tokens, on plain ints:

* a draft that differs from the ahead token at its position is rejected, and the ahead token is the target's token
  there: the verdict needs no forward at all (also when the drafts run out before the ahead tokens do);
* drafts equal to every ahead token are accepted, and only the drafts below them still need the target: they are
  verified in a forward as usual, from the last ahead token (which becomes the pending token).

Trees work the same way: the ahead tokens pick a path down the tree (the first child with the ahead token at each
depth), and what is left to verify is the subtree under the end of that path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.spec.tree import ROOT, chain_parents, children


@dataclass(frozen=True)
class AheadMatch:
    path: list[int]                 # request node indices whose tokens equal the ahead tokens, root down
    resolved: bool                  # the verdict is known without a forward
    rest_ids: list[int]             # (not resolved) the drafts below `path`, still to verify; may be empty
    rest_parents: list[int] | None  # their tree (None: a chain, as the request was)
    rest_indices: list[int]         # rest node i -> its index in the request


def match_ahead(ahead_ids: Sequence[int], draft_ids: Sequence[int], parents: Sequence[int] | None) -> AheadMatch:
    """ahead_ids: the target's own tokens after the caller's context (at least one); draft_ids / parents:
    the verify's drafts (parents None = a chain)."""
    tree = list(parents) if parents is not None else chain_parents(len(draft_ids))
    node, path = ROOT, list[int]()
    for token in ahead_ids:
        hit = next((c for c in children(tree, node) if draft_ids[c] == token), None)
        if hit is None:                 # a draft rejected here, or no draft left: the ahead token is the verdict
            return AheadMatch(path, True, [], None, [])
        path.append(hit)
        node = hit
    rest = subtree(tree, node)
    new_index = {old: new for new, old in enumerate(rest)}
    rest_parents = [ROOT if tree[i] == node else new_index[tree[i]] for i in rest]
    return AheadMatch(path, False, [draft_ids[i] for i in rest], None if parents is None else rest_parents, rest)


def agrees_with_guesses(ahead_ids: Sequence[int], draft_ids: Sequence[int], parents: Sequence[int] | None,
                        guesses: Sequence[int]) -> bool:
    """Whether a step decoding ahead past `ahead_ids` with these prompt-lookup `guesses` (for the tokens it decodes)
    agrees with a verify's chain of drafts where both go: then the step's tokens settle the verify (a guess the
    target rejects rejects the draft at that position too) or verify its first drafts. Trees are not judged."""
    if not guesses or parents is not None or list(draft_ids[:len(ahead_ids)]) != list(ahead_ids):
        return False
    rest = draft_ids[len(ahead_ids):]                # the drafts for the tokens the step decodes
    n = min(len(rest), len(guesses))
    return n > 0 and list(rest[:n]) == list(guesses[:n])


def subtree(parents: Sequence[int], node: int) -> list[int]:
    """The descendants of `node` (not itself), in index order (so still topological)."""
    inside, out = {node}, []
    for i in range(node + 1, len(parents)):
        if parents[i] in inside:
            inside.add(i)
            out.append(i)
    return out
