import sys

from .measure import main

if __name__ == "__main__":
    sys.exit(main())
