"""The sizes a generation runs at: exact mode's block of Q rows, its block batch and cache of S slots
(runs compared bitwise share them), and the checks that a prompt fits."""

from . import NanospecError, devices
from .devices import MIN_BLOCK

SLOT_BUCKET = 64  # default cache sizes are rounded up to this: prompts of similar length share CUDA graphs


def shapes(drafters, prompt_len: int, max_new_tokens: int, Q=None, n_slots=None, tail=None) -> tuple[int, int, int]:
    """Exact mode's shapes that fit every drafter: runs to compare share them. Q, the block's rows; S, the
    cache's slots: the prompt, its continuation, one step's scratch rows, reserved slots and the trash slot,
    rounded up to a multiple of SLOT_BUCKET; W, the tail of keys each row gathers in canonical order (its
    deepest path's nodes: the rest it reads in place, exact.py). Q, n_slots, tail: given, kept.
    """
    Q = Q or max(MIN_BLOCK, *(d.max_rows for d in drafters))
    if Q < MIN_BLOCK:
        raise NanospecError(f"the exact-mode block must have at least {MIN_BLOCK} rows (got --block {Q})")
    S = prompt_len + max_new_tokens + Q + max(d.reserved_slots for d in drafters) + 1
    return Q, n_slots or -(-S // SLOT_BUCKET) * SLOT_BUCKET, tail or 1 + max(d.max_depth for d in drafters)


def block_batch(n: int | None, rows: int, exact: bool, device) -> int | None:
    """The block batch: how many sequences' Q-row blocks every exact-mode forward runs (None: only the live ones'),
    n if asked for (--block-batch), else the device's default; rows: the sequences decoded at once.

    A product's bits may depend on its total rows: cuBLAS picks its fp32 kernel by them (RESULTS.md,
    "On a GPU"). A fixed total, the block batch x Q rows whoever is live, a lone sequence included, makes a
    sequence's bits independent of its batch on any library. A device whose default is a block batch
    (devices.Device.block_batch), in every dtype: batches of up to that many sequences are bitwise each
    alone; a larger one rounds the block batch up to a multiple of it (compare it alone at the same block_batch).
    A device without one keeps a row's bits for any row count (tests/test_batch.py): no block batch
    unless asked for. device: a devices.Device, or a device whose defaults apply."""
    if n is None:
        m = devices.of(device).block_batch if exact else None
        return -(-rows // m) * m if m else None
    if not exact:
        raise NanospecError("--block-batch applies to exact mode (--mode exact)")
    if n < rows:
        raise NanospecError(f"--block-batch {n} is smaller than the batch of {rows} sequences decoded at once")
    return n


def check_prompt(prompt, vocab_size: int) -> list[int]:
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise NanospecError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise NanospecError(f"token id {bad[0]} is out of range for a vocabulary of {vocab_size}")
    return prompt


def check_room(prompt_len: int, capacity: int) -> None:
    if prompt_len > capacity:
        raise NanospecError(f"the prompt has {prompt_len} tokens but the cache holds {capacity}; "
                            "shorten it or raise --max-len")
