"""Write a small random checkpoint of one family, with a tokenizer and chat template (a byte-level BPE
learnt from a fixed text, its vocabulary the model's): `python -m hisparse.make_tiny
--family F --out DIR` (--no-tokenizer: token ids only, the 97-id vocabulary)."""
import argparse
from pathlib import Path

from hisparse.models.tiny import TINY_CONFIGS, TOKENIZER_VOCAB, tensor_count, write_tiny_checkpoint
from hisparse.progress import Progress
from hisparse.text import TOKENIZER_FILES


def main(argv: list[str] | None = None) -> None:
    progress = Progress()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", required=True, choices=sorted(TINY_CONFIGS))
    parser.add_argument("--out", required=True,
                        help="checkpoint directory to write (created if absent; an existing one must be empty "
                             "unless --force)")
    parser.add_argument("--force", action="store_true", help="write into a directory that holds files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files (>1 adds the index file)")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help=f"weights only: prompts are then token ids (default: a tokenizer of {TOKENIZER_VOCAB} ids "
                             f"and a chat template beside the weights)")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be >= 1, found {args.shards}")
    if args.shards > (count := tensor_count(args.family)):      # the rest would be empty files
        parser.error(f"--shards {args.shards}: a tiny {args.family} checkpoint holds {count} tensors: expected at "
                     f"most that many shards")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        parser.error(f"--out {out} already holds files (a checkpoint?): pass --force to write over it, or "
                     f"choose an empty directory")
    if args.force and out.is_dir():      # no stale shards, index or tokenizer of an earlier checkpoint
        for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json"), out / "generation_config.json",
                      out / "special_tokens_map.json", *(out / name for name in TOKENIZER_FILES)]:
            stale.unlink(missing_ok=True)
    progress(f"building a random {args.family} model (seed {args.seed}), writing {args.shards} safetensors "
             f"file{'s' if args.shards > 1 else ''}")
    out = write_tiny_checkpoint(args.family, args.out, seed=args.seed, shards=args.shards,
                                tokenizer=not args.no_tokenizer)
    print(f"wrote a tiny {args.family} checkpoint{'' if args.no_tokenizer else ' with a tokenizer'} to {out}")


if __name__ == "__main__":
    main()
