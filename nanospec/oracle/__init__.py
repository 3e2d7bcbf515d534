"""The oracle: traces of reference logits, comparison with other engines, their tolerances and verdicts."""
