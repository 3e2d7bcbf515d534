"""Train the default model and the methods' drafters.

    python train.py --method tokenizer     # sentencepiece BPE on the stdlib corpus
    python train.py --method base          # the default model, weights/pylm
    python train.py --method medusa        # Medusa heads + ProPD's early heads
    python train.py --method propd         # ProPD's early heads alone
    python train.py --method bita          # BiTA's mask and prompt tokens (--prompting deep|shallow|none)
    python train.py --method hidden_transfer  # Hidden Transfer's maps W_i (--layers 5,6,7)
    python train.py --method sdsat         # SDSAT: the adaptive token and its rank-r update
    python train.py --method sdsat_full    # the paper's SDSAT: fine-tunes weights/NAME into weights/NAME-sdsat
    python train.py --method medusa --weights FILE.gguf  # drafters for another base model (dir, .gguf, org/name)
    python train.py --method base --help   # a method's own options
"""
import sys
from pathlib import Path

from nanospec import ArgumentParser, NanospecError, check_device, cli
from nanospec.io.sources import resolve
from nanospec.methods import bita, hidden_transfer, medusa, propd, sdsat, sdsat_full
from nanospec.training import pretrain
from nanospec.training.data import distill_args

ROOT = Path(__file__).parent


def medusa_args(p):
    medusa.add_args(p)
    propd.add_args(p)


def train_medusa(args):  # the Medusa heads, then ProPD's early heads on the same data
    medusa.train(args)
    propd.train(args)


def propd_args(p):
    distill_args(p)
    propd.add_args(p)


TRAINERS = {  # method -> (add_args, train)
    "tokenizer": (pretrain.add_args, pretrain.train_tok),
    "base": (pretrain.add_args, pretrain.train_base),
    "medusa": (medusa_args, train_medusa),
    "propd": (propd_args, propd.train),  # the early heads alone (Medusa's must exist to decode)
    "bita": (bita.add_args, bita.train),
    "hidden_transfer": (hidden_transfer.add_args, hidden_transfer.train),
    "sdsat": (sdsat.add_args, sdsat.train),
    "sdsat_full": (sdsat_full.add_args, sdsat_full.train),
}


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("--method", required=True, help=f"one of: {', '.join(TRAINERS)}")
    p.add_argument("--name", default="pylm", help="model name: writes weights/NAME/")
    p.add_argument("--out", help="output directory (default weights/NAME)")
    p.add_argument("--weights", help="the base model for a drafter trainer: a directory, FILE.gguf or hub id "
                   "(resolved to an HF directory, which then takes the place of --out)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--cache", default=str(ROOT / ".cache" / "train"), help="training checkpoints (not shipped)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="at most this long on each module's training steps: the schedule is cut to fit, and what "
                   "is trained so far is written (and checkpointed: --resume goes on)")
    argv = sys.argv[1:] if argv is None else list(argv)
    asks = [a for a in argv if a in ("-h", "--help")]
    if asks and not any(a.startswith("--method") for a in argv):
        p.parse_args(argv)  # the common options' help
    known, _ = p.parse_known_args([a for a in argv if a not in asks])  # --help once the method's options are in
    if known.method not in TRAINERS:
        raise NanospecError(f"unknown method {known.method!r}; choose from: {', '.join(TRAINERS)}")
    TRAINERS[known.method][0](p)
    args = p.parse_args(argv)
    if args.time_limit is not None and args.time_limit <= 0:
        raise NanospecError(f"--time-limit must be a positive number of seconds, not {args.time_limit:g}")
    if args.weights:
        if args.out or args.method in ("tokenizer", "base"):
            raise NanospecError("--weights names the base model of a drafter trainer: give it without --out, "
                                "and not for --method tokenizer or base")
        args.out = str(resolve(args.weights, log=sys.stderr))
    args.out = args.out or str(ROOT / "weights" / args.name)
    check_device(args.device)
    return args


def main(argv=None):
    args = parse_args(argv)
    TRAINERS[args.method][1](args)
    return 0


if __name__ == "__main__":
    cli(main)
