"""A tiny OpenAI-compatible completions server for tests: standard library only (http.server on
127.0.0.1, port 0), decoding with a nanospec model (fast-mode greedy), so the HTTP side of
`--engine openai` is exercised everywhere without any real server.

Response shapes, as the servers named in the README return them:
- "vllm": logprobs.tokens as "token_id:N" (return_tokens_as_token_ids), top_logprobs keyed alike;
- "text": logprobs.tokens as token texts, top_logprobs keyed by text (llama-cpp-python's server);
- "llama-server": logprobs.content[i] with id, token, logprob and top_logprobs (with ids).
flip_at=N plants a speculation bug: from output position N on, the runner-up token is emitted
once. refuse_ids=True answers 422 to a prompt of ids (as llama-cpp-python's server does).
logit_scale=s plants a bug that moves every distribution and no argmax: the logits scaled by s before the
log-probabilities (a temperature left on). max_logprobs=K answers 400 to a request for more than K top
log-probabilities (as vLLM's --max-logprobs does); echo_rows=True lists the top log-probabilities of echoed
prompt tokens too (as vLLM does), else echo lists none (as llama-cpp-python's server without logits_all).
batch_flip_at=N plants a batch dependence: each request is held until another arrives or for `hold`
seconds, and one that overlaps another request emits the runner-up at position N (a lone request
never does).
"""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from nanospec.engine import generate
from nanospec.oracle import forced


class Stub:
    def __init__(self, model, tok, shape="vllm", flip_at=None, refuse_ids=False, batch_flip_at=None, hold=0.5,
                 logit_scale=1.0, max_logprobs=20, echo_rows=False):
        self.model, self.tok, self.shape, self.flip_at, self.refuse_ids = model, tok, shape, flip_at, refuse_ids
        self.logit_scale, self.max_logprobs, self.echo_rows = logit_scale, max_logprobs, echo_rows
        self.batch_flip_at, self.hold, self.active, self.cond = batch_flip_at, hold, {}, threading.Condition()
        self.requests = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                code, answer = stub.answer(self.path, body, stub.overlapped())
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def overlapped(self) -> bool:
        """With batch_flip_at: whether another request was in flight while this one was held. A request
        is held until another arrives (then both overlap) or for `hold` seconds: requests sent at once
        overlap however slowly the client's threads start, and a lone request never does."""
        if self.batch_flip_at is None:
            return False
        me = object()
        with self.cond:
            if self.active:  # everyone in flight overlaps the newcomer, and it them
                self.active = dict.fromkeys(self.active, True)
            self.active[me] = bool(self.active)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.active[me], timeout=self.hold)
            return self.active.pop(me)

    def decode(self, ids: list[int], max_tokens: int, overlapped=False) -> tuple[list[int], torch.Tensor, str]:
        out = generate(self.model, ids, max_new_tokens=max_tokens, record_logits=True)
        tokens, rows = list(out.tokens), out.logits
        flip_at = self.batch_flip_at if overlapped else self.flip_at
        if flip_at is not None and flip_at < len(tokens):
            i = flip_at
            tokens = tokens[:i] + [int(rows[i].topk(2).indices[1])]  # the runner-up, then stop here
            rows = rows[:i + 1]
        eos = self.model.args.eos_id
        if tokens[-1:] == [eos]:
            return tokens[:-1], rows[:-1], "stop"  # left out, as the servers do
        return tokens, rows, "length"

    def name(self, i: int) -> str:
        return f"token_id:{i}" if self.shape == "vllm" else self.tok.decode([i])

    def answer(self, path: str, body: dict, overlapped=False) -> tuple[int, dict]:
        if path != "/v1/completions":
            return 404, {"error": "not found"}
        prompt = body["prompt"]
        if isinstance(prompt, list) and self.refuse_ids:
            return 422, {"detail": [{"msg": "Input should be a valid string", "loc": ["body", "prompt"]}]}
        ids = self.tok.encode(prompt) if isinstance(prompt, str) else prompt
        k = body.get("logprobs") or 0
        if k > self.max_logprobs:
            return 400, {"error": {"message": f"logprobs {k} is more than the maximum {self.max_logprobs}"}}
        tokens, rows, finish = self.decode(ids, body["max_tokens"], overlapped)
        if body.get("echo"):
            p = ids[1:] if ids[:1] == [self.tok.bos_id] else ids
            top = [None] * (len(p) + len(tokens))
            if self.echo_rows:  # row j of the echo: the distribution its token was read from (none for the first)
                seen = torch.log_softmax(self.logit_scale * forced.rows(self.model, ids[:1], ids[1:]).double(), -1)
                top[len(p) - len(seen):len(p)] = [{self.name(int(i)): float(v) for i, v in zip(*r.topk(k)[::-1])}
                                                  for r in seen]
            lp = {"tokens": [self.name(i) for i in p + tokens], "top_logprobs": top}
            return 200, {"choices": [{"text": "", "logprobs": lp, "finish_reason": finish}],
                         "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens)}}
        logp = torch.log_softmax(self.logit_scale * rows.double(), -1) if len(tokens) else rows
        tops = [logp[j].topk(k) for j in range(len(tokens))]
        if self.shape == "llama-server":
            content = [{"id": t, "token": self.tok.decode([t]), "logprob": float(logp[j, t]),
                        "top_logprobs": [{"id": int(i), "token": self.tok.decode([int(i)]), "logprob": float(v)}
                                         for i, v in zip(top.indices, top.values)]}
                       for j, (t, top) in enumerate(zip(tokens, tops))]
            lp = {"content": content}
        else:
            lp = {"tokens": [self.name(t) for t in tokens],
                  "token_logprobs": [float(logp[j, t]) for j, t in enumerate(tokens)],
                  "top_logprobs": [{self.name(int(i)): float(v) for i, v in zip(top.indices, top.values)}
                                   for top in tops]}
        return 200, {"choices": [{"text": self.tok.decode(tokens), "index": 0, "logprobs": lp,
                                  "finish_reason": finish}],
                     "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens)}}
