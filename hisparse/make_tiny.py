"""Write a small random checkpoint of one family: `python -m hisparse.make_tiny --family F --out DIR`."""
import argparse
from pathlib import Path

from hisparse.models.tiny import TINY_CONFIGS, tensor_count, write_tiny_checkpoint
from hisparse.progress import Progress


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
    if args.force and out.is_dir():      # no stale shards or index of an earlier checkpoint
        for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
            stale.unlink()
    progress(f"building a random {args.family} model (seed {args.seed}), writing {args.shards} safetensors "
             f"file{'s' if args.shards > 1 else ''}")
    out = write_tiny_checkpoint(args.family, args.out, seed=args.seed, shards=args.shards)
    print(f"wrote a tiny {args.family} checkpoint to {out}")


if __name__ == "__main__":
    main()
