"""Prompt Lookup Decoding (Saxena, 2023): training-free drafts copied from the context itself.

Spec: Apoorv Saxena, "Prompt Lookup Decoding", 2023, github.com/apoorvumang/prompt-lookup-decoding; shipped by
transformers (generate's prompt_lookup_num_tokens: PromptLookupCandidateGenerator) and by vLLM (its ngram
speculator).

Each step, the longest suffix of the context (the prompt and the output so far) of n tokens, n from max_ngram
down to min_ngram, that occurred earlier in the context selects that occurrence; the num_tokens tokens after it
(fewer where the context ends) are the draft, one chain. Edits, summaries and code repeat their input, and
there the drafts are right.

Options, named after transformers' and vLLM's: num_tokens (prompt_lookup_num_tokens, num_speculative_tokens),
max_ngram (max_matching_ngram_size, prompt_lookup_max), min_ngram (prompt_lookup_min; transformers' is 1) and
occurrence: "first", the earliest occurrence of the longest match (transformers scans from the start), or "last",
the most recent. The defaults are transformers': 10, 2, 1, first.

What the core does for it: the engine lays the chain out as rows, verifies it against the model's own tokens,
commits the accepted keys and runs a batch's sequences in one forward. The chain is nested (its first s + 1 nodes
are a budget-s draft), so under a planner (--planner measured: tuning/probing.Probing, the planner of unranked
drafters) the engine runs a prefix of it, the planner keeping the gains per match length (the matched n-gram's:
match_length) and offering no budget over num_tokens (max_draft).
warm_up's texts are context placed before the prompt.
"""
from .. import NanospecError
from ..drafter import Drafter
from ..tree import Tree

OCCURRENCES = ("first", "last")


class PLD(Drafter):
    name = "pld"
    nested = True  # one chain: its first s + 1 nodes are its budget-s draft
    drafts_from = "from what followed an earlier"  # show.py: the matched n-gram
    floor = 3.4  # tokens per step when a test feeds it AR's continuation (tests/helpers.py, reaches_floor)

    def __init__(self, num_tokens: int = 10, max_ngram: int = 2, min_ngram: int = 1, occurrence: str = "first"):
        sizes = (num_tokens, max_ngram, min_ngram)
        if any(type(v) is not int for v in sizes) or num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise NanospecError(f"pld needs whole numbers num_tokens >= 1 and 1 <= min_ngram <= max_ngram, "
                                f"not {num_tokens!r}, {min_ngram!r}, {max_ngram!r}")
        if occurrence not in OCCURRENCES:
            raise NanospecError(f"pld occurrence {occurrence!r}: choose from {', '.join(OCCURRENCES)}")
        self.num_tokens, self.max_ngram, self.min_ngram, self.occurrence = num_tokens, max_ngram, min_ngram, occurrence
        self.max_rows, self.max_draft = num_tokens + 1, num_tokens
        self.earlier: list[int] = []  # warm_up's texts, searched as context before the prompt

    @classmethod
    def load(cls, model, weights, num_tokens=10, max_ngram=2, min_ngram=1, occurrence="first") -> "PLD":
        return cls(num_tokens, max_ngram, min_ngram, occurrence)

    def warm_up(self, texts):
        self.earlier += [t for text in texts for t in text]

    def lookup(self, context: list[int]) -> tuple[int, list[int]]:
        """(n, the tokens after the chosen earlier occurrence of the context's last n tokens); (0, []): none."""
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = context[L - n:]
            starts = range(L - n) if self.occurrence == "first" else range(L - n - 1, -1, -1)  # never the suffix
            for i in starts:
                if context[i:i + n] == suffix:
                    return n, context[i + n:i + n + self.num_tokens]
        return 0, []

    def match_length(self, dec) -> int:
        """The matched n-gram's length (0: none, a draft of the root alone): the planner keeps its gains per length."""
        return self.lookup(self.earlier + dec.prompt + dec.out)[0]

    def draft(self, dec, cands, template, budget):
        n, drafts = self.lookup(self.earlier + dec.prompt + dec.out)
        drafts = drafts[:budget] if budget is not None else drafts
        return Tree([dec.root, *drafts], range(-1, len(drafts)), matched=n)
