"""Write a small random checkpoint of one family: `python -m hisparse.make_tiny --family F --out DIR`."""
import argparse

from hisparse.models.tiny import TINY_CONFIGS, write_tiny_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", required=True, choices=sorted(TINY_CONFIGS))
    parser.add_argument("--out", required=True, help="checkpoint directory to write (created if absent)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files (>1 adds the index file)")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be >= 1, found {args.shards}")
    out = write_tiny_checkpoint(args.family, args.out, seed=args.seed, shards=args.shards)
    print(f"wrote a tiny {args.family} checkpoint to {out}")


if __name__ == "__main__":
    main()
