"""Any OpenAI-compatible completions server as the engine under test (vLLM, SGLang, TGI,
llama.cpp's llama-server, llama-cpp-python's server), through the standard library's HTTP client.

Per prompt, one POST {--url}/completions:

    {"prompt": [ids], "max_tokens": N, "temperature": 0, "top_p": 1, "top_k": 1,
     "repeat_penalty": 1, "seed": 0, "logprobs": K, "return_tokens_as_token_ids": true,
     "return_token_ids": true}

(K: the most top log-probabilities the server allows, found by asking: largest_logprobs; top_k and
repeat_penalty are llama.cpp's and vLLM's extensions, return_tokens_as_token_ids is
vLLM's, return_token_ids SGLang's; servers ignore fields they do not know). --prompt-as text sends
the prompt's text instead, for servers that take no ids (llama-cpp-python's), and first checks
with `echo` that the server's prompt tokens are nanospec's ids. The output ids are read from, in
this order: choices[0].token_ids (SGLang), logprobs.content[i].id (llama-server), tokens written
"token_id:N" (vLLM), else each token's text through the weights' tokenizer (a text that names no
token, or several, is an error that names the position). finish_reason "stop" means the server stopped at its EOS
(no stop strings are sent): the EOS id is appended where the server left it out.

The top log-probabilities are the server's own rows: between two tokens of one row, the
difference of log-probabilities is the difference of logits (the row's log-sum-exp cancels).
With --greedy-url (the same engine serving without speculation), --url's output is also judged
against that server's greedy output on those rows (self-consistency). A server returns no full
rows, so it is not calibrated here: --calibration FILE (measured with --engine llama.cpp for a
llama.cpp server, say) gives its tolerance, else the float rule of --dtype (default float32).
"""
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ... import NanospecError
from ...io.checkpoint import load
from ...io.sources import base_of, resolve
from .. import calibration as cal
from ..verdict import compare
from . import Whole, progress, prompt_texts, references, save, tokenizer

LOGPROBS_TRIED = (20, 10, 5, 1)  # asked largest first: vLLM's default cap is 20, OpenAI's 5


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode("utf-8", "replace").strip().replace("\n", " ")[:300]
        hint = " (a server that takes no token ids: --prompt-as text)" if isinstance(body["prompt"], list) else ""
        raise NanospecError(f"{url} answered HTTP {e.code}: {text}{hint}") from None
    except (urllib.error.URLError, OSError) as e:
        raise NanospecError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None
    except json.JSONDecodeError:
        raise NanospecError(f"{url} answered something that is not JSON") from None


class Pieces:
    """Token texts back to ids, through the weights' tokenizer."""

    def __init__(self, tok):
        self.bos_id, self.ids = tok.bos_id, {}
        for i in range(tok.vocab_size):
            self.ids.setdefault(tok.decode([i]), []).append(i)

    def id(self, text: str, where: str) -> int:
        if text.startswith("token_id:") and text[9:].isdigit():  # vLLM's return_tokens_as_token_ids
            return int(text[9:])
        found = self.ids.get(text, [])
        if len(found) != 1:
            raise NanospecError(f"the server's token {text!r} ({where}) names {len(found)} tokens of the weights' "
                                "tokenizer: it cannot be mapped back to an id (a server that returns ids: vLLM with "
                                "return_tokens_as_token_ids, llama-server)")
        return found[0]


def parse(choice: dict, pieces: Pieces, where: str) -> tuple[list[int], list[dict]]:
    """(ids, rows) of one completion choice: rows are the top log-probabilities as trace positions."""
    lp = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}  # TGI: a list of floats
    if isinstance(lp.get("content"), list):  # llama-server, and the chat API's shape: ids given
        ids, rows = [], []
        for k, c in enumerate(lp["content"]):
            ids.append(c["id"] if "id" in c else pieces.id(c["token"], f"{where}, token {k}"))
            alts = [(a["id"] if "id" in a else pieces.id(a["token"], f"{where}, token {k}"), a["logprob"])
                    for a in c.get("top_logprobs", [])]
            rows.append(position(alts or [(ids[-1], c["logprob"])]))
        return ids, rows
    if not isinstance(lp.get("tokens"), list):
        raise NanospecError(f"the server returned no logprobs.tokens for {where}: it must return the tokens' "
                            "log-probabilities (\"logprobs\": N) in the completions API's shape")
    given = choice.get("token_ids")
    if isinstance(given, list) and len(given) == len(lp["tokens"]):
        ids = [int(i) for i in given]  # SGLang's return_token_ids
    else:
        ids = [pieces.id(t, f"{where}, token {k}") for k, t in enumerate(lp["tokens"])]
    rows = []
    for k, top in enumerate(lp.get("top_logprobs") or [None] * len(ids)):
        alts = []
        for text, v in (top or {}).items():
            try:
                alts.append((pieces.id(text, where), v))
            except NanospecError:
                pass  # an alternative we cannot name stays out of the row
        rows.append(position(alts or [(ids[k], (lp.get("token_logprobs") or [0.0] * len(ids))[k] or 0.0)]))
    return ids, rows


def position(alts: list[tuple[int, float]]) -> dict:
    alts = sorted(set(alts), key=lambda a: -a[1])
    return {"top_ids": [a[0] for a in alts], "top_logits": [float(a[1]) for a in alts], "logprobs": True}


def body(args, prompt, max_tokens: int, logprobs: int, echo: bool = False) -> dict:
    b = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 1,
         "repeat_penalty": 1.0, "seed": 0, "logprobs": logprobs, "return_tokens_as_token_ids": True,
         "return_token_ids": True, "echo": echo, "stream": False}
    return {**b, "model": args.model} if args.model else b


def largest_logprobs(url, args, prompt, pieces: Pieces) -> int:
    """The most top log-probabilities the server lists per token, found by asking: LOGPROBS_TRIED in turn until
    one is answered (a server may also list fewer than asked: then as many as it listed)."""
    for k in LOGPROBS_TRIED:
        try:
            r = post(url, body(args, prompt, 1, logprobs=k))
        except NanospecError as e:
            if "answered HTTP 4" in str(e) and k != LOGPROBS_TRIED[-1]:
                continue  # more than it allows
            raise
        _, rows = parse((r.get("choices") or [{}])[0], pieces, "the logprobs probe")
        return min(k, max((len(row["top_ids"]) for row in rows), default=1))
    return 1


def echoed(url, args, ref: dict, k: int, pieces: Pieces) -> list[dict] | None:
    """The server's rows at the reference's own tokens: the reference's prompt and output sent as one prompt with
    echo, which lists each prompt token's top log-probabilities; None where the server lists none (or refuses)."""
    out = ref["output_ids"]
    try:
        r = post(url, body(args, ref["prompt_ids"] + out, 1, echo=True, logprobs=k))
        ids, rows = parse((r.get("choices") or [{}])[0], pieces, "echo")
    except (NanospecError, KeyError, TypeError):
        return None
    n, p = len(out), ref["prompt_ids"]
    at = next((len(q) for q in (p, p[1:]) if ids[:len(q)] == q and ids[len(q):len(q) + n] == out), None)  # BOS or not
    rows = rows[at:at + n] if at is not None else []
    return rows if len(rows) == n and all(len(row["top_ids"]) > 1 for row in rows) else None


def server_prompt(url, args, text: str, pieces: Pieces, k: int, n: int) -> tuple[list[int], int | None]:
    """The server's own tokens of a text prompt, through echo: the first n echoed tokens (servers
    leave BOS out of them), and usage.prompt_tokens (which counts BOS)."""
    r = post(url, body(args, text, 1, 1, echo=True))
    ids, _ = parse(r["choices"][0], pieces, f"prompt {k} (echo)")
    return ids[:n], (r.get("usage") or {}).get("prompt_tokens")


def completion(url, args, k: int, text: str, p: list[int], pieces, eos_id, logprobs: int) -> dict:
    """One prompt's greedy completion from the server, as a trace entry."""
    t = time.perf_counter()
    r = post(url, body(args, text if args.prompt_as == "text" else p, args.max_new_tokens, logprobs=logprobs))
    choice = (r.get("choices") or [None])[0]
    if not isinstance(choice, dict):
        raise NanospecError(f"{url} answered without choices for prompt {k}")
    ids, rows = parse(choice, pieces, f"prompt {k}")
    if choice.get("finish_reason") == "stop" and ids[-1:] != [eos_id]:
        ids.append(eos_id)  # the server stopped at its EOS and left it out
        rows.append({"top_ids": [eos_id], "top_logits": [0.0], "logprobs": True})
    return {"prompt_ids": p, "output_ids": ids, "eos_id": eos_id, "positions": rows,
            "request_s": round(time.perf_counter() - t, 3), **({"dtype": args.dtype} if args.dtype else {})}


def outputs(url, args, texts, prompts, pieces, eos_id, tag, logprobs: int) -> list[dict]:
    """Each prompt alone: one request at a time (text prompts: the server's tokens checked first)."""
    outs, t0 = [], time.perf_counter()
    for k, (text, p) in enumerate(zip(texts, prompts)):
        if args.prompt_as == "text":
            mine = p[1:] if p[:1] == [pieces.bos_id] else p
            theirs, count = server_prompt(url, args, text, pieces, k, len(mine))
            if theirs != mine or count not in (None, len(p)):
                raise NanospecError(f"{url} tokenizes prompt {k} otherwise than nanospec (server {theirs[:12]}..., "
                                    f"nanospec {p[:12]}...): send ids (--prompt-as ids) to a server that takes them")
        outs.append(completion(url, args, k, text, p, pieces, eos_id, logprobs))
        progress(f"openai {tag}", k, len(prompts), t0)
    return outs


def concurrent(url, args, texts, prompts, pieces, eos_id, logprobs: int) -> list[dict]:
    """The same requests, --concurrency of them in flight at once: the server batches them."""
    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(lambda k: completion(url, args, k, texts[k], prompts[k], pieces, eos_id, logprobs),
                             range(len(prompts))))


def run(args) -> list[dict]:
    if not args.url:
        raise NanospecError("--engine openai needs --url http://HOST:PORT/v1 (the server's OpenAI-compatible API)")
    if args.self_only and not args.greedy_url:
        raise NanospecError("--self-only compares --url with the same engine's greedy output: add --greedy-url")
    if args.calibrate:
        raise NanospecError("--engine openai cannot be calibrated here (a server returns no full logit rows): "
                            "calibrate the engine it serves (--engine llama.cpp) and pass --calibration FILE")
    if args.dtype and args.dtype not in cal.EPS:
        raise NanospecError(f"unknown dtype {args.dtype!r}: one of {', '.join(cal.EPS)}")
    weights = resolve(args.weights, log=sys.stderr)
    model = load(base_of(weights))
    tok = tokenizer(weights)
    pieces = Pieces(tok)
    texts = prompt_texts(args, weights)
    prompts = [tok.encode(t) for t in texts]
    tol, calibrated, whole = {}, {}, Whole(args, weights, model)
    if args.calibration:
        c = cal.read(args.calibration)
        e = cal.widest(c)
        tol = {"units": e["units"], "ulps": e["ulps"], "calibrated": f"{Path(args.calibration).name}, widest setting"}
        calibrated = {"calibrated": [e], "source": f"{Path(args.calibration).name}, widest setting"}
    runs = []

    def judge(ref, outs, **kw):
        against = whole.own(ref, outs) if kw["against"] == "greedy" else {} if kw["against"] != "reference" else \
            whole.of(ref, outs, args.dtype or "float32", **calibrated)
        return {"engine": "openai", **kw, **tol, **against,
                "results": compare(ref, outs, args.dtype, args.ulps or tol.get("ulps"), units=tol.get("units"))}

    urls = [("server", args.url.rstrip("/"))]
    urls += [("greedy server", args.greedy_url.rstrip("/"))] if args.greedy_url else []
    got, k = {}, {}
    for name, url in urls:  # the servers first: a server that fails, fails before the reference's work
        first = texts[0] if args.prompt_as == "text" else prompts[0]
        k[name] = largest_logprobs(f"{url}/completions", args, first, pieces)
        print(f"[openai] {url} lists {k[name]} top log-probabilities per token", file=sys.stderr, flush=True)
        got[name] = outputs(f"{url}/completions", args, texts, prompts, pieces, model.args.eos_id, name, k[name])
        save(args, f"openai-{name.replace(' ', '-')}", got[name])
    if args.concurrency > 1:  # after the lone runs, so that no other request overlaps them
        url = f"{args.url.rstrip('/')}/completions"
        got["batched"] = concurrent(url, args, texts, prompts, pieces, model.args.eos_id, k["server"])
        save(args, f"openai-concurrency{args.concurrency}", got["batched"])
    refs = references(args, model, prompts)
    save(args, "nanospec-ar-float32", refs)
    for name, url in urls if refs is not None else []:
        runs.append(judge(refs, got[name], setting=url, against="reference"))
        rows = [echoed(f"{url}/completions", args, e, k[name], pieces) for e in refs] if args.prompt_as == "ids" \
            else [None]
        if None not in rows and whole.on:  # the server scored at the reference's own tokens: no first flip cuts it
            echo = [{**e, "positions": r} for e, r in zip(refs, rows)]
            runs.append({"engine": "openai", "setting": f"{url} (echo: at the reference's tokens)",
                         "against": "reference", **tol, "results": compare(refs, echo, args.dtype, 0.0),
                         **whole.of(refs, echo, args.dtype or "float32", echo=True, **calibrated)})
    if args.greedy_url:
        runs.append(judge(got["greedy server"], got["server"], setting=args.url.rstrip("/"), against="greedy"))
    if args.concurrency > 1:  # does batching change the server's output? Each prompt against itself sent alone
        setting = f"{args.url.rstrip('/')} concurrency {args.concurrency}"
        runs += [judge(refs, got["batched"], setting=setting, against="reference")] if refs is not None else []
        runs.append(judge(got["server"], got["batched"], setting=setting, against="alone"))
    return runs
