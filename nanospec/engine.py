"""The decoding loop: prefill, then steps until a stop. A step (`step`), each part a function below, in this order:

- draft: each live sequence's drafter proposes a tree, on the host, trimmed to its cache's room (drafter.py: the
  contract, one hook per step of a paper); the sequences that step alike form a group.
- lay out: a group's trees become rows and nodes (the drafter's rows, tree.py), exact mode's padded to Q rows, as
  one batch (decoding.py: each sequence's part).
- forward and verify: one device program per group, its inputs one host tensor copied to the device once (the
  device's programs run it: programs.py): the method's forward, then (greedy) each sequence's verification, its next
  candidates' top-k, and the commit's moves of its accepted keys into place.
- read back: the accepted paths and next candidates (tree.pack), the step's one host-device sync; sampling verifies
  here, on the host.
- commit: each sequence's cursor and tokens advance, on the host (Decoding.commit; sampling's keys move then).

In exact mode every forward runs Q rows per sequence on a cache of S slots, each row gathering its last W keys
(sizes.shapes): runs compared bitwise share them. With a block batch of N (sizes.block_batch), every exact forward
runs N sequences' blocks, idle ones padded, so a product's total rows (a library may pick its kernel by them) never
change.
"""
import time
from dataclasses import dataclass, field, replace

import torch

from . import NanospecError, compiled, devices, sizes
from .block import Block
from .cache import KVCache
from .decoding import Decoding, stack
from .drafter import AR, Drafter, Forward, Nodes
from .programs import EAGER, packed, unpacked
from .sizes import check_prompt, check_room, shapes
from .tree import Layout, Sampler, Tree, accept, pack, sample_verify, unpack


def step(live: list[Decoding], drafter: Drafter, record: bool):
    """One step of every live sequence, a group of one drafter and layout at a time: draft, lay out, forward and
    verify, read back, commit. Returns the budget, per sequence (path, emitted tokens, their logits if record, the
    whole draft) and the step's rows."""
    budget, groups = draft(live, drafter)
    results, rows = {}, 0
    for s, members in groups:
        decs, trees = [m[0] for m in members], [m[1] for m in members]
        block, nodes, seqs = lay_out(decs, s, trees)
        launched = forward_and_verify(decs, s, block, nodes, seqs)
        outcomes = read_back(decs, s, trees, launched, nodes, record)
        for (d, tree, whole), (path, emitted, logits) in zip(members, outcomes):
            d.commit(path, emitted, moved=d.sampler.greedy)
            drafter.accepted(d, tree, path)
            results[d], rows = (path, emitted, logits, whole), rows + s.size(len(tree))
    return budget, results, rows


def draft(live: list[Decoding], drafter: Drafter):
    """The step's budget (the planner's; None: none) and each live sequence's tree, on the host, trimmed to its cache's
    room, grouped by the drafter that steps it and its layout: per group, (that drafter, [(sequence, tree, the whole
    draft)])."""
    budget, template = drafter.planner.budget(live) if drafter.planner is not None else (None, None)
    stepper = drafter if budget != 0 else AR  # budget 0: drafting does not pay, an AR step
    wide = drafter.nested and budget is not None  # drafted whole, AR steps too: the planner scores every prefix
    groups = {}
    for d in live:
        whole = (drafter if wide else stepper).draft(
            d, d.cands, template or getattr(drafter, "template", None), None if wide else budget)
        s, tree = d.fit(stepper, whole.prefix(min(len(whole), budget + 1)) if wide else whole)
        key = (id(s), None if d.room >= s.max_rows else len(tree))  # near the cache's end: no filler
        groups.setdefault(key, (s, []))[1].append((d, tree, whole))
    return budget, list(groups.values())


def lay_out(decs: list[Decoding], drafter: Drafter, trees: list[Tree]) -> tuple[Block, Nodes, torch.Tensor | None]:
    """A group's trees as rows and nodes, on the host: each laid out for the group's largest (smaller trees get filler
    nodes; exact mode pads to Q rows), then stacked as one batch, with the group's cache rows (stack)."""
    n = max(map(len, trees))
    return stack(decs, *zip(*(d.prepare(drafter, t, n) for d, t in zip(decs, trees))))


def forward_and_verify(decs: list[Decoding], drafter: Drafter, block: Block, nodes: Nodes, seqs):
    """A step's device program for a group of sequences (batch dim first), launched, and its start time: the
    method's forward, then (greedy) each sequence's verification, next candidates' top-k and the commit's moves
    (KVCache.settle), packed as rows of one tensor. Its inputs are one host tensor, copied to the device once.
    Exact mode: fixed shapes, one program per method, shape key and group size (one CUDA graph each where a
    device layer captures them)."""
    d = decs[0]
    model, cache, exact, greedy, tail = d.model, d.cache, d.exact, d.sampler.greedy, d.tail
    R = max(drafter.topk, default=1)
    at = {x.seq: x.cur for x in decs} if d.N else dict(enumerate(x.cur for x in decs))
    cur = torch.tensor([at.get(r, 0) for r in range(len(block.tokens))])  # idle sequences: slot 0 onto itself
    lay = nodes.lay
    flat, spec = packed([block.tokens, block.pos, block.slots, block.prefix, block.extra, nodes.tokens, lay.parent,
                         lay.depth, lay.index, lay.anc, nodes.real, cur, seqs])
    moves = greedy and drafter.max_rows > 1  # AR's path is its root alone, already in place

    def run(flat):
        *blk, node_tokens, parent, depth, index, anc, real, cur, seqs = unpacked(flat, spec)
        f = Forward.on_cache(model, Block(*blk), cache, exact, seqs, tail, d.dev)
        lay = Layout(parent, depth, index, anc)
        out = drafter.forward(f, Nodes(node_tokens, lay, real.bool(), nodes.n))
        if not greedy:
            return out.logits, out.drafts, out.depths, out.alive
        path, emitted = accept(node_tokens, lay, out.logits, out.alive)  # (B, E) each
        if moves:
            cache.settle(torch.arange(len(cur), device=cur.device) if seqs is None else seqs, cur, path)
        if out.drafts is None:
            return pack(path, emitted), out.logits
        last = path.max(-1).values  # each path's deepest node (indices grow along a path)
        b = torch.arange(len(last), device=last.device)
        cands = drafter.propose(out.drafts[b, last], d.dev.linear).topk(R, dim=-1).indices  # (B, K, R): one product
        depth = out.depths[b, last] if out.depths is not None else torch.full_like(last, cands.shape[1])
        return pack(path, emitted, depth, cands), out.logits
    key = ("step", id(drafter), drafter.shape_key(nodes) if exact else None, greedy, spec)  # a capture keeps drafter
    t0 = time.perf_counter()
    return d.launch(key, run, (flat,)), t0


def read_back(decs: list[Decoding], drafter: Drafter, trees: list[Tree], launched, nodes: Nodes, record: bool):
    """A group's step program's results on the host, read back once (launched: with its start time). Greedy: each
    sequence's path and next candidates, as the device verified and drafted them. Sampling: the logits, verified
    here (sample_verify), and the drafts at each path's end proposed, one product for the batch. Per sequence:
    (path, emitted tokens, their logits if record); its next candidates go to cands (D, R) and lists, on the host."""
    d, (res, t0) = decs[0], launched
    at = [x.seq for x in decs] if d.N else list(range(len(decs)))  # each sequence's index in the batch
    if d.sampler.greedy:
        flat, logits = res
        head = flat.tolist()  # the step's one read-back
        took = time.perf_counter() - t0
        E, R = nodes.lay.anc.shape[-1], max(drafter.topk, default=1)
        found = [unpack(head[b], E, R) for b in at]
    else:  # sampling verifies on the host: the logits are read back anyway
        logits, drafts, depths, alive = res
        paths = [sample_verify(t, logits[b, :len(t)], x.sampler, len(x.out),
                               None if alive is None else alive[b, :len(t)]) for b, x, t in zip(at, decs, trees)]
        depth = [0] * len(decs)  # the depths each path's end drafted
        if drafts is not None:  # each path's end drafts: one product for the batch, as greedy's
            b = torch.tensor(at, device=drafts.device)
            ends = torch.tensor([p[-1] for p, _ in paths], device=drafts.device)
            top = drafter.propose(drafts[b, ends], d.dev.linear).topk(max(drafter.topk), dim=-1).indices.cpu()
            depth = depths[b, ends].tolist() if depths is not None else [top.shape[1]] * len(decs)
        found = [(p, e, top[i, :k], top[i, :k].tolist()) if k else (p, e, None, None)
                 for i, ((p, e), k) in enumerate(zip(paths, depth))]
        took = time.perf_counter() - t0
    results = []
    for b, x, (path, emitted, cands, lists) in zip(at, decs, found):
        x.forward_s, x.cands, x.lists = x.forward_s + took / len(decs), cands, lists  # its share of the program
        results.append((path, emitted, logits[b, path].float().cpu() if record else None))
    return results


@dataclass
class Output:
    tokens: list[int]
    stop: str                   # "eos", "max_new_tokens" or "cache_full"
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens emitted per step
    forward_s: float = 0.0      # time in the steps' forwards (device-synchronised)
    prefill_s: float = 0.0      # the call's: every prompt's, in a batch
    decode_s: float = 0.0       # from its first step to its stop, prefills left out (in a batch, beside others)
    logits: torch.Tensor | None = None  # (new tokens, V) fp32: the logits each token came from

    @property
    def mean_accepted(self) -> float:
        return len(self.tokens) / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.decode_s, 1e-9)


@torch.inference_mode()
def generate(model, prompt, drafter: Drafter | None = None, *, max_new_tokens=128, exact=False,
             Q=None, n_slots=None, tail=None, temperature=0.0, top_k=0, top_p=1.0, seed=0,
             eos_id=None, record_logits=False, batch=None, block_batch=None, compile=False, dev=None, programs=None):
    """Decode max_new_tokens after prompt (token ids) with a drafter (None: AR): an Output. A list of prompts is a
    batch: one Output each, every sequence as if decoded alone (its own sampling stream from seed). batch: the
    sequences decoded at once (None: all); a stopped one's cache row takes the next prompt (continuous batching).
    Q, n_slots, tail: exact mode's shapes (default: sizes.shapes); block_batch: its sequences' blocks
    per forward (default: sizes.block_batch); eos_id None: the model's, -1: none. dev: the device's layout and
    speed (devices.Device; default: devices.of the model's device); compile: exact mode's layer compiled (its `call`:
    compiled.py); programs: how the device programs run (default: exact mode's the device's, programs.py)."""
    drafter = drafter or AR
    dev = devices.of(dev or model.embed.weight)
    if compile and not exact:
        raise NanospecError("compile=True needs exact=True")
    dev = replace(dev, call=compiled.layer) if compile else dev
    programs = programs or (dev.programs if exact else EAGER)
    many = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], (list, tuple))
    prompts = [check_prompt(p, model.args.vocab_size) for p in (prompt if many else [prompt])]
    Q, S, W = shapes([drafter], max(map(len, prompts)), max_new_tokens, Q, n_slots)
    W = tail or W
    eos = model.args.eos_id if eos_id is None else eos_id
    batch = min(batch or len(prompts), len(prompts))
    N = sizes.block_batch(block_batch, batch, exact, dev)
    w = model.embed.weight
    make = lambda: KVCache.for_model(model, S, N or batch, dev)
    cache = programs.cache(model, (S, N or batch, w.dtype, w.device), make)
    reserved = cache.reserve(drafter.reserved_slots)
    check_room(max(map(len, prompts)), cache.capacity)
    waiting, outs, logits, began, prefill_s = iter(prompts), {}, {}, {}, 0.0
    clock = lambda: time.perf_counter() - prefill_s  # decoding time: prefills, even of refilled rows, left out

    def admit(seq: int) -> list[Decoding]:
        """The next prompt, if any, into cache row seq: prefilled, and the drafter started on it."""
        nonlocal prefill_s
        p, t = next(waiting, None), time.perf_counter()
        if p is None:
            return []
        d = Decoding(model, cache, exact, Q, p, reserved, seq=seq, block_batch=N, dev=dev, tail=W, programs=programs,
                     sampler=Sampler(temperature, top_k, top_p, seed, n=max_new_tokens + Q + 1))  # a stream each
        d.prefill(p[:-1])
        drafter.start(d)
        d.sync()
        outs[d], logits[d], prefill_s = Output([], "max_new_tokens"), [], prefill_s + time.perf_counter() - t
        began[d] = clock()
        return [d]

    live = [d for seq in range(batch) for d in admit(seq)]
    if (planner := drafter.planner) is not None:
        planner.start(drafter, live[0])
    while live:
        ts = time.perf_counter()
        budget, results, rows = step(live, drafter, record_logits)
        secs, done = time.perf_counter() - ts, []
        for i, d in enumerate(live):
            path, toks, r, drafted = results[d]
            if planner is not None:  # the step's rows and time once; each sequence's outcome
                planner.observe(d, budget, rows if i == 0 else 0, secs, path, drafted, d.lists)
            logits[d].append(r)  # None unless record_logits
            outs[d].steps += 1
            outs[d].accepted.append(len(toks))
            stop = "eos" if eos in toks else "max_new_tokens" if len(d.out) >= max_new_tokens else \
                "cache_full" if d.room < 1 else None
            if stop:
                outs[d].stop, outs[d].decode_s = stop, clock() - began[d]
                done.append(d)
                drafter.finish(d)
        # a stopped sequence's refill takes its place: cache-row order, so a full batch reads the cache in place
        live = [n for d in live for n in (admit(d.seq) if d in done else [d])]
    for d, r in outs.items():
        r.prefill_s, r.forward_s = prefill_s, d.forward_s
        n = min(len(d.out), max_new_tokens)
        if eos in d.out[:n]:
            n, r.stop = d.out.index(eos) + 1, "eos"
        elif r.stop == "eos":  # the EOS came after the last token asked for
            r.stop = "max_new_tokens"
        r.tokens = d.out[:n]
        if record_logits:
            r.logits = torch.cat(logits[d])[:n]
    return list(outs.values()) if many else outs[next(iter(outs))]
