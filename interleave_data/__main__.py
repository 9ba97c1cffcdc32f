"""``python -m interleave_data``: see ``interleave_data.cli``."""

import sys

from interleave_data.cli import main

if __name__ == "__main__":
    sys.exit(main())
