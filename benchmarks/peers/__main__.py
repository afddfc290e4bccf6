"""`python -m benchmarks.peers`: see driver.py."""
import sys

from benchmarks.peers import driver
from vit_pure.errors import UsageError

try:
    driver.main()
except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
