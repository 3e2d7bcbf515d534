"""Files and names every layer needs, importing nothing of the package: the cache root, atomic
writes, content hashes, a model's fingerprint and a line naming the hardware."""
import hashlib
import os
import platform
from pathlib import Path

import torch


def cache_root() -> Path:
    """$NANOSPEC_CACHE, else ~/.cache/nanospec: outside the repository."""
    return Path(os.environ.get("NANOSPEC_CACHE") or Path.home() / ".cache" / "nanospec")


def atomic_write(path: Path, write) -> None:
    """write(tmp_path) then rename over path: a crash never leaves a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(model) -> str:
    """A short hash of the base weights as they are stored: checkpoint.load records it before the
    cast to the compute dtype, so fp32, bf16 and fp16 runs of one file share their drafters. A model
    built in memory is hashed as it is (as fp32: a bf16 model and its exact fp32 upcast agree).
    Drafter weights record it; loading them against another base model is refused."""
    fp = getattr(model, "fingerprint", None)
    return fp if isinstance(fp, str) else hash_tensors(model.state_dict())


def hash_tensors(state: dict) -> str:
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def hardware(device) -> str:
    """A line naming what a job ran on, for the records trainers and cost caches write."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.machine()
    try:
        name = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} threads"
