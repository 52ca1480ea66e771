import sys

from .fsck import main as fsck_main

USAGE = "usage: python -m reference fsck DIR"


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "fsck":
        print(USAGE, file=sys.stderr)
        return 2
    return fsck_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
