"""GPU probes for .ci/gpu (they run on a CPU too, as a dry run).

    python .ci/probe.py products   # does a product's row keep its bits whatever the total rows (1..800)?
    python .ci/probe.py profile    # exact AR at Q = 16, a block batch of 1 and of 8: kernel and host time a step

products runs under vLLM's batch-invariant Hopper settings when NANOSPEC_PROBE_VLLM=1: CUBLAS_WORKSPACE_CONFIG=:16:8
and CUBLASLT_WORKSPACE_SIZE=1 (set by the caller, before torch starts), cuBLASLt preferred, no reduced-precision
reductions, no TF32. If every product form keeps a row's bits for every total, a GPU needs no block batch for
exactness across batches. One line per dtype and form: invariant, or the first total rows that moved a bit.
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def settings() -> str:
    if os.environ.get("NANOSPEC_PROBE_VLLM") != "1":
        return "torch defaults"
    if DEVICE == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return (f"vLLM's: CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}, "
            f"CUBLASLT_WORKSPACE_SIZE={os.environ.get('CUBLASLT_WORKSPACE_SIZE')}, cublaslt, no reduced precision")


def products(max_rows: int = 800) -> None:
    print(f"products on {DEVICE} ({torch.cuda.get_device_name(0) if DEVICE == 'cuda' else 'cpu'}), {settings()}")
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for K, N in ((256, 768), (576, 1536)):  # the default model's and SmolLM2's widths
            w = torch.randn(N, K, generator=g).to(DEVICE, dtype)
            res = torch.randn(max_rows, N, generator=g).to(DEVICE, dtype)
            rows = torch.randn(max_rows, K, generator=g).to(DEVICE, dtype)
            forms = {"linear": lambda x, r: F.linear(x, w), "addmm": lambda x, r: torch.addmm(r, x, w.t()),
                     "bmm": lambda x, r: torch.bmm(x.view(1, -1, K).expand(2, -1, -1), w.t().expand(2, -1, -1))[1]}
            for name, f in forms.items():  # row 0's result at every total: where it changes, how many kinds
                seen = [f(rows[:n], res[:n])[0] for n in range(1, max_rows + 1)]
                kinds = {tuple(y.float().tolist()) for y in seen}
                moves = [n + 1 for n in range(1, max_rows) if not torch.equal(seen[n], seen[n - 1])]
                what = "invariant" if len(kinds) == 1 else f"{len(kinds)} results, changing at totals {moves[:8]}"
                print(f"  {str(dtype).removeprefix('torch.'):9} {name:6} K={K} N={N}: rows 1..{max_rows} {what}")


def profile(steps: int = 64) -> None:
    from nanospec import DEFAULT_WEIGHTS
    from nanospec.engine import generate
    from nanospec.io.checkpoint import load
    model = load(DEFAULT_WEIGHTS, torch.bfloat16 if DEVICE == "cuda" else torch.float32, DEVICE)
    prompt = list(range(1, 40))
    for N in (1, 8):
        kw = dict(max_new_tokens=steps, exact=True, Q=16, eos_id=-1, block_batch=N if DEVICE == "cuda" else None)
        generate(model, prompt, **kw)  # captures
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if DEVICE == "cuda"
                                                        else [])
        t = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            out = generate(model, prompt, **kw)
        wall = (time.perf_counter() - t - out.prefill_s) / out.steps * 1e3
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel = sum(e.device_time_total for e in events) / 1e3 / out.steps  # ms a step (prefill included)
        print(f"exact AR, Q=16, block batch {N}: {out.tokens_per_s:.0f} tok/s, {wall:.3f} ms a step, "
              f"kernels {kernel:.3f} ms, host {wall - kernel:.3f} ms (under the profiler)")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:8]:
            print(f"    {e.device_time_total / 1e3 / out.steps:8.4f} ms  {e.count / out.steps:6.1f}x  {e.key[:90]}")


if __name__ == "__main__":
    {"products": products, "profile": profile}[sys.argv[1]]()
