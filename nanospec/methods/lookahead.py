"""Lookahead (Zhao et al., Ant Group, 2023): training-free multi-branch drafts from a token trie.

Spec: Yao Zhao, Zhitian Xie, Chen Liang, Chenyi Zhuang, Jinjie Gu, "Lookahead: An Inference Acceleration
Framework for Large Language Model with Lossless Generation Accuracy", 2023 (KDD 2024), arXiv:2312.12728
(sections 4.2-4.3, Algorithm 1, Tables 3-4).

Each step, the longest suffix of the text so far that the trie knows selects a sub-trie (multi-stage retrieval); its
highest-frequency nodes, up to the decoding length, are the draft, which the core engine verifies in one forward. The
trie learns as it goes:
- prompt branch inserting: each window of `branch_length` tokens of the prompt;
- generated branch inserting: after every step, the output's windows are extended by the tokens just accepted (each
  window is counted once, growing as it fills);
- branch eliminating: when a generation ends, its prompt's frequencies are removed;
- node pruning: when a sub-trie exceeds `capacity` nodes, response frequencies are halved and nodes left below 1
  removed, until it fits;
- branch weighting: a node ranks by response_freq + prompt_weight * prompt_freq.
The trie belongs to the drafter, so it persists across the requests of a process (the paper's global trie); `warmup`
feeds it responses from a JSONL file first.

Three draft shapes (Figure 5's comparison): "hierarchical" (the selected nodes as one tree, shared prefixes merged),
"parallel" (whole branches side by side, unmerged, the same token budget), "single" (the highest-frequency branch).

Choices where the paper is silent, and why:
- decoding_length counts draft tokens: a step's forward runs 1 + decoding_length rows. Under the planner (`--planner
  measured`) a step runs the first 1 + budget (nested), and the planner keeps the gains per `match_length`, the matched
  suffix's length up to 3: retrieval ranks a longer match as more relevant; a step with no match is an AR step.
- The trie is partitioned by first token and `capacity` (default 16 x decoding length, Table 4) bounds each first
  token's sub-trie, as in the authors' release: a single bound of 512 nodes over the whole trie would not hold one
  response's branches. Nodes that carry the current prompt's frequency are exempt from pruning; the prompt bounds them
  and eliminating removes them.
- prompt_weight 10: "a significant factor" that still lets a branch repeated many times in responses outrank a prompt
  one seen once.
- Multi-stage retrieval tries suffixes of max_prefix .. 1 tokens and takes the first whose sub-trie holds at least
  min_nodes nodes (else the shortest match): longer matches are more relevant, shorter ones fill the budget.
- Responses are inserted from the prompt's last token on, so the first generated tokens are found as its continuation.

What runs where: the trie lives on the host and is searched there between steps; the forward and its verification are
the engine's (one CUDA graph in exact mode on a GPU, whatever the tree).
"""
import heapq
import json
from pathlib import Path

from .. import NanospecError
from ..drafter import Drafter
from ..io.sources import base_of
from ..io.tokenizer import Tokenizer, load_tokenizer
from ..tree import Tree

STRATEGIES = ("hierarchical", "parallel", "single")


class Node:
    __slots__ = ("kids", "freq", "pfreq")

    def __init__(self):
        self.kids: dict[int, Node] = {}
        self.freq = 0.0   # from responses (decays under pruning)
        self.pfreq = 0    # from the current prompt (removed by eliminating)


class Trie:
    def __init__(self, capacity: int, prompt_weight: float = 10.0):
        self.root = Node()
        self.capacity, self.prompt_weight = capacity, prompt_weight
        self.sizes: dict[int, int] = {}  # first token -> nodes with response frequency in its sub-trie

    def weight(self, node: Node) -> float:
        return node.freq + self.prompt_weight * node.pfreq

    # --- updating ---------------------------------------------------------------------------
    def insert(self, branch: list[int], prompt: bool = False, skip: int = 0) -> None:
        """Count one occurrence of branch; its first `skip` nodes were counted before (a growing window)."""
        node = self.root
        for d, tok in enumerate(branch):
            node = node.kids.setdefault(tok, Node())
            if d < skip:
                continue
            if prompt:
                node.pfreq += 1
            else:
                self.sizes[branch[0]] = self.sizes.get(branch[0], 0) + (node.freq == 0)
                node.freq += 1
        if not prompt and branch:
            self.prune(branch[0])

    def prune(self, first: int) -> None:
        """Node pruning: halve response frequencies until the sub-trie fits the capacity."""
        while self.sizes.get(first, 0) > self.capacity:
            def decay(node: Node) -> int:  # returns the nodes still holding response frequency
                node.freq = node.freq / 2 if node.freq >= 2 else 0.0
                n = node.freq > 0
                for tok, kid in list(node.kids.items()):
                    n += decay(kid)
                    if kid.freq == 0 and kid.pfreq == 0 and not kid.kids:
                        del node.kids[tok]
                return n
            self.sizes[first] = decay(self.root.kids[first])
            sub = self.root.kids[first]
            if sub.freq == 0 and sub.pfreq == 0 and not sub.kids:
                del self.root.kids[first]

    def eliminate(self, branches: list[list[int]]) -> None:
        """Branch eliminating: remove the prompt frequencies that these branches added."""
        for branch in branches:
            node = self.root
            for tok in branch:
                node = node.kids[tok]
                node.pfreq -= 1

        def sweep(node: Node) -> None:
            for tok, kid in list(node.kids.items()):
                sweep(kid)
                if kid.freq == 0 and kid.pfreq == 0 and not kid.kids:
                    del node.kids[tok]
        for first in {b[0] for b in branches if b}:
            sweep(self.root.kids[first])
            sub = self.root.kids[first]
            if sub.freq == 0 and sub.pfreq == 0 and not sub.kids:
                del self.root.kids[first]

    # --- retrieving -------------------------------------------------------------------------
    def match(self, prefix: list[int]) -> Node | None:
        node = self.root
        for tok in prefix:
            node = node.kids.get(tok)
            if node is None:
                return None
        return node

    def retrieve(self, context: list[int], max_prefix: int, min_nodes: int) -> tuple[int, Node | None]:
        """Multi-stage retrieval: (matched suffix length, its node), longest suffix with enough nodes."""
        best = (0, None)
        for j in range(min(max_prefix, len(context)), 0, -1):
            node = self.match(context[-j:])
            if node is None or not node.kids:
                continue
            best = (j, node)
            if count(node, min_nodes) >= min_nodes:
                break
        return best

    def select(self, node: Node, budget: int, strategy: str) -> list[tuple[int, int]]:
        """Up to `budget` draft tokens below node as (token, parent index; -1 = the root)."""
        if strategy == "single":
            out = []
            while node.kids and len(out) < budget:
                tok, node = max(node.kids.items(), key=lambda kv: self.weight(kv[1]))
                out.append((tok, len(out) - 1))
            return out
        if strategy == "parallel":
            out = []
            for branch in self.branches(node):
                branch = branch[:budget - len(out)]
                out += [(tok, -1 if d == 0 else len(out) + d - 1) for d, tok in enumerate(branch)]
                if len(out) >= budget:
                    break
            return out
        # hierarchical: best-first; weights never grow along a path, so these are the top nodes
        out, heap, seq = [], [], 0
        for tok, kid in node.kids.items():
            heap.append((-self.weight(kid), seq, tok, kid, -1))
            seq += 1
        heapq.heapify(heap)
        while heap and len(out) < budget:
            _, _, tok, kid, parent = heapq.heappop(heap)
            out.append((tok, parent))
            for t, k in kid.kids.items():
                heapq.heappush(heap, (-self.weight(k), seq, t, k, len(out) - 1))
                seq += 1
        return out

    def branches(self, node: Node):
        """Root-to-leaf branches below node, the heaviest leaf first (ties: the deeper first), found
        best-first: weights never grow along a path, so the first leaf popped is the heaviest left,
        and the search only touches what it returns and the nodes beside it."""
        heap = [(-self.weight(kid), -1, i, [tok], kid) for i, (tok, kid) in enumerate(node.kids.items())]
        heapq.heapify(heap)
        seq = len(heap)
        while heap:
            _, d, _, path, n = heapq.heappop(heap)
            if not n.kids:
                yield path
            for tok, kid in n.kids.items():
                seq += 1
                heapq.heappush(heap, (-self.weight(kid), d - 1, seq, path + [tok], kid))


def count(node: Node, limit: int) -> int:
    """Nodes below node, counting up to limit."""
    n, stack = 0, list(node.kids.values())
    while stack and n < limit:
        n += 1
        stack.extend(stack.pop().kids.values())
    return n


class Lookahead(Drafter):
    name = "lookahead"
    nested = True  # select() picks best-first (or branch by branch): a smaller budget's picks are a prefix
    drafts_from = "from the trie after"  # show.py: the suffix the trie matched
    floor = 2.8  # tokens per step when a test feeds it AR's continuation (tests/helpers.py, reaches_floor)

    def __init__(self, decoding_length=16, branch_length=12, strategy="hierarchical", capacity=None,
                 prompt_weight=10.0, max_prefix=6, min_nodes=None):
        if strategy not in STRATEGIES:
            raise NanospecError(f"lookahead strategy {strategy!r}: choose from {', '.join(STRATEGIES)}")
        if decoding_length < 1 or branch_length < 2:
            raise NanospecError("lookahead needs decoding_length >= 1 and branch_length >= 2")
        self.decoding_length, self.branch_length, self.strategy = decoding_length, branch_length, strategy
        self.max_prefix = max_prefix
        self.min_nodes = min_nodes if min_nodes is not None else decoding_length
        self.max_rows, self.max_draft = decoding_length + 1, decoding_length
        self.trie = Trie(capacity or 16 * decoding_length, prompt_weight)

    @classmethod
    def load(cls, model, weights, decoding_length=16, branch_length=12, strategy="hierarchical", capacity=0,
             prompt_weight=10.0, max_prefix=6, min_nodes=-1, warmup="") -> "Lookahead":
        """decode.py's loader; warmup: a JSONL file of {"response": text} to feed the trie first."""
        d = cls(decoding_length, branch_length, strategy, capacity or None, prompt_weight, max_prefix,
                None if min_nodes < 0 else min_nodes)
        if warmup:
            d.warm_up(read_responses(warmup, load_tokenizer(base_of(weights))))
        return d

    @classmethod
    def random(cls, model, seed=0) -> "Lookahead":
        return cls(decoding_length=8, branch_length=4)  # a tiny model's: short windows, small trees

    def windows(self, seq: list[int]) -> list[list[int]]:
        return [seq[i:i + self.branch_length] for i in range(len(seq) - 1)]

    def warm_up(self, responses: list[list[int]]) -> None:
        for r in responses:
            for w in self.windows(r):
                self.trie.insert(w)

    def start(self, dec):
        for w in self.windows(dec.prompt):  # prompt branch inserting (a batch's sequences share the trie)
            self.trie.insert(w, prompt=True)

    def retrieve(self, dec) -> tuple[int, Node | None]:
        """(how long a suffix of the sequence the trie matched, the node it leads to, or None)."""
        m = self.max_prefix
        return self.trie.retrieve((dec.prompt[-m:] + dec.out[-m:])[-m:], m, self.min_nodes)

    def match_length(self, dec) -> int:
        """How long a suffix the trie matches, up to 3 (0: none, a draft of the root alone)."""
        return min(self.retrieve(dec)[0], 3)

    def draft(self, dec, cands, template, budget):
        j, node = self.retrieve(dec)
        if node is None:
            return Tree.chain(dec.root)
        picked = self.trie.select(node, budget or self.decoding_length, self.strategy)
        return Tree([dec.root] + [t for t, _ in picked], [-1] + [p + 1 for _, p in picked], matched=j)

    def accepted(self, dec, tree, path):
        """Generated branch inserting: extend every window the new tokens reach."""
        seq = dec.prompt[-1:] + dec.out
        n, L = len(seq), self.branch_length
        seen = n - len(path) if len(dec.out) > len(path) else 0  # tokens of seq inserted before this step
        for i in range(max(0, seen - L + 1), n):  # window i holds seq[i:seen] already
            self.trie.insert(seq[i:i + L], skip=max(0, seen - i))

    def finish(self, dec):
        self.trie.eliminate(self.windows(dec.prompt))


def read_responses(path, tok: Tokenizer) -> list[list[int]]:
    path = Path(path)
    if not path.is_file():
        raise NanospecError(f"no warm-up file at {path}: pass a JSONL file of {{\"response\": ...}} lines")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append(tok.encode(json.loads(line)["response"], bos=False))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise NanospecError(f"{path}:{i} is not a JSON object with a \"response\" field") from None
    return out
